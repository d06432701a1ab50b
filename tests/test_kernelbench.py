"""KernelBench folders: ``--tasks`` selection, and results in KernelBench's terms (rows,
per-level correctness rate, fast_p over all N tasks, geomean over correct ones) against
eager, torch.compile and the better of the two — on a hand-made SQLite event log."""

from __future__ import annotations

import csv
import io
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from kf.app.task_select import SelectionError, select, select_loaded, task_id
from kf.reports import CompileReport, ProfileReport, VerifyReport

ROOT = Path(__file__).resolve().parent.parent
LEVEL1 = sorted(
    [
        "100_HingeLoss",
        "10_3D_tensor_matrix_multiplication",
        "19_ReLU",
        "1_Square_matrix_multiplication_",
        "23_Softmax",
        "24_LogSoftmax",
        "25_Swish",
        "26_GELU_",
        "27_SELU_",
        "2_Standard_matrix_multiplication_",
    ]
)


def test_selection_by_id_range_and_name() -> None:
    """Ids are the number before the first underscore (1 is not 10 or 100), ranges include
    both ends, names match as case-insensitive substrings, the folder's order is kept."""
    assert task_id("23_Softmax") == 23 and task_id("level1/100_HingeLoss.py") == 100
    assert task_id("gelu_bias") is None
    got = select(LEVEL1, "1,19,23-26,Softmax", str)
    assert got == [
        "19_ReLU",
        "1_Square_matrix_multiplication_",
        "23_Softmax",
        "24_LogSoftmax",
        "25_Swish",
        "26_GELU_",
    ]
    assert select(LEVEL1, "softmax", str) == ["23_Softmax", "24_LogSoftmax"]
    assert select(LEVEL1, "100, 2", str) == ["100_HingeLoss", "2_Standard_matrix_multiplication_"]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("1,,2", "empty item"),
        ("26-23", "runs backwards"),
        ("42", "'42' matches no task (the folder has ids 1-2,10,19,23-27,100)"),
        ("Conv", "'Conv' matches no task"),
        ("-3", "not an id"),
        (" ", "no task ids"),
    ],
)
def test_bad_selection_is_one_clear_line(spec: str, says: str) -> None:
    with pytest.raises(SelectionError) as err:
        select(LEVEL1, spec, str)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_selection_may_pick_a_broken_file_which_stays_skipped() -> None:
    tasks, skipped = select_loaded(
        ["19_ReLU", "23_Softmax"], [("/x/level1/7_Broken.py", "syntax error")], "7,19", str
    )
    assert tasks == ["19_ReLU"] and skipped == [("/x/level1/7_Broken.py", "syntax error")]


def test_kf_run_refuses_a_selection_that_matches_nothing(tmp_path: Path) -> None:
    """`kf run FOLDER --tasks 999` exits 2 with one line, before any task is run."""
    from tests.harness import run_kf

    folder = ROOT / "tests" / "fixtures" / "kernelbench" / "level1"
    proc = run_kf("run", str(folder), "--tasks", "999", "--db", str(tmp_path / "r.db"))
    assert proc.returncode == 2
    assert "'999' matches no task (the folder has ids 1,7,19,23-24)" in proc.stderr
    assert not (tmp_path / "r.db").exists()


# -- a hand-made log -----------------------------------------------------------------------

SEED = (ROOT / "tests" / "fixtures" / "search" / "seeds" / "scale_relu.py").read_text()


def _profile(ref: float, cand: float, compiled: float | None) -> ProfileReport:
    """A profile as kf's profiler states it: speed-ups against eager, compile and the
    better of the two."""
    best = min(ref, compiled) if compiled is not None else None
    return ProfileReport(
        ok=True, runtime_ms=cand, runtime_std_ms=0.01, ref_runtime_ms=ref, speedup=ref / cand,
        compiled_runtime_ms=compiled, duration_s=2.0,
        speedup_vs_compiled=compiled / cand if compiled is not None else None,
        speedup_vs_best=best / cand if best is not None else None,
        compile_baseline_error=None if compiled is not None else "torch.compile failed: boom",
    )  # fmt: skip


# task file -> what happened to its one candidate
OUTCOMES: dict[str, Any] = {
    "level1/1_Square_matrix_multiplication_.py": _profile(4.0, 1.0, 2.0),  # 4x, 2x, 2x
    "level1/19_ReLU.py": _profile(1.2, 1.0, 0.9),  # 1.2x eager, 0.9x compile, 0.9x best
    "level1/23_Softmax.py": "mismatch",  # compiled, wrong
    "level1/24_LogSoftmax.py": _profile(3.0, 1.0, None),  # 3x eager, compile failed
    "level2/5_Conv_Add.py": _profile(0.5, 1.0, 2.0),  # 0.5x eager, 2x compile, 0.5x best
}
SKIPPED = {"/kb/level1/7_Broken.py": "/kb/level1/7_Broken.py: syntax error at line 3"}
CONFIG = {"budget": 1, "islands": 1, "max_in_flight": 1, "search_version": 2}
CONFIG |= {"skipped_tasks": SKIPPED, "task_selection": "1-30"}


def _write_log(db: Path) -> None:
    """A run's committed events, in a real SQLite log, with the archive's own decisions."""
    from agents.archive import ArchiveAgent
    from kf.agent import AgentContext
    from kf.events import Event, Record, make_envelope
    from kf.facts import DeviceAnnounced, RunStarted, TaskSpec
    from kf.log import EventLog
    from kf.search_facts import (
        CandidateCompiled,
        CandidateProfiled,
        CandidateProposed,
        CandidateRejected,
        CandidateVerified,
    )

    agent = ArchiveAgent(AgentContext(run_id="kb", agent_id="archive@t"))
    state = agent.initial_state()
    envelopes: list[Any] = []

    def feed(ev: Event) -> None:
        nonlocal state
        env = make_envelope(
            ev, run_id="kb", source="t@x", event_id=f"e{len(envelopes)}",
            seq=len(envelopes) + 1, at=1000.0 + 10 * len(envelopes),
        )  # fmt: skip
        envelopes.append(env)
        r = Record(env, ev)
        state = agent.evolve(state, r)
        for d in agent.react(state, r):
            feed(d)

    names = {f: Path(f).stem for f in OUTCOMES}
    feed(
        RunStarted(
            run_id="kb",
            seed=1,
            config=CONFIG,
            tasks=tuple(
                TaskSpec(name=n, source="x", sha256="h", path=f"/kb/{f}", seeds=(("s", SEED),))
                for f, n in names.items()
            ),
        )
    )
    feed(
        DeviceAnnounced(
            device_id="d", kind="cpu", agent_id="hw@x", capabilities={"backends": ["cpp-openmp"]}
        )
    )
    for f, outcome in OUTCOMES.items():
        task, cid = names[f], f"c-{names[f]}"
        feed(
            CandidateProposed(
                candidate_id=cid, task=task, source=SEED, island=0, operator="seed",
                mutator="offline", selection=None,
            )
        )  # fmt: skip
        at: dict[str, Any] = {"candidate_id": cid, "task": task, "device_id": "d", "attempt": 1}
        feed(CandidateCompiled(report=CompileReport(ok=True, duration_s=5.0), **at))
        if outcome == "mismatch":
            bad = VerifyReport(correct=False, failure_kind="mismatch", error="off by 1", trials=1)
            feed(CandidateRejected(report=bad, **at))
            continue
        feed(CandidateVerified(report=VerifyReport(correct=True, trials=5, duration_s=3.0), **at))
        feed(CandidateProfiled(report=outcome, **at))
    with EventLog(db) as elog:
        elog.append(envelopes)


@pytest.fixture(scope="module")
def kb_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("kb") / "kb.db"
    _write_log(db)
    return db


def test_report_rows_and_fast_p_follow_kernelbench(kb_log: Path) -> None:
    """fast_p counts correct tasks with speed-up > p over ALL N tasks of a level (a wrong
    and a skipped task included); the geomean is over correct tasks; each against eager,
    torch.compile and the better of the two; rows carry KernelBench's field names."""
    from kf.app.report import build_report

    kb = build_report(kb_log)["kernelbench"]
    rows = {r["problem_name"]: r for r in kb["rows"]}
    assert list(rows) == [
        "1_Square_matrix_multiplication_.py",
        "7_Broken.py",
        "19_ReLU.py",
        "23_Softmax.py",
        "24_LogSoftmax.py",
        "5_Conv_Add.py",
    ]  # by level, then KernelBench id
    mm = rows["1_Square_matrix_multiplication_.py"]
    assert (mm["level"], mm["problem_id"], mm["sample_id"]) == (1, 1, 0)
    assert mm["compiled"] is True and mm["correctness"] is True
    assert (mm["runtime"], mm["ref_runtime"], mm["ref_runtime_compile"]) == (1.0, 4.0, 2.0)
    assert (mm["speedup"], mm["speedup_vs_compile"], mm["speedup_vs_best"]) == (4.0, 2.0, 2.0)
    assert mm["runtime_stats"] == {"mean": 1.0, "std": 0.01}
    assert mm["candidate_id"] == "c-1_Square_matrix_multiplication_"
    # the task's work: compile 5 s + verification 3 s + profile 2 s (not the 25 s from the
    # compile's start to the profile's end, time spent queued included)
    assert mm["time_s"] == pytest.approx(10.0)
    soft = rows["23_Softmax.py"]
    assert soft["compiled"] is True and soft["correctness"] is False
    assert soft["runtime"] == -1.0 and soft["speedup"] is None  # KernelBench's "no result"
    assert soft["metadata"]["failures"] == {"mismatch": 1}
    broken = rows["7_Broken.py"]
    assert broken["compiled"] is False and broken["correctness"] is False
    assert "syntax error" in broken["metadata"]["skipped"]
    logsm = rows["24_LogSoftmax.py"]
    assert logsm["speedup_vs_compile"] is None and logsm["speedup_vs_best"] == 3.0
    assert "boom" in logsm["metadata"]["compile_baseline_error"]

    l1 = kb["levels"]["level1"]
    assert (l1["tasks"], l1["compiled"], l1["correct"]) == (5, 4, 3)
    assert l1["correctness_rate"] == pytest.approx(3 / 5)
    # against eager: 4, 1.2, 3 correct; N = 5
    assert l1["fast_p"]["eager"] == {
        "fast_0": 3 / 5, "fast_0.5": 3 / 5, "fast_0.8": 3 / 5, "fast_1": 3 / 5,
        "fast_1.5": 2 / 5, "fast_2": 2 / 5,
    }  # fmt: skip
    # against compile: 2 and 0.9 (LogSoftmax has no compiled time: never fast)
    assert l1["fast_p"]["compile"]["fast_0"] == 2 / 5
    assert l1["fast_p"]["compile"]["fast_1"] == 1 / 5
    assert l1["fast_p"]["compile"]["fast_2"] == 0.0  # 2.0 is not > 2
    # against the better: 2, 0.9, 3 (LogSoftmax against eager, its only baseline)
    assert l1["fast_p"]["best"]["fast_1"] == 2 / 5 and l1["fast_p"]["best"]["fast_2"] == 1 / 5
    assert l1["geomean_speedup"]["eager"] == pytest.approx((4.0 * 1.2 * 3.0) ** (1 / 3))
    assert l1["geomean_speedup"]["compile"] == pytest.approx((2.0 * 0.9) ** 0.5)
    assert l1["geomean_speedup"]["best"] == pytest.approx((2.0 * 0.9 * 3.0) ** (1 / 3))
    assert l1["tasks_without_compile_baseline"] == 1
    l2 = kb["levels"]["level2"]
    assert l2["tasks"] == 1 and l2["fast_p"]["eager"]["fast_0"] == 1.0
    assert l2["fast_p"]["eager"]["fast_1"] == 0.0 and l2["fast_p"]["compile"]["fast_1.5"] == 1.0
    assert l2["geomean_speedup"]["best"] == pytest.approx(0.5)


def test_kf_report_csv_json_and_table(kb_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kf report --csv` gives one row per task with KernelBench's columns; `--json` holds
    the same rows and the per-level scores; the table prints them per level."""
    from kf.app.cli import main
    from kf.app.kernelbench import CSV_COLUMNS

    assert main(["report", str(kb_log), "--csv"]) == 0
    lines = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(lines) == 6 and tuple(lines[0]) == CSV_COLUMNS
    relu = next(r for r in lines if r["problem_id"] == "19")
    assert relu["level"] == "1" and relu["correctness"] == "True" and relu["compiled"] == "True"
    assert float(relu["speedup"]) == pytest.approx(1.2)
    assert float(relu["speedup_vs_compile"]) == pytest.approx(0.9)
    assert float(relu["ref_runtime"]) == 1.2 and float(relu["ref_runtime_compile"]) == 0.9
    soft = next(r for r in lines if r["problem_id"] == "23")
    assert soft["correctness"] == "False" and soft["speedup"] == "" and soft["runtime"] == "-1.0"
    assert json.loads(soft["metadata"])["failures"] == {"mismatch": 1}

    assert main(["report", str(kb_log), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["kernelbench"]["rows"]) == 6
    assert report["kernelbench"]["levels"]["level1"]["fast_p"]["eager"]["fast_1.5"] == 0.4

    assert main(["report", str(kb_log)]) == 0
    table = capsys.readouterr().out
    assert "level1: 5 task(s), compiled 4/5, correct 3/5 (correctness rate 0.60)" in table
    assert "vs torch.compile: fast_0 = 0.40" in table and "vs best of both" in table


def test_hand_made_log_replays(kb_log: Path) -> None:
    """The hand-made log is a real kf log: its chain verifies and its decisions recompute."""
    from kf.log import EventLog
    from kf.replay import check, deciding_agent_types

    with EventLog(kb_log, readonly=True) as elog:
        result = check(elog, deciding_agent_types(None))
    assert result.ok, result.difference


def test_task_windows_are_device_work_without_the_compile(kb_log: Path) -> None:
    """The span bench/kernelbench.py reads nvidia-smi's peak over runs from a task's first
    verification's start to its last stage's end: a run compiles every task's seeds at
    the start, and a span from there held the other tasks' device work too."""
    from kf.app.kernelbench import task_windows
    from kf.events import decode_event
    from kf.log import EventLog

    with EventLog(kb_log, readonly=True) as elog:
        envelopes = list(elog.read())
    at = {
        (e.type, str(getattr(decode_event(e), "task", ""))): e.time
        for e in envelopes
        if e.type.startswith("kernel.candidate_")
    }
    windows = task_windows(envelopes)
    mm = "1_Square_matrix_multiplication_"
    start, end = windows[mm]
    assert start == pytest.approx(at[("kernel.candidate_verified", mm)] - 3.0)
    assert end == at[("kernel.candidate_profiled", mm)]
    assert start > at[("kernel.candidate_compiled", mm)]
    soft = "23_Softmax"  # rejected: its span is the rejection's
    assert windows[soft][1] == at[("kernel.candidate_rejected", soft)]
    # one task's device work does not overlap the next one's
    spans = sorted(windows[t] for t in (mm, "19_ReLU", soft, "24_LogSoftmax", "5_Conv_Add"))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_bench_checks_the_harness_on_a_folder(tmp_path: Path) -> None:
    """bench/kernelbench.py without an LLM: each selected reference, as its own ModelNew,
    goes through `kf run` and comes out correct; the broken task file is a row that is
    neither compiled nor correct; the log replays. (The compile baseline is off here to
    keep CI short; tests/test_compile_baseline.py covers it.)"""
    import os
    import subprocess
    import sys

    from kf.events import decode_event
    from kf.log import EventLog
    from kf.replay import check, deciding_agent_types

    out = tmp_path / "out"
    env = dict(os.environ, KF_COMPILE_BASELINE="0", KF_EVAL_THREADS="1", KF_LOG_LEVEL="WARNING")
    proc = subprocess.run(
        [sys.executable, "bench/kernelbench.py", "tests/fixtures/kernelbench/level1",
         "--tasks", "7,ReLU", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "level1: 2 task(s), compiled 1/2, correct 1/2" in proc.stdout
    lines = list(csv.DictReader(io.StringIO((out / "kernelbench.csv").read_text())))
    assert [(r["problem_id"], r["compiled"], r["correctness"]) for r in lines] == [
        ("7", "False", "False"),
        ("19", "True", "True"),
    ]
    assert float(lines[1]["speedup"]) > 0 and float(lines[1]["time_s"]) > 0
    assert "get_inputs() raised RuntimeError" in json.loads(lines[0]["metadata"])["skipped"]
    saved = json.loads((out / "kernelbench.json").read_text())
    assert saved["rows"][1]["peak_device_mb"] is None  # a CPU has no device memory to state
    with EventLog(out / "kernelbench.db", readonly=True) as elog:
        proposed = [decode_event(e) for e in elog.read() if e.type == "kernel.candidate_proposed"]
        assert check(elog, deciding_agent_types(None)).ok
    assert len(proposed) == 1 and "class ModelNew(Model):" in proposed[0].source  # type: ignore[attr-defined]


def test_bench_stops_at_its_wall_limit_and_resumes(tmp_path: Path) -> None:
    """bench/kernelbench.py --wall stops kf run as Ctrl-C does and reports what the log
    holds; a second call without --resume refuses the existing log; with it the same run
    continues to the end: each task's one candidate proposed once, the log replays."""
    import os
    import subprocess
    import sys

    from kf.events import decode_event
    from kf.log import EventLog
    from kf.replay import check, deciding_agent_types

    out = tmp_path / "out"
    env = dict(os.environ, KF_COMPILE_BASELINE="0", KF_EVAL_THREADS="1", KF_LOG_LEVEL="WARNING")

    def bench(*more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "bench/kernelbench.py", "tests/fixtures/kernelbench/level1",
             "--tasks", "19,23", "--out", str(out), *more],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    # the first call's run has no worker, so it cannot end before the wall, however fast the
    # machine (with one it ended in 11 s once, before a wall of 12 s); the log exists by then
    first = bench("--wall", "12", "--", "--no-worker")
    assert first.returncode == 0, first.stderr[-2000:] + first.stdout[-2000:]
    assert "stopped at --wall 12 s" in first.stdout
    assert json.loads((out / "kernelbench.json").read_text())["stopped_at_wall"] is True
    again = bench()
    assert again.returncode == 2 and "--resume" in again.stderr
    done = bench("--resume")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "level1: 2 task(s), compiled 2/2, correct 2/2" in done.stdout
    with EventLog(out / "kernelbench.db", readonly=True) as elog:
        events = list(elog.read())
        assert check(elog, deciding_agent_types(None)).ok
    assert sum(e.type == "run.started" for e in events) == 1
    proposed = [decode_event(e) for e in events if e.type == "kernel.candidate_proposed"]
    assert sorted(p.task for p in proposed) == ["19_ReLU", "23_Softmax"]  # type: ignore[attr-defined]
    # the table made again from the log alone, as from a log brought back from a GPU
    saved = json.loads((out / "kernelbench.json").read_text())
    (out / "kernelbench.csv").unlink()
    again = bench("--table-only")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "level1: 2 task(s), compiled 2/2, correct 2/2" in again.stdout
    assert "--table-only" in again.stdout and (out / "kernelbench.csv").exists()
    remade = json.loads((out / "kernelbench.json").read_text())
    assert remade["rows"] == saved["rows"] and remade["command"] == saved["command"]
    with EventLog(out / "kernelbench.db", readonly=True) as elog:
        assert len(list(elog.read())) == len(events)  # it ran nothing


def test_export_states_every_baseline(kb_log: Path, tmp_path: Path) -> None:
    """`kf export` heads the module with the speed-up against eager, torch.compile and the
    better of the two; a task without a compiled time says so."""
    from kf.app.cli import main

    out = tmp_path / "mm.py"
    assert (
        main(["export", str(kb_log), "--task", "1_Square_matrix_multiplication_", "-o", str(out)])
        == 0
    )
    head = out.read_text().splitlines()[:3]
    assert "4.00x over PyTorch eager" in head[1]
    assert (
        head[2]
        == "# 2.00x over torch.compile (2.0000 ms, mode default), 2.00x over the better of the two"
    )
    assert main(["export", str(kb_log), "--task", "24_LogSoftmax", "-o", str(out)]) == 0
    assert out.read_text().splitlines()[2] == "# no torch.compile time"
