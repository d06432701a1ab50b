"""Tasks: KernelBench-format problem files (``Model``, ``get_inputs``, ``get_init_inputs``).

A task is read as text and hashed; its code runs only in a sandboxed runner process
(:func:`kf.evaluation.grader.task_check.run_task_check`), never in the process that
loads it. A task may come with seed candidates in ``<folder>/seeds/<stem>.py`` and
``<folder>/seeds/<stem>.*.py``.
"""

from __future__ import annotations

import hashlib
import linecache
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

__all__ = [
    "REQUIRED_NAMES",
    "Seed",
    "Task",
    "TaskError",
    "TaskInfo",
    "import_source",
    "load_task",
    "load_tasks",
]

REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")


class TaskError(Exception):
    """A task file is missing or broken; the message names the file and the cause."""


@dataclass(frozen=True)
class Seed:
    """A known-good starting candidate for a task (Python source defining ``ModelNew``)."""

    name: str
    source: str


@dataclass(frozen=True)
class Task:
    """One KernelBench-format task: its name (the file stem), source text and hash."""

    name: str
    source: str
    sha256: str
    path: str | None = None
    seeds: tuple[Seed, ...] = field(default=())

    @classmethod
    def from_source(
        cls, name: str, source: str, *, path: str | None = None, seeds: tuple[Seed, ...] = ()
    ) -> Task:
        """Build a task from its text (a remote worker gets the text from an event)."""
        digest = hashlib.sha256(source.encode()).hexdigest()
        return cls(name=name, source=source, sha256=digest, path=path, seeds=seeds)

    @property
    def label(self) -> str:
        """How error messages name this task: its path when it has one, else its name."""
        return self.path or f"<task {self.name}>"


class TaskInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What running a task's reference ``Model`` once showed."""

    name: str
    input_shapes: list[list[int]]
    input_dtypes: list[str]
    output_shapes: list[list[int]]
    output_dtypes: list[str]
    eager_ms: float
    device: str = "cpu"


def _syntax_check(label: str, source: str) -> None:
    try:
        compile(source, label, "exec")
    except SyntaxError as exc:
        raise TaskError(f"{label}: syntax error at line {exc.lineno}: {exc.msg}") from exc


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"{path}: cannot read: {exc}") from exc


def _seeds_for(path: Path) -> tuple[Seed, ...]:
    """``seeds/<stem>.py`` first, then ``seeds/<stem>.*.py`` sorted by name."""
    folder = path.parent / "seeds"
    if not folder.is_dir():
        return ()
    stem = path.stem
    main = [folder / f"{stem}.py"] if (folder / f"{stem}.py").is_file() else []
    files = main + sorted(p for p in folder.glob(f"{stem}.*.py") if p.is_file())
    return tuple(Seed(name=p.stem, source=_read(p)) for p in files)


def load_task(path: str | Path) -> Task:
    """Read one task file and its seeds; raise :class:`TaskError` if missing or unparsable."""
    p = Path(path)
    if not p.exists():
        raise TaskError(f"{p}: no such file")
    if not p.is_file() or p.suffix != ".py":
        raise TaskError(f"{p}: not a Python file (a task is a .py file with class Model)")
    source = _read(p)
    _syntax_check(str(p), source)
    return Task.from_source(p.stem, source, path=str(p), seeds=_seeds_for(p))


def load_tasks(path: str | Path) -> list[Task]:
    """Read a task file, or every task in a folder (``*.py``, sorted, not recursive)."""
    p = Path(path)
    if not p.exists():
        raise TaskError(f"{p}: no such file or folder")
    if p.is_file():
        return [load_task(p)]
    files = sorted(
        f
        for f in p.glob("*.py")
        if f.is_file() and f.name != "__init__.py" and not f.name.startswith("_")
    )
    if not files:
        raise TaskError(f"{p}: folder holds no task files (*.py)")
    return [load_task(f) for f in files]


def load_tasks_skipping(path: str | Path) -> tuple[list[Task], list[tuple[str, str]]]:
    """Like :func:`load_tasks`, but a folder's broken files are skipped: returns the tasks
    and ``(file, reason)`` for each skipped one. A single file still raises."""
    p = Path(path)
    if not p.is_dir():
        return load_tasks(p), []
    files = sorted(
        f
        for f in p.glob("*.py")
        if f.is_file() and f.name != "__init__.py" and not f.name.startswith("_")
    )
    if not files:
        raise TaskError(f"{p}: folder holds no task files (*.py)")
    tasks: list[Task] = []
    skipped: list[tuple[str, str]] = []
    for f in files:
        try:
            tasks.append(load_task(f))
        except TaskError as exc:
            skipped.append((str(f), str(exc)))
    return tasks, skipped


def import_source(module_name: str, source: str, filename: str | None = None) -> types.ModuleType:
    """Execute ``source`` as a new module registered as ``sys.modules[module_name]``.

    The source is registered with :mod:`linecache` so tracebacks show its lines. Any
    exception from the module's top level propagates (the module is unregistered).
    """
    filename = filename or f"<{module_name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(module_name)
    module.__file__ = filename
    sys.modules[module_name] = module
    try:
        exec(compile(source, filename, "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
