"""The whole loop on a CPU: `kf run` with real agents, NATS, compiler, sandboxed kernels."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kf.app.cli import build_parser
from kf.events import decode_event
from kf.kernels.tuning import tuning_config
from kf.log import EventLog
from tests.harness import replay_check, run_kf
from tests.shared_runs import SEARCH_TUNE_BUDGET, search_run

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests/fixtures/search"


def kf(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return run_kf(*args, timeout=timeout)


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One search over the fixture tasks (--budget 4 --seed 3 --tune-budget 4),
    shared by the tests below and by tests/test_dashboard.py's (tests/shared_runs.py)."""
    run = search_run(tmp_path_factory)
    return run.db, run.report()


def test_loop_finds_a_correct_kernel_with_a_speedup(run_db: tuple[Path, dict]) -> None:
    """The search ends with a verified, profiled kernel and its measured speedup."""
    _, report = run_db
    task = next(t for t in report["tasks"] if t["task"] == "scale_relu")
    assert task["candidates"] - task["tuned_candidates"] == 4  # tuned ones come on top
    assert task["correct"] >= 1
    assert task["best_speedup"] > 0 and task["ref_ms"] > 0 and task["best_ms"] > 0
    assert task["best_candidate_id"]
    assert report["finished"] is True
    assert set(report["fast_p"]) == {"fast_0", "fast_1", "fast_1.5", "fast_2"}
    assert report["archive"]["filled_cells"] >= 1
    assert "offline" in report["mutator"] and "no LLM" in report["mutator"]


def test_loop_tunes_the_seed_template_offline(run_db: tuple[Path, dict]) -> None:
    """Without an LLM the task's elites are tuned once its budget is spent, the best first:
    the archive asked, the device's tuner answered for the task's shape, and the report says
    so."""
    db, report = run_db
    with EventLog(db, readonly=True) as elog:
        asked = [decode_event(e) for e in elog.read(types=["search.tuning_requested"])]
        tuned = [decode_event(e) for e in elog.read(types=["tuning.config_tuned"])]
    assert {a.task for a in asked} == {"scale_relu"}  # type: ignore[attr-defined]
    assert asked[0].budget == SEARCH_TUNE_BUDGET  # type: ignore[attr-defined]  # to the best first
    assert tuned and tuned[-1].last and tuned[0].shape == "[[64, 256]]"  # type: ignore[attr-defined]
    assert len(tuned[0].trials) >= 2  # type: ignore[attr-defined]
    task = next(t for t in report["tasks"] if t["task"] == "scale_relu")
    assert task["tuning"] and task["tuning"][0]["device_id"] in report["devices"]


def test_loop_tunes_twelve_configurations_unless_told() -> None:
    """`kf run`'s tuning budget is 12 configurations per task and device by default (the
    run above passes its own, smaller one; the same option carries both)."""
    assert tuning_config(build_parser().parse_args(["run", "task.py"])) == {"tune_budget": 12}
    asked = build_parser().parse_args(["run", "task.py", "--tune-budget", "3"])
    assert tuning_config(asked) == {"tune_budget": 3}


def test_loop_records_a_crashing_kernel_and_carries_on(run_db: tuple[Path, dict]) -> None:
    """A segfaulting seed is a failed candidate with its signal; the run still completes."""
    db, report = run_db
    crashy = next(t for t in report["tasks"] if t["task"] == "crashy")
    assert crashy["failed"] == 1 and crashy["correct"] == 0
    assert "every seed failed" in crashy["skipped"]
    with EventLog(db, readonly=True) as elog:
        rejected = [decode_event(e) for e in elog.read(types=["kernel.candidate_rejected"])]
    crash = [r for r in rejected if r.task == "crashy"]  # type: ignore[attr-defined]
    assert crash and crash[0].report.failure_kind == "crash"  # type: ignore[attr-defined]
    assert "SIGSEGV" in (crash[0].report.error or "")  # type: ignore[attr-defined]


def test_loop_skips_task_without_seed_with_a_clear_reason(run_db: tuple[Path, dict]) -> None:
    """A task with no seed and no LLM is reported as skipped, never faked."""
    _, report = run_db
    noseed = next(t for t in report["tasks"] if t["task"] == "noseed")
    assert noseed["candidates"] == 0
    assert "no seed kernel and no LLM" in noseed["skipped"]


def test_loop_replay_check_passes_and_hash_is_stable(run_db: tuple[Path, dict]) -> None:
    """`kf replay --check` recomputes every decision; two replays give one hash."""
    db, _ = run_db
    out = replay_check(db)
    assert out["check"]["decisions_checked"] > 0
    second = json.loads(kf("replay", str(db), "--json").stdout)
    assert out["hash"] == second["hash"]
    # the task checks are in the log, the replay's and the report's: every task, on cpu
    checks = out["task_checks"]
    assert set(checks) == {"crashy", "noseed", "scale_relu"}
    assert all(c["ok"] and c["device"] == "cpu" for c in checks.values())
    assert checks["scale_relu"]["info"]["output_shapes"] == [[64, 256]]
    assert [c["task"] for c in run_db[1]["task_checks"]] == ["crashy", "noseed", "scale_relu"]


def test_loop_announces_the_cpu_device(run_db: tuple[Path, dict]) -> None:
    """The CPU hardware agent announced its capabilities, heartbeated and left."""
    db, report = run_db
    with EventLog(db, readonly=True) as elog:
        ann = [decode_event(e) for e in elog.read(types=["device.announced"])]
        left = list(elog.read(types=["device.left"]))
    caps = ann[0].capabilities  # type: ignore[attr-defined]
    assert caps["logical_cores"] >= 1 and caps["isa"] is not None
    assert caps["measured_copy_bandwidth_gbs"] > 0
    assert "cpp-openmp" in caps["backends"]
    assert left and report["devices"]


def test_loop_export_writes_a_drop_in_module(run_db: tuple[Path, dict], tmp_path: Path) -> None:
    """`kf export` writes the best kernel, which `kf eval` then verifies as correct."""
    db, _ = run_db
    out = tmp_path / "best.py"
    assert kf("export", str(db), "-o", str(out), "--task", "scale_relu").returncode == 0
    assert "class ModelNew" in out.read_text()
    ev = kf("eval", str(FIXTURES / "scale_relu.py"), str(out), "--json")
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert json.loads(ev.stdout)["correct"] is True


def test_loop_broken_task_is_a_usage_error(tmp_path: Path) -> None:
    """A task file that fails to import stops `kf run` with exit 2, naming the file."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nraise ValueError('no good')\n")
    proc = kf("run", str(bad), "--budget", "1", "--db", str(tmp_path / "x.db"))
    assert proc.returncode == 2
    assert "bad.py" in proc.stderr and "ValueError" in proc.stderr
