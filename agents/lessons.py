"""Lessons the archive derives (search version 6): a pure function of its state, so replay
recomputes them. A child that beats its profiled parent by more than the timing noise
teaches an improvement; a child that fails where its parent was profiled teaches a
failure. Each is a :class:`~kf.search_facts.LessonLearned` decision (issue 48).
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from kf.events import Event, derived_id
from kf.kernels.backends import language_of
from kf.kernels.behaviour import describe
from kf.llm.lessons import task_features
from kf.search_facts import Lesson, LessonLearned

__all__ = ["MIN_GAIN", "learned"]

#: the least gain over the parent a lesson needs, whatever the noise
MIN_GAIN = 0.05


def _diff_summary(before: str, after: str) -> str:
    """How many lines changed, and the first few changed lines."""
    lines = [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    added = sum(1 for line in lines if line.startswith("+"))
    shown = "; ".join(line.strip()[:100] for line in lines[:4])
    return f"+{added} -{len(lines) - added} lines: {shown}"[:600]


def _config_change(parent: Any, child: Any) -> str:
    keys = sorted(set(parent.config) | set(child.config))
    changed = [
        f"{k} {parent.config.get(k)}→{child.config.get(k)}"
        for k in keys
        if parent.config.get(k) != child.config.get(k)
    ]
    return ", ".join(changed)


def _noise(parent: Any, child: Any) -> float:
    """The relative standard deviation of child/parent from their timings' spreads."""
    total = 0.0
    for c in (parent, child):
        if c.runtime_ms and c.runtime_std_ms:
            total += (c.runtime_std_ms / c.runtime_ms) ** 2
    return math.sqrt(total)


def learned(state: Any, child: Any, plan: list[Event]) -> None:
    """Plan the lesson ``child`` teaches against its parent, if it teaches one."""
    parent = state.candidates.get(child.parent_id or "")
    if parent is None or parent.status != "profiled" or not parent.speedup:
        return
    change = _config_change(parent, child)
    technique = f"{child.operator}" + (f": {change}" if change else "")
    where = f"On {child.task} ({state.config.device})"
    if child.status == "profiled" and child.speedup and not child.suspect:
        gain = child.speedup / parent.speedup
        noise = _noise(parent, child)
        if gain <= 1.0 + max(2.0 * noise, MIN_GAIN):
            return
        kind = "improvement"
        text = (
            f"{where}, {technique} made the kernel {gain:.2f}x faster than its parent "
            f"({parent.speedup:.2f}x → {child.speedup:.2f}x over eager; noise {100 * noise:.0f}%)."
        )
    elif child.status == "failed" and child.failure:
        gain, noise, kind = None, None, "failure"
        error = (child.error or "").strip().splitlines()[:1]
        text = f"{where}, {technique} broke a working kernel: {child.failure}" + (
            f" ({error[0][:200]})" if error else ""
        )
    else:
        return
    t = state.tasks[child.task]
    lesson = Lesson(
        lesson_id=derived_id("lesson", state.run_id, parent.id, child.id),
        kind=kind,
        task=child.task,
        text=text,
        technique=technique,
        cell_before=parent.cell,
        cell_after=describe(child.source).cell(),
        diff_summary=_diff_summary(parent.source, child.source),
        diagnosis_before="ok",
        diagnosis_after="ok" if kind == "improvement" else (child.failure or ""),
        features=task_features(t.reference, language_of(child.backend)),
        device=state.config.device,
        gain=gain,
        noise=noise,
        parent_id=parent.id,
        child_id=child.id,
        run_id=state.run_id,
    )
    plan.append(LessonLearned(lesson=lesson))
