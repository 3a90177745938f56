"""The pure part of `python -m bench.peers` and its process plumbing, with a fake runner: no peer installed."""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from bench.peers import loads_from_json, loads_to_json, summarize, table, workloads_json
from bench.peers.__main__ import HERE, run_peer
from bench.workloads import Load, Record, Sizes, build

CORPUS = list(range(5000))


def record(session: int, turn: int, ttft_ms: float, cached: int = 0) -> Record:
    return Record(session=session, turn=turn, prompt_tokens=100, completion_tokens=4, cached_tokens=cached,
                  cached_tokens_l1=cached, cached_tokens_l2=0, cached_tokens_l3=0, ttft_ms=ttft_ms, itl_ms=2.0,
                  e2e_ms=50.0, prefetch_wait_ms=0.0)


def test_workloads_json_round_trips_every_prompt():
    workloads = build(CORPUS, Sizes(), seed=0)
    raw = json.loads(json.dumps(workloads_json(workloads, Sizes())))
    assert raw["answer_tokens"] == 16 and raw["warm_up"] == list(range(1000, 1064))
    assert [(w["name"], w["concurrency"]) for w in raw["workloads"]] == [(w.name, w.concurrency) for w in workloads]
    for w, spec in zip(workloads, raw["workloads"]):
        assert spec["repeats"] == w.repeats
        assert [(tuple(map(tuple, s["prompts"])), s["chained"], s["first_round"]) for s in spec["sessions"]] == \
            [(s.prompts, s.chained, s.first_round) for s in w.sessions]


def test_records_json_round_trips_into_records():
    loads = {"multi_turn": Load((record(0, 0, 10.0), record(0, 1, 5.0, cached=64)), wall_s=1.5)}
    assert loads_from_json({"workloads": json.loads(json.dumps(loads_to_json(loads)))}) == loads


def test_a_record_missing_a_field_is_refused():
    incomplete = {k: v for k, v in asdict(record(0, 0, 1.0)).items() if k != "ttft_ms"}
    with pytest.raises(TypeError, match="ttft_ms"):
        loads_from_json({"workloads": {"w": {"wall_s": 1.0, "records": [incomplete]}}})


@pytest.mark.parametrize("script", ["run_vllm.py", "run_llamacpp.py"])
def test_runner_records_have_the_fields_of_record(script):
    # The runners import nothing from the project, so their Record is a copy: read its fields from the source.
    tree = ast.parse((HERE / script).read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Record"]
    assert [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)] == [f.name for f in fields(Record)]


def test_summary_has_first_and_last_round_only_where_sessions_have_rounds():
    loads = {"chat": Load((record(0, 0, 100.0), record(0, 1, 30.0), record(0, 2, 10.0)), wall_s=2.0),
             "single": Load((record(0, 0, 40.0), record(1, 0, 60.0)), wall_s=1.0)}
    summary = summarize(loads)
    assert summary["chat: round 1 TTFT mean"] == (100.0, "ms") and summary["chat: round 3 TTFT mean"] == (10.0, "ms")
    assert "chat: round 2 TTFT mean" not in summary and not any(k.startswith("single: round") for k in summary)
    assert summary["single: TTFT mean"] == (50.0, "ms") and summary["single: throughput"] == (2.0, "req/s")


def test_table_has_a_column_per_system_and_dashes_for_a_failed_one():
    columns = {"ours": {"w: TTFT mean": (1234.5, "ms"), "w: hit ratio": (0.25, "")},
               "peer": {"w: TTFT mean": (98.76, "ms"), "w: hit ratio": (float("nan"), "")}, "broken": {}}
    assert table(columns) == ("| workload: metric | unit | ours | peer | broken |\n"
                              "|---|---|---|---|---|\n"
                              "| w: TTFT mean | ms | 1,234 | 98.8 | - |\n"
                              "| w: hit ratio |  | 0.25 | n/a | - |")


FAKE_RUNNER = """
import json, sys
spec = json.load(open(sys.argv[1]))
print("model", sys.argv[3], "args", sys.argv[4:])
record = dict(session=0, turn=0, prompt_tokens=len(spec["warm_up"]), completion_tokens=spec["answer_tokens"],
              cached_tokens=0, cached_tokens_l1=0, cached_tokens_l2=0, cached_tokens_l3=0, ttft_ms=1.0, itl_ms=None,
              e2e_ms=2.0, prefetch_wait_ms=0.0)
json.dump({"workloads": {w["name"]: {"wall_s": 0.5, "records": [record]} for w in spec["workloads"]}},
          open(sys.argv[2], "w"))
"""


def test_run_peer_passes_the_files_and_keeps_the_log(tmp_path: Path):
    script = tmp_path / "runner.py"
    script.write_text(FAKE_RUNNER)
    spec = tmp_path / "workloads.json"
    spec.write_text(json.dumps(workloads_json(build(CORPUS, Sizes(), seed=0), Sizes())))
    raw = run_peer(Path(sys.executable), script, spec, tmp_path / "out.json", Path("/m"), ("--cache", "ram"),
                   tmp_path / "peer.log", timeout_s=30)
    loads = loads_from_json(raw)
    assert list(loads) == [w.name for w in build(CORPUS, Sizes(), seed=0)]
    assert loads["no_reuse"].records[0].completion_tokens == 16
    assert (tmp_path / "peer.log").read_text() == "model /m args ['--cache', 'ram']\n"


def test_a_failing_runner_raises_and_leaves_its_log(tmp_path: Path):
    script = tmp_path / "runner.py"
    script.write_text("import sys; print('no such engine'); sys.exit(3)")
    with pytest.raises(Exception, match="exit status 3"):
        run_peer(Path(sys.executable), script, tmp_path / "w.json", tmp_path / "out.json", Path("/m"), (),
                 tmp_path / "peer.log", timeout_s=30)
    assert (tmp_path / "peer.log").read_text() == "no such engine\n"
