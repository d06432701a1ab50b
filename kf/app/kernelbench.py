"""A run's results in KernelBench's terms: one row per task, and per-level scores.

KernelBench (ScalingIntelligence/KernelBench) writes one entry per problem and sample in
``eval_results.json`` — ``compiled``, ``correctness``, ``metadata``, ``runtime`` and
``runtime_stats`` (milliseconds), ``ref_runtime`` and ``ref_runtime_stats`` — and keeps
baseline times per level and problem file name (``"level1": {"23_Softmax.py": {"mean": …}}``)
for eager (``baseline_time_torch.json``) and for ``torch.compile``
(``baseline_time_torch_compile_inductor_<mode>.json``). Its scores
(``scripts/benchmark_eval_analysis.py``, ``src/score.py``), over the N problems of a level:

- correctness rate: correct problems / N (a problem without a result counts as wrong);
- ``fast_p``: problems that are correct **and** have speed-up > p, divided by all N (not
  by the correct ones), for p in 0, 0.5, 0.8, 1, 1.5, 2;
- geometric-mean speed-up over the correct problems only (0 when none is correct).

Tasks kf's audit marked degenerate (their outputs do not depend on their inputs, so a
constant passes them: KernelBench level 2's tasks 23, 80 and 83) are left out of every
score, as KernelBench-Verified leaves them out, and scored on their own line (a level's
``degenerate``); their rows say ``degenerate``.

kf reports one sample per problem — the task's best kernel (``sample_id`` 0, as in
KernelBench's greedy evaluation; ``candidate_id`` names it) — and states each score three
times: against eager (KernelBench's own baseline), against ``torch.compile`` timed in the
same session, and against the better of the two. Against ``torch.compile``, a task whose
compiled reference has no time (turned off, or the compile failed) cannot be fast, is left
out of the geometric mean and is counted in ``tasks_without_compile_baseline``; against
the better of the two it is stated against eager, the only baseline it has. Tasks a
folder skipped (a broken file) are rows too, neither compiled nor correct, so N is every
task the run was asked for.

A task's level comes from the folder its file was in (``…/level2/…`` → 2); tasks from
other folders have level None and are scored together.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Iterable
from pathlib import PurePath
from typing import Any

from kf.app.task_select import task_id
from kf.config import RunConfig
from kf.events import Envelope, decode_event
from kf.facts import RunStarted

__all__ = [
    "CSV_COLUMNS",
    "FAST_P",
    "fast_p",
    "format_levels",
    "geomean",
    "kernelbench_section",
    "level_of",
    "level_scores",
    "rows_to_csv",
    "task_windows",
]

#: KernelBench's thresholds (``benchmark_eval_analysis.py``)
FAST_P = (0.0, 0.5, 0.8, 1.0, 1.5, 2.0)
BASELINES = ("eager", "compile", "best")
_LEVEL = re.compile(r"^level[_-]?(\d+)$", re.IGNORECASE)
_STAGES = frozenset(
    {
        "kernel.candidate_compiled",
        "kernel.candidate_verified",
        "kernel.candidate_rejected",
        "kernel.candidate_profiled",
    }
)

#: the columns of ``kf report --csv``, in order (``metadata`` and the stats as JSON text)
CSV_COLUMNS = (
    "level",
    "problem_id",
    "problem_name",
    "sample_id",
    "candidate_id",
    "compiled",
    "correctness",
    "runtime",
    "runtime_std",
    "ref_runtime",
    "ref_runtime_compile",
    "speedup",
    "speedup_vs_compile",
    "speedup_vs_best",
    "compile_mode",
    "tf32",
    "candidates",
    "peak_device_mb",
    "time_s",
    "degenerate",
    "metadata",
)


def level_of(path: str | None) -> int | None:
    """The KernelBench level of a task file, from its folder's name (``level1`` → 1)."""
    if not path:
        return None
    parent = PurePath(path).parent.name
    m = _LEVEL.match(parent)
    return int(m.group(1)) if m else None


def fast_p(rows: list[dict[str, Any]], p: float, key: str = "speedup") -> float:
    """KernelBench's ``fast_p``: rows correct with ``key`` > p, over all rows."""
    if not rows:
        return 0.0
    return sum(1 for r in rows if r["correctness"] and (r.get(key) or 0.0) > p) / len(rows)


def geomean(values: Iterable[float]) -> float:
    """Geometric mean (0.0 for no values, as KernelBench's score gives)."""
    vals = [v for v in values if v > 0]
    if not vals:
        return 0.0
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


_KEYS = {"eager": "speedup", "compile": "speedup_vs_compile", "best": "speedup_vs_best"}


def level_scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """KernelBench's scores of one level's rows, against each baseline, over the rows the
    audit did not mark degenerate (as KernelBench-Verified leaves out level 2's tasks 23,
    80 and 83); those rows' own scores under ``degenerate`` (their ``problems``, and the
    same scores), when there are any."""
    kept = [r for r in rows if not r.get("degenerate")]
    left = [r for r in rows if r.get("degenerate")]
    scores = _level_scores(kept)
    if left:
        scores["degenerate"] = {
            "problems": [r["problem_name"] for r in left],
            **_level_scores(left),
        }
    return scores


def _level_scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`level_scores` of ``rows``, all counted."""
    n = len(rows)
    compiled = sum(1 for r in rows if r["compiled"])
    correct = [r for r in rows if r["correctness"]]
    return {
        "tasks": n,
        "compiled": compiled,
        "correct": len(correct),
        "compilation_rate": compiled / n if n else 0.0,
        "correctness_rate": len(correct) / n if n else 0.0,
        "fast_p": {
            b: {f"fast_{p:g}": fast_p(rows, p, _KEYS[b]) for p in FAST_P} for b in BASELINES
        },
        "geomean_speedup": {
            b: geomean(r[_KEYS[b]] for r in correct if r.get(_KEYS[b])) for b in BASELINES
        },
        "tasks_without_compile_baseline": sum(
            1 for r in correct if r.get("speedup_vs_compile") is None
        ),
    }


def task_windows(envelopes: Iterable[Envelope]) -> dict[str, tuple[float, float]]:
    """Each task's span of device work (producer clocks): from the earliest verification
    or profile's start (its event's time less the stage's ``duration_s``) to the last one's
    end. A task's compile is left out: a run builds every task's seeds at once at the
    start, and a span from the compile would take in the other tasks' verifications and
    profiles while this one's candidates waited (on the H200 every level-2 task's span then
    held the same device-wide peak). Compile-only tasks span their compiles."""
    return {t: (w[0], w[1]) for t, w in _scan(envelopes)[0].items()}


_DEVICE_STAGES = _STAGES - {"kernel.candidate_compiled"}


def _scan(
    envelopes: Iterable[Envelope],
) -> tuple[dict[str, list[float]], dict[str, float], dict[str, float]]:
    """Per task: ``[start, end]`` of its device stages (:func:`task_windows`), the largest
    ``peak_device_mb`` its stage reports state (reports that carry one), and its seconds
    of evaluation work: the sum of its stages' ``duration_s`` (compiles, verifications,
    profiles), time queued behind other tasks left out."""
    device: dict[str, list[float]] = {}
    builds: dict[str, list[float]] = {}
    peak: dict[str, float] = {}
    work: dict[str, float] = {}
    for env in envelopes:
        if env.type in _STAGES:
            ev = decode_event(env)
            task = str(getattr(ev, "task", ""))
            report = getattr(ev, "report", None)
            took = max(0.0, float(getattr(report, "duration_s", 0.0) or 0.0))
            work[task] = work.get(task, 0.0) + took
            spans = device if env.type in _DEVICE_STAGES else builds
            w = spans.setdefault(task, [env.time - took, env.time])
            w[0], w[1] = min(w[0], env.time - took), max(w[1], env.time)
            mb = getattr(report, "peak_device_mb", None)
            if isinstance(mb, int | float) and mb > 0:
                peak[task] = max(peak.get(task, 0.0), float(mb))
    return {**builds, **device}, peak, work


def _task_row(
    t: dict[str, Any],
    path: str | None,
    config: RunConfig,
    peaks: dict[str, float],
    times: dict[str, float],
) -> dict[str, Any]:
    """The KernelBench row of a task of the report (``t``), from the file at ``path``."""
    name = t["task"]
    correct = t.get("best_speedup") is not None
    vs_compile = t.get("best_speedup_vs_compiled")
    vs_best = t.get("best_speedup_vs_best")
    meta: dict[str, Any] = {}
    if t.get("failures"):
        meta["failures"] = t["failures"]
    if t.get("skipped"):
        meta["skipped"] = t["skipped"]
    if t.get("best_flags"):
        meta["flags"] = t["best_flags"]
    if t.get("compile_baseline_error"):
        meta["compile_baseline_error"] = t["compile_baseline_error"]
    return {
        "level": level_of(path),
        "problem_id": task_id(name),
        "problem_name": PurePath(path).name if path else f"{name}.py",
        "sample_id": 0,
        "candidate_id": t.get("best_candidate_id"),
        "compiled": bool(t.get("compiled")),
        "correctness": correct,
        "runtime": t["best_ms"] if correct and t.get("best_ms") else -1.0,
        "runtime_stats": {"mean": t["best_ms"], "std": t.get("best_std_ms") or 0.0}
        if correct and t.get("best_ms")
        else {},
        "ref_runtime": t["ref_ms"] if correct and t.get("ref_ms") else -1.0,
        "ref_runtime_compile": t["compiled_ms"] if correct and t.get("compiled_ms") else -1.0,
        "speedup": t["best_speedup"] if correct else None,
        "speedup_vs_compile": vs_compile if correct else None,
        "speedup_vs_best": (vs_best if vs_best is not None else t["best_speedup"])
        if correct
        else None,
        "compile_mode": t.get("compile_mode") or _compile_mode(config),
        "tf32": t.get("tf32") or config.evaluation.tf32,
        "candidates": t.get("candidates", 0),
        "peak_device_mb": peaks.get(name),
        "time_s": times.get(name),
        "degenerate": bool(t.get("degenerate")),
        "metadata": meta,
    }


def _skipped_row(where: str, why: object, config: RunConfig) -> dict[str, Any]:
    """The KernelBench row of a task file the run skipped (at ``where``, for ``why``)."""
    return {
        "level": level_of(where),
        "problem_id": task_id(PurePath(where).stem),
        "problem_name": PurePath(where).name,
        "sample_id": 0,
        "candidate_id": None,
        "compiled": False,
        "correctness": False,
        "runtime": -1.0,
        "runtime_stats": {},
        "ref_runtime": -1.0,
        "ref_runtime_compile": -1.0,
        "speedup": None,
        "speedup_vs_compile": None,
        "speedup_vs_best": None,
        "compile_mode": _compile_mode(config),
        "tf32": config.evaluation.tf32,
        "candidates": 0,
        "peak_device_mb": None,
        "time_s": None,
        "degenerate": False,
        "metadata": {"skipped": str(why)},
    }


def _compile_mode(config: RunConfig) -> str:
    return config.evaluation.compile_mode or "default"


def kernelbench_section(tasks: list[dict[str, Any]], envelopes: list[Envelope]) -> dict[str, Any]:
    """``report["kernelbench"]``: ``rows`` (one per task, KernelBench's field names) and
    ``levels`` (``"level1"``: scores; ``"all"`` for tasks outside a ``levelN`` folder)."""
    started = next((decode_event(e) for e in envelopes if e.type == "run.started"), None)
    specs = {t.name: t for t in getattr(started, "tasks", ())}
    config = started.run_config() if isinstance(started, RunStarted) else RunConfig()
    _, peaks, times = _scan(envelopes)
    rows = [
        _task_row(t, getattr(specs.get(t["task"]), "path", None), config, peaks, times)
        for t in tasks
    ]
    rows += [_skipped_row(w, why, config) for w, why in config.tasks.skipped_tasks.items()]
    rows.sort(key=lambda r: (r["level"] or 0, r["problem_id"] or 0, r["problem_name"]))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(f"level{r['level']}" if r["level"] is not None else "all", []).append(r)
    return {
        "rows": rows,
        "levels": {k: level_scores(v) for k, v in sorted(groups.items())},
        "fast_p_thresholds": list(FAST_P),
        "compile_mode": _compile_mode(config),
    }


def rows_to_csv(rows: list[dict[str, Any]]) -> str:
    """``kf report --csv``: one line per task, :data:`CSV_COLUMNS`; empty cells for none."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        flat = {**r, "runtime_std": (r.get("runtime_stats") or {}).get("std", "")}
        cells = []
        for c in CSV_COLUMNS:
            v = flat.get(c)
            if c == "metadata":
                cells.append(json.dumps(v or {}, sort_keys=True))
            elif v is None:
                cells.append("")
            elif isinstance(v, bool):
                cells.append("True" if v else "False")
            else:
                cells.append(str(v))
        w.writerow(cells)
    return out.getvalue()


def format_levels(section: dict[str, Any]) -> list[str]:
    """Lines of the plain-text report: per level, the rates, fast_p and geomeans against
    eager, torch.compile and the better of the two."""
    lines: list[str] = []
    for level, s in section.get("levels", {}).items():
        n = s["tasks"]
        lines.append(
            f"{level}: {n} task(s), compiled {s['compiled']}/{n}, correct {s['correct']}/{n} "
            f"(correctness rate {s['correctness_rate']:.2f})"
        )
        for b, label in (
            ("eager", "vs eager"),
            ("compile", "vs torch.compile"),
            ("best", "vs best of both"),
        ):
            fp = s["fast_p"][b]
            gm = s["geomean_speedup"][b]
            lines.append(
                f"  {label:>17}: "
                + ", ".join(f"{k} = {v:.2f}" for k, v in fp.items())
                + (f"; geomean over correct {gm:.2f}×" if gm else "; geomean: no correct task")
            )
        if s.get("tasks_without_compile_baseline"):
            lines.append(
                f"  {s['tasks_without_compile_baseline']} correct task(s) without a "
                "torch.compile time: not fast against it, not in its geomean"
            )
        d = s.get("degenerate")
        if d:
            gm = d["geomean_speedup"]["eager"]
            lines.append(
                f"  degenerate (kf's audit: outputs do not depend on inputs), left out of the "
                f"scores above: {', '.join(d['problems'])}: correct {d['correct']}/{d['tasks']}, "
                + ", ".join(f"{k} = {v:.2f}" for k, v in d["fast_p"]["eager"].items())
                + (f"; geomean vs eager {gm:.2f}×" if gm else "")
            )
    return lines
