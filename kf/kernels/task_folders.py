"""Where tasks are read from: a task file, a task folder, or a folder of them.

A *task folder* is a task package (:mod:`kf.kernels.task_packages`: ``task.py``,
``kf.toml``, ``tests/test_*.py``) or a robust-kbench task folder
(:mod:`kf.kernels.robust_kbench`); a folder of tasks holds task files (``*.py``) and task
folders side by side (not recursive: other subfolders are not tasks).
"""

from __future__ import annotations

from pathlib import Path

from kf.kernels import robust_kbench, task_packages
from kf.kernels.tasks import Task, TaskError, load_task

__all__ = ["folder_tasks", "load_tasks", "load_tasks_skipping"]


def load_tasks(path: str | Path, *, shape_cap: int | None = None) -> list[Task]:
    """Read a task file, a task folder (a package or a robust-kbench folder), or every
    task of a folder (``*.py`` and task folders, sorted, not recursive); ``shape_cap``
    caps a robust-kbench folder's config integers (:mod:`kf.kernels.robust_kbench`)."""
    tasks, skipped = load_tasks_skipping(path, shape_cap=shape_cap)
    if skipped:
        raise TaskError(skipped[0][1])
    return tasks


def folder_tasks(folder: Path, *, shape_cap: int | None = None) -> list[Task] | None:
    """The tasks of a task folder: a package (:mod:`kf.kernels.task_packages`) or a
    robust-kbench folder (:mod:`kf.kernels.robust_kbench`); None: ``folder`` is neither."""
    if task_packages.is_package(folder):
        return task_packages.load_package(folder)
    if robust_kbench.is_robust_kbench(folder):
        return robust_kbench.load_folder(folder, shape_cap=shape_cap)
    return None


def _entries(p: Path) -> list[Path]:
    """A folder's task files and task folders, sorted by name."""

    def usable(f: Path) -> bool:
        if f.name.startswith(("_", ".")) or f.name == "seeds":
            return False
        if f.is_dir():
            return task_packages.is_package(f) or robust_kbench.is_robust_kbench(f)
        return f.is_file() and f.suffix == ".py"

    return sorted((f for f in p.iterdir() if usable(f)), key=lambda f: f.name)


def load_tasks_skipping(
    path: str | Path, *, shape_cap: int | None = None
) -> tuple[list[Task], list[tuple[str, str]]]:
    """Like :func:`load_tasks`, but a folder's broken entries are skipped: returns the
    tasks and ``(file, reason)`` for each skipped one. A single file, package or
    robust-kbench folder still raises."""
    p = Path(path)
    if not p.exists():
        raise TaskError(f"{p}: no such file or folder")
    if not p.is_dir():
        return [load_task(p)], []
    own = folder_tasks(p, shape_cap=shape_cap)
    if own is not None:
        return own, []
    entries = _entries(p)
    if not entries:
        raise TaskError(
            f"{p}: folder holds no task files (*.py), task packages or robust-kbench folders"
        )
    tasks: list[Task] = []
    skipped: list[tuple[str, str]] = []
    for f in entries:
        try:
            if f.is_dir():
                tasks += folder_tasks(f, shape_cap=shape_cap) or []
            else:
                tasks.append(load_task(f))
        except TaskError as exc:
            skipped.append((str(f), str(exc)))
    return tasks, skipped
