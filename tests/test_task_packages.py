"""Task packages (kf.kernels.task_packages): a folder with task.py, kf.toml and the user's
own tests, which every candidate must pass in its box; bad input is one line."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from kf.kernels.task_folders import load_tasks_skipping
from kf.kernels.task_packages import load_package
from kf.kernels.tasks import TaskError, import_source
from tests.harness import ROOT, logged, replay_check, run_kf

PACKAGE = ROOT / "tests/fixtures/packages/double_rows"


@pytest.fixture(scope="module")
def package_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """`kf run PACKAGE/` with the offline mutator: its two seeds, its own budget of 2."""
    import json

    db = tmp_path_factory.mktemp("pkg") / "run.db"
    proc = run_kf("run", str(PACKAGE) + "/", "--db", str(db), "--json", "--tune-budget", "0")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return db, json.loads(proc.stdout)


def test_package_user_test_rejects_a_wrong_candidate(package_run: Any) -> None:
    """The seed that cannot take a transposed input passes kf's own trials but fails the
    user's test: rejected with the test's name and message; the right seed is verified."""
    db, report = package_run
    (task,) = report["tasks"]
    assert task["task"] == "double_rows" and task["best_speedup"] is not None
    proposed = {c.candidate_id: c.source for c in logged(db, "kernel.candidate_proposed")}
    (rejected,) = logged(db, "kernel.candidate_rejected")
    assert "view(-1)" in proposed[rejected.candidate_id]
    assert rejected.report.failure_kind == "user_test_failed"
    assert "tests/test_layouts.py::test_transposed_input" in rejected.report.error
    assert "view size is not compatible" in rejected.report.error
    (verified,) = logged(db, "kernel.candidate_verified")
    assert "reshape(-1)" in proposed[verified.candidate_id]
    assert "user_tests: 2 passed" in verified.report.flags


def test_package_settings_and_tests_travel_in_the_log(package_run: Any) -> None:
    """run.started carries the package's tests' text, its kf.toml and where it came from;
    its tolerance is in the task's text; replay --check passes."""
    db, _ = package_run
    (started,) = logged(db, "run.started")
    (spec,) = started.tasks
    assert [n for n, _ in spec.tests] == ["tests/test_layouts.py"]
    assert "def test_transposed_input" in spec.tests[0][1]
    assert spec.settings == {"atol": 1e-5, "rtol": 1e-5, "budget": 2}
    assert spec.origin["format"] == "package" and "KF_ATOL = 1e-05" in spec.source
    replay_check(db)


def _package(tmp_path: Path, toml: str | None = None, test: str | None = None) -> Path:
    folder = tmp_path / "pkg"
    shutil.copytree(PACKAGE, folder)
    if toml is not None:
        (folder / "kf.toml").write_text(toml)
    if test is not None:
        (folder / "tests" / "test_layouts.py").write_text(test)
    return folder


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        ("atol = [", "not valid TOML"),
        ("atol = 1e-3\nbudgett = 4\n", "unknown key 'budgett' (known: name, task, atol"),
        ("dtypes = ['float8']\n", "dtypes must be a list of float32, bfloat16, float16"),
    ],
)
def test_package_bad_kf_toml_is_one_line(tmp_path: Path, toml: str, said: str) -> None:
    """A broken kf.toml, an unknown key or a bad value: one line naming the file and what
    is wrong (an unknown key lists the known ones)."""
    with pytest.raises(TaskError, match=r"kf\.toml: ") as exc:
        load_package(_package(tmp_path, toml=toml))
    assert said in str(exc.value) and "\n" not in str(exc.value)


def test_package_tests_that_do_not_import_refuse_the_task_alone(tmp_path: Path) -> None:
    """A package whose tests do not import is refused in one line by `kf run`; in a folder
    of tasks, the other tasks still load."""
    folder = _package(
        tmp_path, test="import no_such_module_here\n\ndef test_x(candidate):\n    pass\n"
    )
    proc = run_kf("run", str(folder), "--budget", "1", "--tune-budget", "0", timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "does not import" in ln]
    assert len(lines) == 1 and "No module named 'no_such_module_here'" in lines[0], proc.stderr
    broken = _package(tmp_path / "b", test="def test_x(candidate:\n")
    shutil.copy(ROOT / "examples/tasks/gelu_bias.py", broken.parent / "gelu_bias.py")
    tasks, skipped = load_tasks_skipping(broken.parent)
    assert [t.name for t in tasks] == ["gelu_bias"]
    assert "the user test does not import: syntax error" in skipped[0][1]


def test_package_dtypes_and_shapes_sweep(tmp_path: Path) -> None:
    """kf.toml's dtypes make one task per dtype (inputs and parameters cast); its shapes
    become the task's tuning and generalisation sets."""
    import torch

    toml = "dtypes = ['float32', 'bfloat16']\nshapes = [[[3, 64]], [[5, 64]]]\n"
    tasks = load_package(_package(tmp_path, toml=toml))
    assert [t.name for t in tasks] == ["pkg_float32", "pkg_bfloat16"]
    module = import_source("pkg_bf16", tasks[1].source)
    assert module.get_inputs()[0].dtype == torch.bfloat16
    assert [s[0].shape[0] for s in module.get_extra_inputs()] == [3, 5]
    assert module.get_tuning_inputs()[1][0].dtype == torch.bfloat16
