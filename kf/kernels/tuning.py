"""Template tuning per input shape and device: the shape sets of a task, and ``kf run``'s
tuning option.

A task's *shape sets*: set 0 is its own ``get_inputs()``; when the task defines
``get_tuning_inputs()`` (a list of input lists, each like ``get_inputs()``'s result and
valid for the same ``get_init_inputs()``), set ``i`` is its ``(i - 1)``-th entry. A task is
*bound* to a shape set by appending a ``get_inputs`` that returns that entry, so every
stage (task check, compile, verify with its generalisation gate, profile) runs at those
shapes with no change to the evaluation code.
"""

from __future__ import annotations

import argparse
import ast
from typing import Any

from kf.kernels.tasks import Task

__all__ = [
    "DEFAULT_TUNE_BUDGET",
    "MIN_PER_SHAPE",
    "add_tuning_options",
    "bind_shape",
    "has_tuning_inputs",
    "parse_shape",
    "shape_sets",
    "tuning_config",
]

DEFAULT_TUNE_BUDGET = 12
MIN_PER_SHAPE = 4  # timings a shape set needs at least: two for the climb, two to confirm


def has_tuning_inputs(task: Task) -> bool:
    """Whether the task defines ``get_tuning_inputs()`` (read from its text, not run)."""
    return "def get_tuning_inputs" in task.source


def bind_shape(task: Task, index: int) -> Task:
    """``task`` with ``get_inputs`` rebound to shape set ``index`` (0: the task itself)."""
    if index <= 0:
        return task
    src = (
        f"{task.source}\n\n# kf: bound to tuning shape set {index}\n"
        f"def get_inputs():\n    return list(get_tuning_inputs()[{index - 1}])\n"
    )
    return Task.from_source(
        task.name, src, path=task.path, seeds=task.seeds, tests=task.tests,
        settings=task.settings, origin=task.origin,
    )  # fmt: skip


def shape_sets(task: Task, limit: int) -> list[tuple[int, Task]]:
    """Up to ``limit`` shape sets: the task's own, then its tuning inputs (unchecked: a set
    past the end of ``get_tuning_inputs()`` fails its task check)."""
    n = limit if has_tuning_inputs(task) else 1
    return [(i, bind_shape(task, i)) for i in range(max(1, n))]


def parse_shape(shape: str) -> tuple[tuple[int, ...], ...] | None:
    """``"[[8, 4096], [8, 4096]]"`` (a ``tuning.config_tuned`` shape) as nested tuples."""
    try:
        value = ast.literal_eval(shape)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(value, list | tuple):
        return None
    out = []
    for dims in value:
        if not isinstance(dims, list | tuple) or not all(isinstance(d, int) for d in dims):
            return None
        out.append(tuple(dims))
    return tuple(out)


def add_tuning_options(p: argparse.ArgumentParser) -> None:
    """``--tune-budget N``."""
    p.add_argument(
        "--tune-budget",
        type=int,
        default=DEFAULT_TUNE_BUDGET,
        metavar="N",
        help="configurations the tuner times per task and device, over the task's own shape "
        "and its get_tuning_inputs() together and over the task's elites (best first, each "
        "getting what the earlier ones left), once the task's search budget is spent "
        f"(default {DEFAULT_TUNE_BUDGET}; 0 turns tuning off)",
    )


def tuning_config(args: argparse.Namespace) -> dict[str, Any] | str:
    """The run-config keys of the tuning options, or an error message."""
    budget = int(getattr(args, "tune_budget", DEFAULT_TUNE_BUDGET))
    if budget < 0:
        return "--tune-budget must be 0 or more"
    return {"tune_budget": budget}
