"""kvcached's one config dataclass; it drives `radixserve-kvcached`'s flags."""

from __future__ import annotations

from dataclasses import dataclass

from kvcached.l3 import WritePolicy
from radixserve.config import cache_root, setting
from radixserve.transport import TransportSecurity


@dataclass(frozen=True)
class KVCachedConfig(TransportSecurity):
    """radixserve kvcached: the per-host KV-cache daemon (radix prefix index, shared-memory L2, LMDB L3)."""

    host: str = setting("127.0.0.1", "address to bind (loopback: workers share this host's memory)")
    port: int = setting(50052, "gRPC port")
    metrics_port: int = setting(9102, "Prometheus metrics HTTP port; 0 turns it off")
    log_level: str = setting("info", "debug, info, warning or error")
    host_cache_size_gb: float = setting(4.0, "L2 shared-memory pool per model, GiB (~180k tokens of SmolLM2-135M)")
    page_size: int = setting(16, "tokens per block; workers must register the same page size")
    disk_cache_path: str = setting(str(cache_root() / "l3"), "LMDB environment of the L3 tier (persists restarts)")
    disk_cache_size_gb: float = setting(16.0, "L3 size bound in GiB; 0 turns the disk tier off")
    disk_cache_optional: bool = setting(False, "if the disk tier cannot open, run without it instead of exiting")
    write_policy: WritePolicy = setting(WritePolicy.WRITE_THROUGH, "which blocks go to L3, always off the request path")
    prefetch_threshold_tokens: int = setting(128, "shortest L3 run worth prefetching: below it, recompute is as cheap")
    prefetch_threads: int = setting(4, "threads reading L3 for prefetches; a stuck read holds one, never all")
    prefetch_read_timeout_s: float = setting(2.0, "a single L3 read slower than this ends its prefetch")
    recompute_tokens_per_s: float = setting(800.0, "prefill speed assumed by the load-or-recompute decision "
                                                   "(SmolLM2-135M float32 on 2 CPU cores)")
    l3_read_delay_ms: float = setting(0.0, "TEST ONLY: slows every L3 read, to exercise prefetch policies")
    lease_ttl_s: float = setting(30.0, "a lease or allocation a crashed worker never released expires after this")
    max_lease_ttl_s: float = setting(300.0, "longest TTL a caller may ask for; a longer ask is refused, so nobody "
                                            "pins L2 for days")
    max_allocation_slots: int = setting(1024, "most slots one AllocateSlots may take (1,024 pages: 16k tokens at "
                                              "page size 16); a larger ask is refused, so nobody empties L2")
    drain_grace_s: float = setting(5.0, "seconds in-flight RPCs get to finish on SIGTERM")
    otlp_traces_endpoint: str = setting("", "OTLP/gRPC collector for traces, e.g. http://127.0.0.1:4317; empty: "
                                            "OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, and without them tracing is off")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.host_cache_size_gb <= 0:
            raise ValueError("--host-cache-size-gb must be positive")
        if self.page_size < 1:
            raise ValueError("--page-size must be at least 1")
        if not 0 < self.lease_ttl_s <= self.max_lease_ttl_s:
            raise ValueError("--lease-ttl-s must be positive and at most --max-lease-ttl-s")
        if self.max_allocation_slots < 1:
            raise ValueError("--max-allocation-slots must be positive")
        if self.disk_cache_size_gb < 0 or self.prefetch_threshold_tokens < 0 or self.l3_read_delay_ms < 0:
            raise ValueError("--disk-cache-size-gb, --prefetch-threshold-tokens, --l3-read-delay-ms must be >= 0")
        if self.prefetch_threads < 1 or self.prefetch_read_timeout_s <= 0 or self.recompute_tokens_per_s <= 0:
            raise ValueError("--prefetch-threads, --prefetch-read-timeout-s, --recompute-tokens-per-s must be > 0")
