"""`radixserve-router` / `python -m router`: connect to the workers, load their tokenizer, serve the public API over
gRPC and (unless `--http-port 0`) HTTP."""

from __future__ import annotations

import asyncio
import logging

from radixserve.config import parse_config
from radixserve.server import ServiceSpec, die_with_launcher, keep_freed_memory, serve, setup_logging
from radixserve.transport import server_ssl_context
from radixserve.v1 import router_pb2_grpc
from router.admission import Admission
from router.config import RouterConfig
from router.http_server import start_http
from router.prefix import PrefixMatcher
from router.routing import WorkerPool, connect_worker
from router.service import Router, RouterServicer
from router.tenants import Tenants, read_api_keys
from router.tokenizer import TokenizerLanes
from router.validation import Limits

log = logging.getLogger("router")


async def run(config: RouterConfig) -> None:
    workers = await asyncio.gather(*(connect_worker(a, config.worker_wait_s, config) for a in config.worker))
    pool = WorkerPool(list(workers), config.cache_aware_load_slack)
    model = pool.model
    tokenizers = TokenizerLanes.load(workers[0].info.model_path)
    limits = Limits(vocab_size=model.vocab_size, max_context=model.max_context,
                    max_new_tokens=config.max_new_tokens_limit, max_input_chars=config.max_input_chars,
                    max_stop_strings=config.max_stop_strings, max_stop_chars=config.max_stop_chars,
                    max_messages=config.max_messages)
    log.info("workers ready", extra={"workers": list(config.worker), "model": model.name,
                                     "fingerprint": model.fingerprint})
    matcher = None
    if config.kvcached and not config.disable_radix_cache:
        matcher = PrefixMatcher(config.kvcached, config, config.kvcached_timeout_ms / 1e3,
                                config.lease_ttl_ms, config.prefetch_policy, config.prefetch_timeout_ms / 1e3,
                                model.name)
    if matcher:
        log.info("Radix cache enabled", extra={"kvcached": config.kvcached,
                                               "prefetch_policy": str(config.prefetch_policy),
                                               "prefetch_timeout_ms": config.prefetch_timeout_ms})
    else:
        log.info("Radix cache disabled")
    tenants = Tenants(config.tenant_from, read_api_keys(config.api_keys_file) if config.api_keys_file else {})
    router = Router(pool, tokenizers, limits, matcher, Admission(config.max_pending_requests, config.max_pending_tokens),
                    tenants)
    watch = asyncio.create_task(pool.watch())
    serving = lambda: pool.serving  # noqa: E731 -- the router serves while some worker does
    http = (await start_http(router, config.host, config.http_port, config.drain_grace_s, server_ssl_context(config))
            if config.http_port else None)
    try:
        await serve("router", config.host, config.port, config.metrics_port,
                    [ServiceSpec(RouterServicer(router), router_pb2_grpc.add_RouterServicer_to_server,
                                 "radixserve.v1.Router")],
                    grace_s=config.drain_grace_s, components={"": serving, "radixserve.v1.Router": serving},
                    security=config, also_drain=http.cleanup if http is not None else None,
                    traces_endpoint=config.otlp_traces_endpoint)
    finally:
        watch.cancel()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(RouterConfig, argv)
    die_with_launcher()
    keep_freed_memory()
    setup_logging(config.log_level)
    asyncio.run(run(config))


if __name__ == "__main__":
    main()
