"""Tasks: loading files and folders, seeds, and checking a task in a sandboxed process."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from kf.evaluation.grader.sandbox import RunnerPool
from kf.evaluation.grader.task_check import run_task_check
from kf.kernels.task_folders import load_tasks
from kf.kernels.tasks import Task, TaskError, import_source, load_task

FIXTURES = Path(__file__).parent / "fixtures" / "eval"

TINY_TASK = FIXTURES.joinpath("task_gelu.py").read_text()


def test_load_task_reads_source_and_hash() -> None:
    """A task file loads with its stem as name, its text and the text's sha256."""
    task = load_task(FIXTURES / "task_gelu.py")
    assert task.name == "task_gelu"
    assert task.source == TINY_TASK
    assert task.sha256 == hashlib.sha256(TINY_TASK.encode()).hexdigest()
    assert task.path == str(FIXTURES / "task_gelu.py")


def test_task_from_source_matches_loaded_task() -> None:
    """A task built from text has the same hash as the same text loaded from a file."""
    assert Task.from_source("x", TINY_TASK).sha256 == load_task(FIXTURES / "task_gelu.py").sha256


def test_load_task_missing_file_names_path(tmp_path: Path) -> None:
    """A missing task file raises TaskError naming the path."""
    with pytest.raises(TaskError, match=r"nope\.py: no such file"):
        load_task(tmp_path / "nope.py")


def test_load_task_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    """A task that does not parse raises TaskError naming the file and the line."""
    bad = tmp_path / "bad.py"
    bad.write_text("class Model(:\n")
    with pytest.raises(TaskError, match=r"bad\.py: syntax error at line 1"):
        load_task(bad)


def test_load_tasks_folder_sorted_skipping_private(tmp_path: Path) -> None:
    """A folder yields its *.py tasks sorted, skipping __init__.py and _private files."""
    for name in ("b.py", "a.py", "_helper.py", "__init__.py", "notes.txt"):
        (tmp_path / name).write_text(TINY_TASK)
    assert [t.name for t in load_tasks(tmp_path)] == ["a", "b"]


def test_load_tasks_empty_folder_raises(tmp_path: Path) -> None:
    """A folder with no task files raises TaskError naming the folder."""
    with pytest.raises(TaskError, match="holds no task files"):
        load_tasks(tmp_path)


def test_load_tasks_missing_path_raises(tmp_path: Path) -> None:
    """A missing path raises TaskError naming it."""
    with pytest.raises(TaskError, match="gone: no such file or folder"):
        load_tasks(tmp_path / "gone")


def test_load_task_finds_seeds_sorted(tmp_path: Path) -> None:
    """Seeds are seeds/<stem>.py and seeds/<stem>.*.py, sorted, and no other task's."""
    (tmp_path / "t.py").write_text(TINY_TASK)
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    for name in ("t.py", "t.b.py", "t.a.py", "other.py", "tt.py"):
        (seeds / name).write_text(f"# {name}\n")
    task = load_task(tmp_path / "t.py")
    assert [s.name for s in task.seeds] == ["t", "t.a", "t.b"]
    assert task.seeds[0].source == "# t.py\n"


def test_import_source_registers_module() -> None:
    """import_source runs the text as a module registered under the given name."""
    module = import_source("kf_test_imported", "VALUE = 41 + 1\n")
    try:
        assert module.VALUE == 42
        assert sys.modules["kf_test_imported"] is module
    finally:
        sys.modules.pop("kf_test_imported", None)


def test_import_source_failure_unregisters() -> None:
    """A module whose top level raises is not left in sys.modules."""
    with pytest.raises(ZeroDivisionError):
        import_source("kf_test_broken", "1 / 0\n")
    assert "kf_test_broken" not in sys.modules


def test_check_task_describes_outputs(pool: RunnerPool) -> None:
    """Checking a good task reports its input and output shapes and dtypes."""
    info = run_task_check(load_task(FIXTURES / "task_gelu.py"), pool=pool)
    assert info.input_shapes == [[64, 1024]]
    assert info.output_shapes == [[64, 1024]]
    assert info.output_dtypes == ["float32"]
    assert info.eager_ms >= 0


def test_check_task_import_error_names_file_and_cause(pool: RunnerPool) -> None:
    """A task whose import fails raises TaskError with the file, exception type and message."""
    task = load_task(FIXTURES / "broken_task.py")
    with pytest.raises(TaskError) as info:
        run_task_check(task, pool=pool)
    message = str(info.value)
    assert message.startswith(str(FIXTURES / "broken_task.py"))
    assert "ModuleNotFoundError" in message
    assert "kf_no_such_module_for_tests" in message


def test_check_task_missing_get_inputs_names_file_and_cause(pool: RunnerPool) -> None:
    """A task without get_inputs raises TaskError saying which name is missing."""
    with pytest.raises(TaskError, match=r"task_no_inputs\.py: defines no function get_inputs"):
        run_task_check(load_task(FIXTURES / "task_no_inputs.py"), pool=pool)


def test_check_task_get_inputs_raising_names_cause(tmp_path: Path, pool: RunnerPool) -> None:
    """A get_inputs() that raises is reported with its exception type and message."""
    path = tmp_path / "raising.py"
    path.write_text(
        TINY_TASK.replace(
            "def get_inputs() -> list[torch.Tensor]:\n",
            "def get_inputs() -> list[torch.Tensor]:\n    raise ValueError('no inputs today')\n",
        )
    )
    with pytest.raises(
        TaskError, match=r"raising\.py: get_inputs\(\) raised ValueError: no inputs"
    ):
        run_task_check(load_task(path), pool=pool)
