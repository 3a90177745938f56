"""`radixserve-kvcached` / `python -m kvcached`: the per-host KV-cache daemon."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvcached import metrics
from kvcached.cache import KVCache
from kvcached.config import KVCachedConfig
from kvcached.service import KVCacheServicer, refresh_gauges
from kvcached.tiers.dram_shm import SEGMENT_PREFIX, cleanup_stale_segments
from radixserve.config import parse_config
from radixserve.server import ServiceSpec, serve, setup_logging
from radixserve.v1 import kvcached_pb2_grpc

log = logging.getLogger("kvcached")

EXPIRY_INTERVAL_S = 1.0  # leases have a TTL of seconds; checking each second keeps pinned memory bounded


async def expire_periodically(cache: KVCache) -> None:
    """Drops leases and allocations past their TTL between RPCs, so that the gauges also fall when no RPC comes."""
    while True:
        await asyncio.sleep(EXPIRY_INTERVAL_S)
        expired = cache.expire()
        if expired:
            metrics.expired.inc(expired)
            refresh_gauges(cache)


async def run(config: KVCachedConfig) -> None:
    removed = cleanup_stale_segments(SEGMENT_PREFIX)
    if removed:
        log.info("removed stale shared-memory segments of dead daemons", extra={"segments": removed})
    cache = KVCache(int(config.host_cache_size_gb * (1 << 30)), config.page_size, config.lease_ttl_s)
    expiry = asyncio.create_task(expire_periodically(cache))
    try:
        await serve("kvcached", config.host, config.port, config.metrics_port,
                    [ServiceSpec(KVCacheServicer(cache, config.page_size),
                                 kvcached_pb2_grpc.add_KVCacheServicer_to_server, "radixserve.v1.KVCache")],
                    grace_s=config.drain_grace_s)
    finally:
        expiry.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await expiry
        cache.close()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(KVCachedConfig, argv)
    setup_logging(config.log_level)
    asyncio.run(run(config))


if __name__ == "__main__":
    main()
