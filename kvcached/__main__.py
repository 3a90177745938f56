"""`radixserve-kvcached` / `python -m kvcached`: the per-host KV-cache daemon."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from kvcached import metrics
from kvcached.cache import KVCache
from kvcached.config import KVCachedConfig
from kvcached.l3 import L3
from kvcached.prefetch import Prefetcher
from kvcached.service import KVCacheServicer
from kvcached.tiers.dram_shm import cleanup_stale_segments
from kvcached.tiers.lmdb_tier import DiskTier, DiskTierError
from radixserve.config import parse_config
from radixserve.server import ServiceSpec, die_with_launcher, keep_freed_memory, serve, setup_logging
from radixserve.v1 import kvcache_pb2_grpc

log = logging.getLogger("kvcached")

DISK_HEALTH = "radixserve.v1.KVCache/disk"  # health name of the L3 tier: NOT_SERVING after an I/O error
EXPIRY_INTERVAL_S = 1.0  # leases have a TTL of seconds; checking each second keeps pinned memory bounded
IDLE_CHECK_S = 5.0  # quiet this long before the idle integrity check


async def housekeeping(cache: KVCache, servicer: KVCacheServicer) -> None:
    """Between RPCs: drops leases and allocations past their TTL and applies the disk tier's events; once it has been
    idle for `IDLE_CHECK_S`, checks the index and pools once (it costs ~45 ms per 100k blocks, so never under load)."""
    checked_at = 0.0
    while True:
        await asyncio.sleep(EXPIRY_INTERVAL_S)
        try:
            metrics.expired.inc(cache.expire())
            if cache.l3 is not None:
                cache.l3.refresh()  # applies L3 evictions and corrupt-block deletions to the index
            idle_since = servicer.last_rpc_at
            if time.monotonic() - idle_since > IDLE_CHECK_S and checked_at < idle_since:
                checked_at = time.monotonic()
                check_idle(cache)
        except Exception:  # one bad round must not end expiry for good: leases would pin L2 forever
            log.exception("housekeeping failed; trying again next round")
            metrics.background_errors.labels(task="housekeeping").inc()


def check_idle(cache: KVCache) -> None:
    try:
        cache.check_integrity()
    except AssertionError as e:
        metrics.integrity_failures.inc()
        log.error("integrity check failed", extra={"error": str(e)})


def open_disk(config: KVCachedConfig) -> DiskTier | None:
    """The L3 tier, or None when it is off or (with --disk-cache-optional) cannot open."""
    if config.disk_cache_size_gb == 0:
        log.info("disk tier off", extra={"disk_cache_size_gb": 0})
        return None
    try:
        disk = DiskTier(config.disk_cache_path, int(config.disk_cache_size_gb * (1 << 30)),
                        read_delay_s=config.l3_read_delay_ms / 1e3)
    except DiskTierError as e:
        if not config.disk_cache_optional:
            raise SystemExit(f"kvcached: cannot open the disk tier: {e} (--disk-cache-optional runs without it)")
        log.error("disk tier unavailable; running with L2 only", extra={"error": str(e)})
        return None
    return disk


async def run(config: KVCachedConfig) -> None:
    removed = cleanup_stale_segments()
    if removed:
        log.info("removed stale shared-memory segments of dead daemons", extra={"segments": removed})
    disk = open_disk(config)
    l3 = L3(disk, config.write_policy) if disk is not None else None
    cache = KVCache(int(config.host_cache_size_gb * (1 << 30)), config.page_size, config.lease_ttl_s, l3=l3,
                    max_ttl_s=config.max_lease_ttl_s, max_allocation_slots=config.max_allocation_slots)
    metrics.watch(cache)
    prefetcher = disk and Prefetcher(cache, disk, config.prefetch_threads, config.prefetch_read_timeout_s,
                                     config.prefetch_threshold_tokens, config.page_size, config.recompute_tokens_per_s)
    servicer = KVCacheServicer(cache, config.page_size, prefetcher)
    expiry = asyncio.create_task(housekeeping(cache, servicer))
    try:
        await serve("kvcached", config.host, config.port, config.metrics_port,
                    [ServiceSpec(servicer,
                                 kvcache_pb2_grpc.add_KVCacheServicer_to_server, "radixserve.v1.KVCache")],
                    grace_s=config.drain_grace_s, security=config, traces_endpoint=config.otlp_traces_endpoint,
                    components={DISK_HEALTH: (lambda: disk.healthy)} if disk is not None else None)
    finally:
        expiry.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await expiry
        if prefetcher is not None:
            prefetcher.close()
        if disk is not None:  # graceful stop: what was queued for L3 is written, so a restart finds it
            flushed = disk.close()
            log.info("disk tier flushed and closed", extra={"complete": flushed})
        cache.close()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(KVCachedConfig, argv)
    die_with_launcher()
    keep_freed_memory()
    setup_logging(config.log_level)
    asyncio.run(run(config))


if __name__ == "__main__":
    main()
