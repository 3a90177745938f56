"""kvcached's one config dataclass; it drives `radixserve-kvcached`'s flags."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config import setting


@dataclass(frozen=True)
class KVCachedConfig:
    """radixserve kvcached: the per-host KV-cache daemon (radix prefix index over a shared-memory DRAM tier)."""

    host: str = setting("127.0.0.1", "address to bind (loopback: workers share this host's memory)")
    port: int = setting(50052, "gRPC port")
    metrics_port: int = setting(9102, "Prometheus metrics HTTP port; 0 turns it off")
    log_level: str = setting("info", "debug, info, warning or error")
    host_cache_size_gb: float = setting(4.0, "L2 shared-memory pool per model, GiB (~180k tokens of SmolLM2-135M)")
    page_size: int = setting(16, "tokens per block; workers must register the same page size")
    lease_ttl_s: float = setting(30.0, "a lease or allocation a crashed worker never released expires after this")
    drain_grace_s: float = setting(5.0, "seconds in-flight RPCs get to finish on SIGTERM")

    def __post_init__(self) -> None:
        if self.host_cache_size_gb <= 0:
            raise ValueError("--host-cache-size-gb must be positive")
        if self.page_size < 1:
            raise ValueError("--page-size must be at least 1")
        if self.lease_ttl_s <= 0:
            raise ValueError("--lease-ttl-s must be positive")
