"""Structured output, parallel sampling and the HTTP API against their plain counterparts (issues 13 and 15),
through one real stack (kvcached, a worker, the router with its HTTP API on loopback). Each comparison gets its own
text cut from the corpus, so neither side finds the other's prefix cached.

- constrained: decode tokens/s of greedy output under a JSON schema against the same prompts unconstrained (64
  tokens, ignore_eos), one request at a time, timed by the router (`timings`: after the first token to the last).
- jump-forward: greedy output under a schema of long fixed keys, on a worker with jump-forward (the default) and on
  one with `--disable-jump-forward` (each side with its own cache salt): output tokens/s and TTFT, and whether the
  outputs are the same.
- samples: `n` = 8 samples of one ~500-token prompt in one request against 8 concurrent requests of it (seeds 0..7,
  temperature 1, 32 tokens each, each side on a prompt the cache has never seen): wall time and the slowest TTFT.
- http: a multi-turn chat (4 conversations of 4 rounds over a ~300-token system prompt, 16 greedy tokens per
  answer, conversations one after another) over gRPC and over HTTP (`/v1/chat/completions`, streamed, with
  httpx2): mean TTFT as the client sees it, and rounds per second.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2 as httpx

from bench import Row, local_services
from radixserve.launch import free_port
from radixserve.v1 import router_pb2, router_pb2_grpc

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
PERSON = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "city": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "city", "age", "hobbies"]})
ASKS = ["Describe a sailor from the harbour as JSON.", "Describe the clockmaker as JSON.",
        "Describe a farmer who keeps the ledger as JSON.", "Describe a child counting boats as JSON."]


def _text(start: int, words: int) -> str:
    return " ".join(CORPUS.read_text().split()[start:start + words])


def run(dtype: str) -> list[Row]:
    with local_services("sampling") as services:
        kvcached = services.kvcached()
        worker = services.worker(kvcached, args=["--dtype", dtype])
        plain = services.worker(kvcached, "worker_plain", args=["--dtype", dtype, "--disable-jump-forward"])
        http_port = free_port()
        router = services.router([worker], kvcached, http_port=http_port)
        router_plain = services.router([plain], kvcached, "router_plain")
        with grpc.insecure_channel(router) as channel, grpc.insecure_channel(router_plain) as plain_channel:
            stub, plain_stub = router_pb2_grpc.RouterStub(channel), router_pb2_grpc.RouterStub(plain_channel)
            for warm in (stub, plain_stub):
                _generate(warm, router_pb2.GenerateRequest(text="warm up", sampling=router_pb2.SamplingParams(
                    temperature=0, max_new_tokens=4)))
            return [*constrained(stub), *jump_forward(stub, plain_stub), *samples(stub),
                    *transports(stub, f"http://127.0.0.1:{http_port}")]


def _generate(stub: router_pb2_grpc.RouterStub, request: router_pb2.GenerateRequest
              ) -> list[router_pb2.GenerateResponse]:
    return list(stub.Generate(request, timeout=600))


def _decode_rate(response: router_pb2.GenerateResponse) -> float:
    """Tokens per second after the first, by the router's clock."""
    decode_s = (response.timings.e2e_ms - response.timings.ttft_ms) / 1e3
    return (response.usage.completion_tokens - 1) / decode_s


def constrained(stub: router_pb2_grpc.RouterStub) -> list[Row]:
    rates: dict[str, list[float]] = {"json_schema": [], "none": []}
    for i, ask in enumerate(ASKS * 2):
        for kind, sampling in (("json_schema", router_pb2.SamplingParams(
                temperature=0, max_new_tokens=64, json_schema=PERSON)), ("none", router_pb2.SamplingParams(
                temperature=0, max_new_tokens=64, ignore_eos=True))):
            messages = [router_pb2.ChatMessage(role="user", content=f"{ask} ({kind} {i})")]
            (response,) = _generate(stub, router_pb2.GenerateRequest(messages=messages, sampling=sampling))
            if kind == "json_schema":
                json.loads(response.text)  # the benchmark measures valid output only
            rates[kind].append(_decode_rate(response))
    return [Row(f"decode tokens/s, greedy under a JSON schema vs unconstrained, mean of {len(rates['none'])}",
                statistics.mean(rates["json_schema"]), statistics.mean(rates["none"]), "tokens/s", ">= 0.90x")]


ACCOUNT = json.dumps({"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 20},
    "customer_account_number": {"type": "integer", "minimum": 0, "maximum": 99999},
    "preferred_contact_channel": {"enum": ["electronic_mail", "telephone_call", "postal_letter"]},
    "account_opening_year": {"type": "integer", "minimum": 1900, "maximum": 2026},
    "is_premium_customer_account": {"type": "boolean"}},
    "required": ["customer_full_name", "customer_account_number", "preferred_contact_channel",
                 "account_opening_year", "is_premium_customer_account"]})


def jump_forward(stub: router_pb2_grpc.RouterStub, plain_stub: router_pb2_grpc.RouterStub) -> list[Row]:
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=160, json_schema=ACCOUNT)
    results: dict[str, list[router_pb2.GenerateResponse]] = {"on": [], "off": []}
    for i, ask in enumerate(ASKS * 2):
        for side, side_stub in (("on", stub), ("off", plain_stub)):
            messages = [router_pb2.ChatMessage(role="user", content=f"{ask} ({i})")]
            (response,) = _generate(side_stub, router_pb2.GenerateRequest(messages=messages, sampling=sampling,
                                                                          cache_salt=f"jump-forward {side}"))
            json.loads(response.text)
            results[side].append(response)
    same = sum(a.token_ids == b.token_ids for a, b in zip(results["on"], results["off"]))

    def rate(side: str) -> float:
        return (sum(r.usage.completion_tokens for r in results[side])
                / sum(r.timings.e2e_ms / 1e3 for r in results[side]))

    def ttft(side: str) -> float:
        return statistics.mean(r.timings.ttft_ms for r in results[side])

    label = f"greedy JSON, 5 long fixed keys, jump-forward on vs off ({same}/{len(results['on'])} outputs equal)"
    return [Row(f"{label}: output tokens/s", rate("on"), rate("off"), "tokens/s", "> 1x"),
            Row(f"{label}: TTFT", ttft("on"), ttft("off"), "ms", "~1x")]


def samples(stub: router_pb2_grpc.RouterStub, n: int = 8) -> list[Row]:
    def request(prompt: str, **sampling) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(text=prompt, sampling=router_pb2.SamplingParams(
            temperature=1.0, max_new_tokens=32, ignore_eos=True, **sampling))

    started = time.perf_counter()
    together = _generate(stub, request(_text(0, 380), n=n, seed=0))
    together_s = time.perf_counter() - started
    assert sorted(r.index for r in together) == list(range(n)), "n samples: one final message each"
    prompt = _text(2000, 380)
    with ThreadPoolExecutor(n) as pool:
        started = time.perf_counter()
        separate = list(pool.map(lambda seed: _generate(stub, request(prompt, seed=seed))[-1], range(n)))
        separate_s = time.perf_counter() - started
    tokens = together[-1].usage.completion_tokens
    return [
        Row(f"n={n} samples of a {together[-1].usage.prompt_tokens}-token prompt: one request vs {n} concurrent, "
            "wall time", together_s * 1e3, separate_s * 1e3, "ms", "< 1x"),
        Row(f"n={n}: TTFT vs the slowest of {n} concurrent requests' TTFT", together[-1].timings.ttft_ms,
            max(r.timings.ttft_ms for r in separate), "ms", "< 1x"),
        Row(f"n={n}: output tokens/s, one request vs {n} concurrent", tokens / together_s,
            sum(r.usage.completion_tokens for r in separate) / separate_s, "tokens/s", "> 1x"),
    ]


def transports(stub: router_pb2_grpc.RouterStub, http_url: str, conversations: int = 4, rounds: int = 4
               ) -> list[Row]:
    questions = ["What is this about?", "Who is named?", "What happens next?", "Say it in one word."]

    def over_grpc(messages: list[dict]) -> tuple[float, str]:
        started, ttft, text = time.perf_counter(), None, []
        for response in stub.Generate(router_pb2.GenerateRequest(
                messages=[router_pb2.ChatMessage(**m) for m in messages], stream=True,
                sampling=router_pb2.SamplingParams(temperature=0, max_new_tokens=16)), timeout=600):
            ttft = ttft or (time.perf_counter() - started if response.token_ids else None)
            text.append(response.text)
        return ttft, "".join(text)

    def over_http(messages: list[dict]) -> tuple[float, str]:
        started, ttft, text = time.perf_counter(), None, []
        body = {"messages": messages, "temperature": 0, "max_tokens": 16, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ttft = ttft or time.perf_counter() - started
                text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        return ttft, "".join(text)

    results = {}
    with httpx.Client(base_url=http_url, timeout=600) as client:
        for name, send, offset in (("grpc", over_grpc, 4000), ("http", over_http, 6000)):
            ttfts, started = [], time.perf_counter()
            for c in range(conversations):
                messages = [{"role": "system", "content": "Answer briefly.\n" + _text(offset + c * 300, 220)}]
                for question in questions[:rounds]:
                    messages.append({"role": "user", "content": question})
                    ttft, answer = send(messages)
                    ttfts.append(ttft)
                    messages.append({"role": "assistant", "content": answer})
            results[name] = (statistics.mean(ttfts) * 1e3, len(ttfts) / (time.perf_counter() - started))
    (http_ttft, http_rate), (grpc_ttft, grpc_rate) = results["http"], results["grpc"]
    label = f"multi-turn chat, {conversations} x {rounds} rounds, streamed"
    return [Row(f"{label}: mean TTFT, HTTP vs gRPC", http_ttft, grpc_ttft, "ms", "<= 1.05x"),
            Row(f"{label}: rounds/s, HTTP vs gRPC", http_rate, grpc_rate, "rounds/s", ">= 0.95x")]
