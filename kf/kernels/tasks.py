"""Tasks: KernelBench-format problem files (``Model``, ``get_inputs``, ``get_init_inputs``).

A task is read as text and hashed; its code runs only in a sandboxed runner process
(:func:`kf.evaluation.grader.task_check.run_task_check`), never in the process that
loads it. A task may come with seed candidates in ``<folder>/seeds/<stem>.py`` and
``<folder>/seeds/<stem>.*.py``.

A folder may also be a *task package* (:mod:`kf.task_packages`: ``task.py``, ``kf.toml``,
``tests/test_*.py``) or a robust-kbench task folder (:mod:`kf.robust_kbench`), and a
folder of tasks may hold such folders beside its task files.
"""

from __future__ import annotations

import hashlib
import linecache
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "REQUIRED_NAMES",
    "Seed",
    "Task",
    "TaskError",
    "TaskInfo",
    "UserTest",
    "import_source",
    "load_task",
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
class UserTest:
    """A task package's test file (``tests/test_*.py``): its path in the package and text.
    Every candidate must pass its ``test_*`` functions, run in the candidate's box."""

    name: str
    source: str


@dataclass(frozen=True)
class Task:
    """One KernelBench-format task: its name (the file stem), source text and hash.

    A task from a package or a robust-kbench folder also carries the package's user
    ``tests``, its ``settings`` (its ``kf.toml``, as checked) and its ``origin`` (where
    it was read from and how it was made); all three travel with it in the run's log."""

    name: str
    source: str
    sha256: str
    path: str | None = None
    seeds: tuple[Seed, ...] = field(default=())
    tests: tuple[UserTest, ...] = field(default=())
    settings: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    origin: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @classmethod
    def from_source(
        cls,
        name: str,
        source: str,
        *,
        path: str | None = None,
        seeds: tuple[Seed, ...] = (),
        tests: tuple[UserTest, ...] = (),
        settings: dict[str, Any] | None = None,
        origin: dict[str, Any] | None = None,
    ) -> Task:
        """Build a task from its text (a remote worker gets the text from an event). Its
        hash covers the text and its user tests (a changed test is a changed task)."""
        h = hashlib.sha256(source.encode())
        for t in tests:
            h.update(f"\0{t.name}\0{t.source}".encode())
        return cls(
            name=name, source=source, sha256=h.hexdigest(), path=path, seeds=seeds,
            tests=tests, settings=dict(settings or {}), origin=dict(origin or {}),
        )  # fmt: skip

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
