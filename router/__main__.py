"""`radixserve-router` / `python -m router`: connect to the workers, load their tokenizer, serve the public API."""

from __future__ import annotations

import asyncio
import logging

from radixserve.config import parse_config
from radixserve.server import ServiceSpec, die_with_launcher, serve, setup_logging
from radixserve.v1 import router_pb2_grpc
from router.admission import Admission
from router.config import RouterConfig
from router.prefix import PrefixMatcher
from router.routing import WorkerPool, connect_worker
from router.service import RouterServicer
from router.tokenizer import PromptTokenizer
from router.validation import Limits

log = logging.getLogger("router")


async def run(config: RouterConfig) -> None:
    workers = await asyncio.gather(*(connect_worker(a, config.worker_wait_s) for a in config.worker))
    pool = WorkerPool(list(workers), config.cache_aware_load_slack)
    model = pool.model
    tokenizer = PromptTokenizer(workers[0].info.model_path)
    limits = Limits(vocab_size=model.vocab_size, max_context=model.max_context,
                    max_new_tokens=config.max_new_tokens_limit, max_input_chars=config.max_input_chars,
                    max_stop_strings=config.max_stop_strings, max_stop_chars=config.max_stop_chars,
                    max_messages=config.max_messages)
    log.info("workers ready", extra={"workers": list(config.worker), "model": model.name,
                                     "fingerprint": model.fingerprint})
    matcher = None
    if config.kvcached and not config.disable_radix_cache:
        matcher = PrefixMatcher(config.kvcached, config.kvcached_timeout_ms / 1e3,
                                config.lease_ttl_ms, config.prefetch_policy, config.prefetch_timeout_ms / 1e3)
    if matcher:
        log.info("Radix cache enabled", extra={"kvcached": config.kvcached,
                                               "prefetch_policy": str(config.prefetch_policy),
                                               "prefetch_timeout_ms": config.prefetch_timeout_ms})
    else:
        log.info("Radix cache disabled")
    servicer = RouterServicer(pool, tokenizer, limits, matcher,
                              Admission(config.max_pending_requests, config.max_pending_tokens))
    watch = asyncio.create_task(pool.watch())
    serving = lambda: pool.serving  # noqa: E731 -- the router serves while some worker does
    try:
        await serve("router", config.host, config.port, config.metrics_port,
                    [ServiceSpec(servicer, router_pb2_grpc.add_RouterServicer_to_server, "radixserve.v1.Router")],
                    grace_s=config.drain_grace_s, components={"": serving, "radixserve.v1.Router": serving})
    finally:
        watch.cancel()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(RouterConfig, argv)
    die_with_launcher()
    setup_logging(config.log_level)
    asyncio.run(run(config))


if __name__ == "__main__":
    main()
