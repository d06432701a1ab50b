"""kf's application layer (kf.app): a search asked for from Python, without argparse, and
the task check as a recorded step of the run (real runners in their boxes; no whole run:
those are tests/test_cli_refusals.py's and tests/test_loop.py's)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kf.app import RunRefused, RunRequest, check_tasks, prepare_run
from kf.app.run import asked_conditions
from kf.events import make_envelope
from kf.facts import RunStarted, TaskSpec
from kf.fold import fold
from kf.kernels.tasks import load_task
from kf.log import EventLog
from kf.search_facts import TaskChecked, TaskChecks
from kf.settings import current

ROOT = Path(__file__).resolve().parent.parent
SEARCH = ROOT / "tests/fixtures/search"
RAISES = (
    "import torch\nfrom torch import nn\n\n\nclass Model(nn.Module):\n"
    "    def forward(self, x):\n        raise RuntimeError('reference is broken')\n\n\n"
    "def get_inputs():\n    return [torch.randn(4)]\n\n\n"
    "def get_init_inputs():\n    return []\n"
)


def _folder(tmp_path: Path) -> Path:
    """A folder with a good task (and its seed) and one whose reference raises."""
    folder = tmp_path / "tasks"
    (folder / "seeds").mkdir(parents=True)
    shutil.copy(SEARCH / "scale_relu.py", folder / "scale_relu.py")
    shutil.copy(SEARCH / "seeds" / "scale_relu.py", folder / "seeds" / "scale_relu.py")
    (folder / "raises.py").write_text(RAISES)
    return folder


def test_app_refuses_a_bad_request_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    """Bad input is a RunRefused carrying kf run's line, raised before any task runs; no
    log is written."""
    db = tmp_path / "run.db"
    with pytest.raises(RunRefused, match=r"^--budget must be at least 1$"):
        prepare_run(RunRequest(tasks=SEARCH / "scale_relu.py", budget=0, db=db))
    with pytest.raises(RunRefused, match=r"missing\.py: no such file"):
        prepare_run(RunRequest(tasks=tmp_path / "missing.py", db=db))
    assert not db.exists()


def test_app_single_broken_task_is_refused_with_its_check_and_starts_nothing(
    tmp_path: Path,
) -> None:
    """A task file whose reference raises is refused with the check's one line, and no
    log is written: a rerun after the fix starts afresh."""
    bad = tmp_path / "raises.py"
    bad.write_text(RAISES)
    db = tmp_path / "run.db"
    with pytest.raises(RunRefused) as refused:
        prepare_run(RunRequest(tasks=bad, db=db))
    message = str(refused.value)
    assert "raises.py" in message and "reference is broken" in message
    assert "\n" not in message
    assert not db.exists()


def test_app_folder_run_carries_its_task_checks_to_record(tmp_path: Path) -> None:
    """In a folder, the check leaves the raising task out with its reason, and the plan
    carries both checks (passed with the outputs it saw, failed with why) for the run to
    record after its start; nothing is written before the run starts."""
    folder, db = _folder(tmp_path), tmp_path / "run.db"
    plan = prepare_run(RunRequest(tasks=folder, db=db))
    assert [t.name for t in plan.tasks] == ["scale_relu"]
    assert [where for where, _ in plan.skipped] == [str(folder / "raises.py")]
    checks = {ev.task: ev for ev, _ in plan.options.records}
    assert isinstance(checks["scale_relu"], TaskChecked) and checks["scale_relu"].ok
    info = checks["scale_relu"].info
    assert info is not None and info.output_shapes == [[64, 256]] and info.eager_ms >= 0
    failed = checks["raises"]
    assert isinstance(failed, TaskChecked) and not failed.ok
    assert "reference is broken" in failed.error and failed.path == str(folder / "raises.py")
    assert plan.options.config.tasks.skipped_tasks == dict(plan.skipped)
    assert not plan.options.resuming and not db.exists()


def test_app_resume_reuses_the_checks_its_log_recorded(tmp_path: Path) -> None:
    """A log that holds the run and a passed check of the same source on the same device
    is resumed without checking again: a task that would now fail its check goes on (the
    run's tasks were fixed by its start) and no new check is recorded."""
    bad = tmp_path / "raises.py"
    bad.write_text(RAISES)
    task, db = load_task(bad), tmp_path / "run.db"
    request = RunRequest(tasks=bad, db=db)
    started = RunStarted(
        run_id="r-app",
        seed=0,
        # the settings kf run records, as this request asks for them
        config={
            "budget": 20,
            "device": "cpu",
            "llm": False,
            **asked_conditions(request, current()).config(),
        },
        tasks=(TaskSpec(name=task.name, source=task.source, sha256=task.sha256),),
    )
    passed = TaskChecked(task=task.name, sha256=task.sha256, device="cpu", ok=True)
    with EventLog(db) as elog:
        elog.append([make_envelope(ev, run_id="r-app", source="cli@t") for ev in (started, passed)])
    plan = prepare_run(request)
    assert plan.options.resuming and plan.options.run_id == "r-app"
    assert [t.name for t in plan.tasks] == ["raises"] and plan.options.records == []
    assert plan.notes == []  # the same settings: no "resuming as it was started" line


def test_app_check_runs_again_for_another_source(tmp_path: Path) -> None:
    """A check the log recorded for another source of the task does not count: the task
    is checked now and the new check is made to be recorded."""
    bad = tmp_path / "raises.py"
    bad.write_text(RAISES)
    task = load_task(bad)
    other = TaskChecked(task=task.name, sha256="0" * 64, device="cpu", ok=True)
    checked = check_tasks([task], "cpu", recorded={task.name: other}, single=False)
    assert checked.passed == [] and [w for w, _ in checked.failed] == [str(bad)]
    (made, _at), *more = checked.made
    assert not more and not made.ok and made.sha256 == task.sha256


def test_task_checks_projection_keeps_the_last_check_of_each_task() -> None:
    """The log's task checks fold (kf.fold) to the last one of each task."""
    first = TaskChecked(task="a", sha256="1", device="cpu", ok=False, error="x")
    again = TaskChecked(task="a", sha256="2", device="cpu", ok=True)
    other = TaskChecked(task="b", sha256="3", device="cpu", ok=True)
    envelopes = [
        make_envelope(ev, run_id="r", source="cli@t", seq=i)
        for i, ev in enumerate((first, other, again), 1)
    ]
    assert fold(envelopes, TaskChecks()) == {"a": again, "b": other}
