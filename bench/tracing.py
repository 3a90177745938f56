"""`python -m bench.tracing`: what tracing costs. The same requests, in one run, against fresh stacks (kvcached, one
worker, the router) in each of three modes, alternating for `--rounds`: tracing off (no endpoint), on with an endpoint
nobody answers (every span made, every export failing), and exporting to a real OTLP receiver in this process. Every
stack starts cold alike; the TTFT is the router's (p50), the throughput generated tokens over the batch's wall time.

`Receiver` is that OTLP/gRPC trace endpoint; tests/test_e2e_observability.py receives its spans with it too.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from radixserve.launch import LocalServices, free_port
from radixserve.v1 import router_pb2, router_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace endpoint on a free loopback port (`endpoint`): keeps every span with its service name.
    `stop()` when done."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.endpoint = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[tuple[str, object]]:
        """(service, span) of every span received with `trace_id` (hex)."""
        with self._lock:
            return [(service, span) for service, span in self.spans if span.trace_id.hex() == trace_id]

    def stop(self) -> None:
        self._server.stop(0)


def prompts(count: int) -> list[str]:
    return [f"Request {i}. Write one sentence about the harbour, the lamps and the mill." for i in range(count)]


def measure(router: str, salt: str, count: int, clients: int, max_new_tokens: int) -> dict[str, float]:
    """TTFT p50 (ms) and generated tokens/s of `count` requests from `clients` concurrent clients."""
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(router))
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)

    def one(text: str) -> router_pb2.GenerateResponse:
        return list(stub.Generate(router_pb2.GenerateRequest(text=text, sampling=sampling, cache_salt=salt),
                                  timeout=600))[-1]

    started = time.monotonic()
    with futures.ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(one, prompts(count)))
    wall = time.monotonic() - started
    return {"ttft_p50_ms": statistics.median(a.timings.ttft_ms for a in answers),
            "tokens_per_s": sum(a.usage.completion_tokens for a in answers) / wall}


def run(count: int, clients: int, max_new_tokens: int, rounds: int) -> list[tuple[str, dict[str, float]]]:
    """(mode, measurement) for each mode in each round; the modes alternate, so a busy machine's drift shows."""
    receiver = Receiver()
    modes = {"off": [], "on, no endpoint answering": ["--otlp-traces-endpoint", f"127.0.0.1:{free_port()}"],
             "exporting": ["--otlp-traces-endpoint", receiver.endpoint]}
    results = []
    try:
        for _ in range(rounds):
            for mode, flags in modes.items():
                with tempfile.TemporaryDirectory() as logs:
                    services = LocalServices(Path(logs))
                    try:
                        kvcached = services.kvcached(args=flags)
                        worker = services.worker(kvcached, args=flags)
                        router = services.router([worker], kvcached, args=flags)
                        measure(router, "warm", 2, 1, 4)  # first-call costs out of the way
                        results.append((mode, measure(router, mode, count, clients, max_new_tokens)))
                    finally:
                        services.stop()  # each service flushes its spans as it exits
                print(mode, results[-1][1], flush=True)
    finally:
        receiver.stop()
    print(f"spans received while exporting: {len(receiver.spans)}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = run(args.requests, args.clients, args.max_new_tokens, args.rounds)
    print("| tracing | TTFT p50 ms | tokens/s |\n|---|---|---|")
    for mode, r in results:
        print(f"| {mode} | {r['ttft_p50_ms']:.0f} | {r['tokens_per_s']:.1f} |")


if __name__ == "__main__":
    main()
