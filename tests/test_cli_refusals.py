"""`kf run` refuses what it cannot do faithfully, with one line, and recovers what it can."""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

from kf.app import RunRequest, run
from kf.events import decode_event
from kf.log import EventLog
from tests.harness import run_kf

ROOT = Path(__file__).resolve().parent.parent
SEARCH = ROOT / "tests/fixtures/search"


def kf(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_kf(*args, timeout=timeout)


def test_run_rerun_with_other_settings_is_refused_unless_resume(tmp_path: Path) -> None:
    """A second `kf run` on a log with another budget, seed or TF32 is refused with the
    differences named; with --resume it continues the logged run as it was started (its
    recorded conditions: tests/test_baseline_settings.py grades under them)."""
    db = tmp_path / "run.db"
    task = str(SEARCH / "scale_relu.py")
    # no tuning (--tune-budget 0 in every command, so it is no difference): the settings
    # compared are the point, not the tuner's minute of timings after the search
    # one candidate is enough: the refusal compares settings, and resume reads them back
    # the first run from Python (kf.app, no argparse); the command lines below resume its log
    first = run(RunRequest(tasks=Path(task), budget=1, db=db, tune_budget=0), out=io.StringIO())
    assert first.db == db and first.report["tasks"][0]["candidates"] == 1
    assert first.unrunnable is None and first.report["finished"]
    again = kf(
        "run", task, "--budget", "5", "--seed", "4", "--db", str(db), "--tune-budget", "0",
        "--tf32", "on",
    )  # fmt: skip
    assert again.returncode == 2
    message = again.stderr.strip().splitlines()[-1]
    assert "budget 1 in the log, 5 now" in message and "seed 0 in the log, 4 now" in message
    assert "tf32 'off' in the log, 'on' now" in message
    assert "--resume" in message and "Traceback" not in again.stderr
    resumed = kf(
        "run", task, "--budget", "5", "--db", str(db), "--tune-budget", "0", "--resume",
        "--tf32", "on",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "as it was started" in resumed.stdout
    assert "tf32 'off' in the log, 'on' now" in resumed.stdout
    same = kf("run", task, "--budget", "1", "--db", str(db), "--tune-budget", "0")
    assert same.returncode == 0, same.stderr[-3000:]
    # the task was checked once, by the first run: each resume reused the recorded check
    with EventLog(db, readonly=True) as elog:
        checks = [decode_event(e) for e in elog.read(types=["kernel.task_checked"])]
    assert [(c.task, c.ok) for c in checks] == [("scale_relu", True)]  # type: ignore[attr-defined]


def test_run_folder_skips_a_broken_task_and_runs_the_others(tmp_path: Path) -> None:
    """In a folder, a file that does not import and a task whose reference raises are
    skipped with their reasons; the good task is searched."""
    folder = tmp_path / "tasks"
    (folder / "seeds").mkdir(parents=True)
    shutil.copy(SEARCH / "scale_relu.py", folder / "scale_relu.py")
    shutil.copy(SEARCH / "seeds" / "scale_relu.py", folder / "seeds" / "scale_relu.py")
    (folder / "broken.py").write_text("def nope(:\n")
    (folder / "raises.py").write_text(
        "import torch\nfrom torch import nn\n\n\nclass Model(nn.Module):\n"
        "    def forward(self, x):\n        raise RuntimeError('reference is broken')\n\n\n"
        "def get_inputs():\n    return [torch.randn(4)]\n\n\n"
        "def get_init_inputs():\n    return []\n"
    )
    db = tmp_path / "run.db"
    # the skips are the point: no tuning of the good task's seed after its search
    proc = kf("run", str(folder), "--budget", "1", "--db", str(db), "--json", "--tune-budget", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    skips = [ln for ln in proc.stderr.splitlines() if ln.startswith("kf run: skipping")]
    assert len(skips) == 2
    assert any("broken.py" in s for s in skips)
    assert any("raises" in s and "reference is broken" in s for s in skips)
    import json

    report = json.loads(proc.stdout)
    assert [t["task"] for t in report["tasks"]] == ["scale_relu"]
    # both checks are the run's, recorded right after its start: passed and failed
    with EventLog(db, readonly=True) as elog:
        types = [e.type for e in elog.read(1, 3)]
        checks = {c.task: c for c in map(decode_event, elog.read(types=["kernel.task_checked"]))}
    assert types == ["run.started", "kernel.task_checked", "kernel.task_checked"]
    assert set(checks) == {"scale_relu", "raises"}  # broken.py never loaded: nothing to run
    good, bad = checks["scale_relu"], checks["raises"]
    assert good.ok and good.info.output_shapes == [[64, 256]]  # type: ignore[attr-defined]
    assert not bad.ok and "reference is broken" in bad.error  # type: ignore[attr-defined]
    assert {c["task"]: c["ok"] for c in report["task_checks"]} == {
        "scale_relu": True,
        "raises": False,
    }
