"""``kf eval``: exit codes 0/1/2, the JSON object and the human summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kf.evaluation.grader.cli import main
from tests.harness import kf_cli

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
TASK = str(FIXTURES / "task_gelu.py")


@pytest.fixture(autouse=True)
def single_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runners use one thread so tests do not oversubscribe a small machine."""
    monkeypatch.setenv("KF_EVAL_THREADS", "1")


def test_eval_honest_json_exits_zero(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """An honest candidate exits 0 and prints JSON with the documented fields; its
    request log holds every stage's runner requests, with no device memory on a CPU."""
    log = tmp_path / "requests.jsonl"
    argv = [TASK, str(FIXTURES / "honest.py"), "--json", "--seed", "3", "--request-log", str(log)]
    assert main(argv) == 0
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    ops = {r["op"] for r in rows}
    assert {"load_candidate", "make_inputs", "run", "check", "time", "time_inputs"} <= ops
    assert all(
        r["peak_mb"] == r["allocated_mb"] == 0 and r["wall_s"] >= 0 and r["pid"] > 0 for r in rows
    )
    out = json.loads(capsys.readouterr().out)
    for key in (
        "compiled",
        "correct",
        "max_abs_err",
        "trials",
        "runtime_ms",
        "ref_runtime_ms",
        "speedup",
        "flags",
        "error",
    ):
        assert key in out
    assert out["compiled"] is True
    assert out["correct"] is True
    assert out["trials"] == 5
    assert out["speedup"] > 0
    assert out["error"] is None
    assert out["seed"] == 3


def test_eval_wrong_candidate_exits_one(capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong candidate exits 1 and the summary says why it was rejected."""
    assert main([TASK, str(FIXTURES / "wrong.py")]) == 1
    captured = capsys.readouterr()
    assert "REJECTED (mismatch)" in captured.out
    assert "candidate failed" in captured.err


def test_eval_broken_task_exits_two(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A task that cannot be imported exits 2 with the file and cause on stderr; the
    request log asked for is written all the same (an evaluation that ends in an error
    is the one whose runner requests are looked at)."""
    log = tmp_path / "requests.jsonl"
    argv = [str(FIXTURES / "broken_task.py"), str(FIXTURES / "honest.py")]
    assert main([*argv, "--request-log", str(log)]) == 2
    err = capsys.readouterr().err
    assert "broken_task.py" in err
    assert "ModuleNotFoundError" in err
    assert log.exists()
    assert all(json.loads(line)["op"] for line in log.read_text().splitlines())


def test_eval_bad_usage_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    """Missing arguments, a missing task file and an unavailable device each exit 2."""
    assert main([TASK]) == 2
    assert main(["/nonexistent/task.py", str(FIXTURES / "honest.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main([TASK, str(FIXTURES / "honest.py"), "--device", "cuda:0"]) == 2
    assert "only 'cpu'" in capsys.readouterr().err


def test_run_on_an_unavailable_device_exits_two(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`kf run --device cuda:0` without a usable GPU says so, as kf eval does (no traceback)."""
    import torch

    from kf.app.cli import main as kf_main

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    db = tmp_path / "run.db"
    assert kf_main(["run", TASK, "--device", "cuda:0", "--budget", "1", "--db", str(db)]) == 2
    assert "only 'cpu'" in capsys.readouterr().err
    assert not db.exists()  # nothing was started


def test_eval_module_subprocess_reports_json() -> None:
    """``python -m kf.evaluation.grader.cli`` on a candidate without ModelNew exits 1 with JSON."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kf.evaluation.grader.cli",
            TASK,
            str(FIXTURES / "no_model_new.py"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "KF_EVAL_THREADS": "1", "KF_EVAL_POOL": "1"},
    )
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["compiled"] is False
    assert out["correct"] is False
    assert "ModelNew" in out["error"]


def test_eval_help_through_the_kf_command() -> None:
    """``kf eval -h`` and ``kf --log-level INFO eval --help`` print kf eval's own help and
    exit 0 (argparse's REMAINDER used to drop a leading ``-h``: "unrecognized arguments")."""
    for argv in (["eval", "-h"], ["--log-level", "INFO", "eval", "--help"]):
        done = kf_cli(*argv, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: kf eval") and "candidate" in done.stdout
        assert "unrecognized" not in done.stderr
