"""The router's one config dataclass; it drives `radixserve-router`'s flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from radixserve.config import Choice, setting
from radixserve.transport import TransportSecurity
from router.tenants import TenantSource


class PrefetchPolicy(Choice):
    WAIT_COMPLETE = "wait_complete"
    BEST_EFFORT = "best_effort"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class RouterConfig(TransportSecurity):
    """radixserve router: the public gRPC and HTTP APIs in front of kvcached and the model workers."""

    INTERNAL: ClassVar[bool] = False  # the public API: clients need no internal token

    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(50051, "gRPC port of the public radixserve.v1.Router service")
    metrics_port: int = setting(9101, "Prometheus metrics HTTP port; 0 turns it off")
    http_port: int = setting(8000, "HTTP port of the OpenAI-compatible and SGLang-native API (vLLM's default "
                                   "port); 0 turns it off")
    log_level: str = setting("info", "debug, info, warning or error")
    worker: tuple[str, ...] = setting(("127.0.0.1:50053",), "model worker HOST:PORT")
    kvcached: str = setting("127.0.0.1:50052", "kvcached HOST:PORT; empty = no shared prefix cache")
    kvcached_timeout_ms: int = setting(500, "deadline of a prefix match; past it the request is recomputed")
    lease_ttl_ms: int = setting(30_000, "how long kvcached pins a matched prefix if the worker never releases it")
    prefetch_policy: PrefetchPolicy = setting(PrefetchPolicy.TIMEOUT, "when a request with disk-tier pages runs")
    prefetch_timeout_ms: int = setting(200, "the timeout policy's wait: about one 128-token prefill chunk here")
    disable_radix_cache: bool = setting(False, "never reuse or cache prefixes, in kvcached or worker L1 (A/B runs)")
    cache_aware_load_slack: int = setting(2, "a worker likely holding the prompt's prefix wins while it has at most "
                                             "this many more requests in flight than the least loaded")
    max_pending_requests: int = setting(256, "most requests waiting for their first token; past it a request is "
                                             "refused at once with RESOURCE_EXHAUSTED and a retry delay")
    max_pending_tokens: int = setting(262_144, "most prompt tokens of requests waiting for their first token; "
                                               "past it, refused as above")
    api_keys_file: str = setting("", "file of '<tenant> <key>' lines: every public call must then carry "
                                     "'authorization: Bearer <key>' (UNAUTHENTICATED / HTTP 401 otherwise)")
    tenant_from: TenantSource = setting(TenantSource.SALT, "where a request's cache namespace comes from: the "
                                        "client's cache_salt, or its authenticated identity (API key's tenant, "
                                        "mTLS client certificate), so no tenant can probe another's cache")
    max_new_tokens_limit: int = setting(4096, "largest max_new_tokens a request may ask for")
    max_input_chars: int = setting(262_144, "largest text (or sum of message contents) accepted, before tokenizing")
    max_stop_strings: int = setting(16, "most stop strings per request; each is checked on every decoded token")
    max_stop_chars: int = setting(512, "longest stop string; the worker's stop filter tries every suffix up to "
                                       "this long against every string on each decoded token")
    max_messages: int = setting(1024, "most chat messages per request, checked before the chat template runs "
                                      "(a turn costs a few tokens even when empty)")
    worker_wait_s: float = setting(300.0, "how long start-up waits for the workers to come up (model loading)")
    drain_grace_s: float = setting(10.0, "seconds running requests get to finish on SIGTERM")
    otlp_traces_endpoint: str = setting("", "OTLP/gRPC collector for traces, e.g. http://127.0.0.1:4317; empty: "
                                            "OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, and without them tracing is off")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.worker:
            raise ValueError("at least one --worker is needed")
        if self.tenant_from is TenantSource.API_KEY and not self.api_keys_file:
            raise ValueError("--tenant-from api_key needs --api-keys-file")
        if self.tenant_from is TenantSource.CLIENT_CERT and not self.tls_client_auth:
            raise ValueError("--tenant-from client_cert needs --tls-client-auth (and its certificates)")
        if not 0 <= self.http_port <= 65535:
            raise ValueError("--http-port must be in [0, 65535]")
        if self.prefetch_timeout_ms < 0:
            raise ValueError("--prefetch-timeout-ms must not be negative")
        if self.kvcached_timeout_ms < 1 or self.lease_ttl_ms < 1:
            raise ValueError("--kvcached-timeout-ms and --lease-ttl-ms must be positive")
        if self.cache_aware_load_slack < 0:
            raise ValueError("--cache-aware-load-slack must not be negative")
        if self.max_pending_requests < 1 or self.max_pending_tokens < 1:
            raise ValueError("--max-pending-requests and --max-pending-tokens must be positive")
        if self.max_new_tokens_limit < 1 or self.max_input_chars < 1:
            raise ValueError("--max-new-tokens-limit and --max-input-chars must be positive")
        if self.max_stop_chars < 1 or self.max_messages < 1:
            raise ValueError("--max-stop-chars and --max-messages must be positive")
