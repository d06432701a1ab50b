"""``kf run FOLDER --tasks 1,19,23-26,Softmax``: choosing tasks of a folder by KernelBench id,
id range or name.

A KernelBench task file is named ``<id>_<Name>.py`` (``23_Softmax.py``); its *id* is the
number before the first underscore. A selection is a comma-separated list of items, each
one of

- ``N``: the task whose id is ``N``;
- ``A-B``: every task whose id is between ``A`` and ``B``, both included;
- anything else: every task whose name contains it (case-insensitive), e.g. ``Softmax``
  picks ``23_Softmax`` and ``24_LogSoftmax``.

A task is chosen when any item picks it; the chosen tasks keep the folder's order. An item
that picks nothing is an error (a typo must not silently shrink a benchmark), as is a
malformed range; the message is one line naming the item.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import TypeVar

__all__ = ["SelectionError", "Selector", "parse_selection", "select", "select_loaded", "task_id"]

T = TypeVar("T")

_ID = re.compile(r"^(\d+)_")
_RANGE = re.compile(r"^(\d+)\s*-\s*(\d+)$")


class SelectionError(ValueError):
    """A ``--tasks`` selection is malformed, or one of its items picks no task."""


def task_id(name: str) -> int | None:
    """The KernelBench id of a task name or file name (``23_Softmax`` → 23), or None."""
    m = _ID.match(name.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Selector:
    """One item of a selection: an id range (``lo``..``hi``) or a name substring."""

    item: str
    lo: int | None = None
    hi: int | None = None
    substring: str | None = None

    def picks(self, name: str) -> bool:
        """Whether this item picks the task called ``name`` (a file stem)."""
        if self.substring is not None:
            return self.substring.lower() in name.lower()
        tid = task_id(name)
        return (
            tid is not None
            and self.lo is not None
            and self.hi is not None
            and (self.lo <= tid <= self.hi)
        )


def parse_selection(spec: str) -> list[Selector]:
    """The items of a selection string; raises :class:`SelectionError` when malformed."""
    items = [part.strip() for part in spec.split(",")]
    if not any(items):
        raise SelectionError(f"--tasks {spec!r}: no task ids, ranges or names given")
    out: list[Selector] = []
    for item in items:
        if not item:
            raise SelectionError(f"--tasks {spec!r}: an empty item (two commas in a row?)")
        if item.isdigit():
            out.append(Selector(item, lo=int(item), hi=int(item)))
            continue
        m = _RANGE.match(item)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise SelectionError(f"--tasks: range {item!r} runs backwards ({lo} > {hi})")
            out.append(Selector(item, lo=lo, hi=hi))
            continue
        if re.match(r"^\d+\s*-", item) or item.startswith("-"):
            raise SelectionError(f"--tasks: {item!r} is not an id, an A-B range or a name")
        out.append(Selector(item, substring=item))
    return out


def select(items: Sequence[T], spec: str, name: Callable[[T], str]) -> list[T]:
    """The ``items`` (tasks, or file paths) that the selection ``spec`` picks, in their
    order; ``name`` gives an item's task name. Raises :class:`SelectionError` naming the
    first selection item that picks nothing, with the ids and names that exist."""
    selectors = parse_selection(spec)
    names = [name(i) for i in items]
    for s in selectors:
        if not any(s.picks(n) for n in names):
            ids = sorted({t for t in map(task_id, names) if t is not None})
            have = f"ids {_ranges(ids)}" if ids else f"names {', '.join(names[:6])}"
            raise SelectionError(f"--tasks: {s.item!r} matches no task (the folder has {have})")
    return [i for i, n in zip(items, names, strict=True) if any(s.picks(n) for s in selectors)]


def _ranges(ids: list[int]) -> str:
    """``[1, 2, 3, 5]`` → ``1-3,5``."""
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def select_loaded(
    tasks: Sequence[T], skipped: Sequence[tuple[str, str]], spec: str, name: Callable[[T], str]
) -> tuple[list[T], list[tuple[str, str]]]:
    """:func:`select` over a folder's loaded tasks and its skipped (broken) files together:
    an item that picks only a broken file is not an error; that file stays skipped."""
    stems = [PurePath(where).stem for where, _ in skipped]
    picked = set(select([*map(name, tasks), *stems], spec, str))
    return (
        [t for t in tasks if name(t) in picked],
        [s for s, stem in zip(skipped, stems, strict=True) if stem in picked],
    )
