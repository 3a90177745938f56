"""The disk tier through real processes: warm restart, the three prefetch policies, corruption.

    router_warm ──► worker_a ──┐
    router_wait ──► worker_b ──┤   worker_b never computes the test prompts itself, so anything it reuses after
    router_timeout ► worker_b ─┼─► kvcached   kvcached restarts came from L3 (loaded into L2 by a prefetch)
    router_best ───► worker_b ─┘
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from radixserve.v1 import router_pb2
from tests.stack import REPO, Processes, kvcached_stats, router_stub, wait_for
from tests.test_e2e_cache import GREEDY, PAGE, ask, document

pytestmark = pytest.mark.e2e

READ_DELAY_MS = 15  # per L3 block after the restart: ~25 pages load in ~0.4 s (batches of 8: 120 ms each), so the
#                     200 ms timeout policy dispatches with part of them


def generate(router: str, messages) -> router_pb2.GenerateResponse:
    (response,) = router_stub(router).Generate(router_pb2.GenerateRequest(messages=messages, sampling=GREEDY),
                                               timeout=120)
    return response


def disk_blocks(kvcached: str) -> int:
    return kvcached_stats(kvcached).disk.blocks


def restart_kvcached(processes: Processes, address: str, args: list[str], before_start=lambda: None) -> None:
    """SIGTERM (the daemon flushes L3 and exits), `before_start()`, then a new daemon on the same port and disk."""
    daemon = next(p for p in processes.stack.processes if p.args[2] == "kvcached")
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    processes.stack.processes.remove(daemon)
    before_start()
    with open(processes.log_dir / "kvcached.log", "ab") as log:
        processes.stack.start("kvcached", int(address.rsplit(":", 1)[1]), [
            "--metrics-port", "0", "--host-cache-size-gb", "0.5", "--disk-cache-path",
            str(processes.log_dir / "kvcached-l3"), "--disk-cache-size-gb", "1", *args],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    processes = Processes(tmp_path_factory.mktemp("logs"))
    try:
        kvcached, worker_a, worker_b = processes.kvcached_and_two_workers()
        routers = {"warm": processes.router([worker_a], kvcached, "router_warm")}
        for policy in ("wait_complete", "timeout", "best_effort"):
            routers[policy] = processes.router([worker_b], kvcached, f"router_{policy}",
                                               ["--prefetch-policy", policy, "--prefetch-timeout-ms", "200"])
        prompts = {name: ask(document(40 + i), "Which lamp was lit?") for i, name in enumerate(
            ("wait_complete", "timeout", "best_effort"))}
        answers = {name: generate(routers["warm"], p) for name, p in prompts.items()}
        pages = sum(a.usage.prompt_tokens // PAGE for a in answers.values())
        assert wait_for(lambda: disk_blocks(kvcached) >= pages)
        # The slowed reads would make kvcached's load-or-recompute model judge L3 not worth it; say recompute is
        # slower still, so every policy gets its prefetch.
        restart_kvcached(processes, kvcached, ["--l3-read-delay-ms", str(READ_DELAY_MS),
                                               "--recompute-tokens-per-s", "20"])
        assert wait_for(lambda: len(kvcached_stats(kvcached).namespaces) == 1)  # the workers' heartbeat
        yield processes, kvcached, routers, prompts, answers
    finally:
        processes.stop()


def test_warm_restart_serves_from_l3_with_equal_output(cluster):
    _, _, routers, prompts, answers = cluster
    hit = generate(routers["wait_complete"], prompts["wait_complete"])
    full_pages = (hit.usage.prompt_tokens - 1) // PAGE
    assert hit.usage.cached_tokens_l3 >= 0.9 * full_pages * PAGE
    assert hit.usage.cached_tokens_l1 == 0
    assert hit.timings.prefetch_wait_ms >= 0.9 * full_pages * READ_DELAY_MS
    assert list(hit.token_ids) == list(answers["wait_complete"].token_ids)


def test_timeout_policy_dispatches_at_the_timeout(cluster):
    _, _, routers, prompts, answers = cluster
    partial = generate(routers["timeout"], prompts["timeout"])
    full_pages = (partial.usage.prompt_tokens - 1) // PAGE
    assert 180 <= partial.timings.prefetch_wait_ms < 600
    assert 0 < partial.usage.cached_tokens_l3 < full_pages * PAGE
    assert list(partial.token_ids) == list(answers["timeout"].token_ids)


def test_best_effort_does_not_wait(cluster):
    _, _, routers, prompts, answers = cluster
    now = generate(routers["best_effort"], prompts["best_effort"])
    assert now.timings.prefetch_wait_ms == 0
    assert now.usage.cached_tokens_l3 == 0
    assert list(now.token_ids) == list(answers["best_effort"].token_ids)


def test_requests_without_disk_pages_never_wait(cluster):
    _, _, routers, _, _ = cluster
    fresh = generate(routers["wait_complete"], ask(document(90), "Anything new?"))
    assert fresh.timings.prefetch_wait_ms == 0 and fresh.usage.cached_tokens_l3 == 0


def test_corrupt_blocks_are_detected_counted_and_recomputed(cluster):
    processes, kvcached, routers, prompts, answers = cluster
    fingerprint = router_stub(routers["warm"]).ListModels(router_pb2.ListModelsRequest()).models[0].fingerprint
    data = processes.log_dir / "kvcached-l3" / "data.mdb"

    def corrupt_every_payload() -> None:
        raw = bytearray(data.read_bytes())
        start = raw.find(fingerprint.encode())
        while start != -1:
            raw[start + len(fingerprint) + 100] ^= 0xFF  # inside the block's bytes, past its header
            start = raw.find(fingerprint.encode(), start + 1)
        data.write_bytes(bytes(raw))

    restart_kvcached(processes, kvcached, ["--recompute-tokens-per-s", "20"], before_start=corrupt_every_payload)
    assert wait_for(lambda: len(kvcached_stats(kvcached).namespaces) == 1)
    again = generate(routers["wait_complete"], prompts["best_effort"])
    assert again.usage.cached_tokens_l3 == 0
    assert kvcached_stats(kvcached).disk.corrupt_blocks >= 1
    assert list(again.token_ids) == list(answers["best_effort"].token_ids)
