"""The workload builders and the load driver's bookkeeping, without a stack."""

from __future__ import annotations

import asyncio

import pytest

from bench.workloads import CONFIGS, FLOOR, MAIN_WORKLOADS, Load, Record, Sizes, _closed_loop, build, metrics, rows

CORPUS = list(range(5000))


def test_workloads_are_seeded_and_sized():
    workloads = build(CORPUS, Sizes(), seed=0)
    assert workloads == build(CORPUS, Sizes(), seed=0)
    assert workloads != build(CORPUS, Sizes(), seed=1)
    multi, document, shared, unrelated, revisit = workloads
    assert [len(s.prompts) for s in multi.sessions] == [5] * 4 and all(s.chained for s in multi.sessions)
    assert [len(p) for p in multi.sessions[0].prompts] == [512 + 28, 28, 28, 28, 28]
    assert [[len(p) for p in s.prompts] for s in document.sessions] == [[1524] * 3, [2024] * 3]
    assert len({s.prompts[0][:640] for s in shared.sessions}) == 2 and shared.concurrency == 2
    assert shared.sessions[0].prompts[0][:640] == shared.sessions[2].prompts[0][:640]  # user-major order
    assert len({s.prompts[0][:16] for s in unrelated.sessions}) == 8 and unrelated.repeats == 2
    # revisit: 2 passes, each over the same 5 documents in its own order, each visit with a new question
    visits = [(s.first_round, s.prompts[0][:1024]) for s in revisit.sessions]
    assert [r for r, _ in visits] == [0] * 5 + [1] * 5
    assert all(len({d for r, d in visits if r == p}) == 5 for p in range(2)) and len({d for _, d in visits}) == 5
    assert [d for r, d in visits if r == 0] != [d for r, d in visits if r == 1]
    assert len({s.prompts[0] for s in revisit.sessions}) == 10


def test_slices_must_fit_the_corpus():
    with pytest.raises(ValueError, match="does not fit"):
        build(CORPUS[:1000], Sizes())


def test_closed_loop_keeps_the_concurrency_and_runs_every_session_once():
    started, in_flight, most = [], 0, 0

    async def run(i: int) -> None:
        nonlocal in_flight, most
        started.append(i)
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.001 * (i % 3))
        in_flight -= 1

    asyncio.run(_closed_loop(run, 10, 3))
    assert sorted(started) == list(range(10)) and started[:3] == [0, 1, 2] and most == 3


def test_metrics_of_a_known_load():
    records = tuple(Record(session=i, turn=0, prompt_tokens=100, completion_tokens=4, cached_tokens=25 * i,
                           cached_tokens_l1=25 * i, cached_tokens_l2=0, cached_tokens_l3=0, ttft_ms=10.0 * (i + 1),
                           itl_ms=None if i == 0 else 2.0, e2e_ms=50.0, prefetch_wait_ms=1.0) for i in range(4))
    summary = {name: value for name, (value, _) in metrics(Load(records, wall_s=2.0)).items()}
    assert summary["TTFT mean"] == 25.0 and summary["TTFT p50"] == 25.0 and summary["TTFT p99"] == pytest.approx(39.7)
    assert summary["inter-token latency mean"] == 2.0
    assert summary["throughput"] == 2.0 and summary["output throughput"] == 8.0
    assert summary["hit ratio"] == 150 / 400 and summary["prefetch wait mean"] == 1.0


def _load(ttft_ms: list[float], turns: list[int], cached: int = 0) -> Load:
    return Load(tuple(Record(0, t, 100, 4, cached, cached, 0, 0, ms, 2.0, 50.0, 0.0) for ms, t in zip(ttft_ms, turns)),
                wall_s=1.0)


def test_rows_compare_each_configuration_with_its_baseline_and_rounds():
    on, off = _load([10.0, 20.0], [0, 1], cached=50), _load([40.0, 80.0], [0, 1])
    table = {r.name: r for r in rows("multi_turn", "on", on, "off", off)}
    assert table["multi_turn: TTFT mean"].ratio == 0.25 and table["multi_turn: hit ratio"].ours == 0.5
    second = table["multi_turn: round 2 TTFT mean"]
    assert second.ours == 20.0 and second.baseline == 80.0
    assert table["multi_turn: round 2 TTFT mean"].goal == ""  # the goal is on round 5
    policy = {r.name for r in rows("revisit", "l3_timeout", on, "l2", off)}
    assert {"revisit, l3_timeout vs l2: hit ratio from L3", "revisit, l3_timeout vs l2: round 1 TTFT mean"} <= policy
    floor = {r.name for r in rows("no_reuse", "on", on, FLOOR.name, off)}
    assert floor == {f"no_reuse, on vs transformers: {m}" for m in ("TTFT mean", "TTFT p50", "output throughput")}


def test_every_configuration_has_a_known_baseline_running_its_workloads():
    names = {c.name: c for c in CONFIGS}
    for config in CONFIGS:
        if config.baseline:
            assert set(config.workloads) <= set(names[config.baseline].workloads)
    assert set(FLOOR.workloads) <= set(MAIN_WORKLOADS) == set(names["on"].workloads)
