"""``kf report``: a run's results, folded from its log with the archive's own fold.

KernelBench's ``fast_p``: the fraction of the run's tasks whose best kernel is correct
and more than ``p`` times faster than PyTorch eager (``fast_0`` counts correct tasks).
``fast_p_vs_best`` and ``geomean_speedup_vs_best`` state the same against the better
of eager and ``torch.compile`` (timed in the same session, :mod:`kf.evaluation.grader.profiling`);
a task whose best kernel has no ``torch.compile`` time counts against eager there, and
``tasks_without_compiled_baseline`` says how many did.

A report read from a log file first verifies the log's hash chain: a log changed outside
kf raises :class:`~kf.log.LogIntegrityError` naming the first bad ``seq``, unless the
caller passes ``ignore_integrity`` — then the report carries the failure and its table
says so before anything else.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kf.agent import AgentContext
from kf.app.mutator_stats import format_mutator_stats, mutator_stats
from kf.app.run_stats import format_run_stats, run_stats
from kf.events import Envelope, decode_event
from kf.fold import fold
from kf.log import EventLog, check_integrity
from kf.search_facts import CandidateProfiled, CandidateVerified, TaskChecks

if TYPE_CHECKING:
    from agents.archive import ArchiveState

__all__ = [
    "FAST_P",
    "best_baselines",
    "build_report",
    "build_report_from",
    "fold_archive",
    "fold_envelopes",
    "format_table",
    "headline",
]

FAST_P = (0.0, 1.0, 1.5, 2.0)
_STAGE_EVENTS = frozenset(
    {
        "kernel.candidate_compiled",
        "kernel.candidate_verified",
        "kernel.candidate_rejected",
        "kernel.candidate_profiled",
    }
)


def fold_archive(elog: EventLog, *, ignore_integrity: bool = False) -> ArchiveState:
    """The archive state after the whole log, once its chain is verified (see module doc)."""
    check_integrity(elog, ignore=ignore_integrity)
    return fold_envelopes(elog.read())


def fold_envelopes(envelopes: Iterable[Envelope]) -> ArchiveState:
    """The archive state after these committed envelopes (in ``seq`` order)."""
    from agents.archive import ArchiveAgent

    return fold(envelopes, ArchiveAgent(AgentContext(run_id="", agent_id="archive@report")))


def build_report(db: str | Path, *, ignore_integrity: bool = False) -> dict[str, Any]:
    """The JSON report of ``kf report --json``, from a log file whose chain is verified."""
    with EventLog(db, readonly=True) as elog:
        integrity = check_integrity(elog, ignore=ignore_integrity)
        report = build_report_from(list(elog.read()))
    report["integrity"] = {**integrity.as_json(), "message": integrity.message()}
    return report


def build_report_from(envelopes: list[Envelope]) -> dict[str, Any]:
    """The JSON report from committed envelopes (a log file, or a run followed over NATS)."""
    from agents.archive import CELLS_PER_ISLAND

    state = fold_envelopes(envelopes)
    devices = sorted(
        {
            str(getattr(decode_event(e), "device_id", ""))
            for e in envelopes
            if e.type == "device.announced"
        }
    )
    finished = [decode_event(e) for e in envelopes if e.type == "run.finished"]
    events = len(envelopes)
    tasks: list[dict[str, Any]] = []
    speedups: dict[str, float] = {}
    vs_best: dict[str, float] = {}
    profiles = _profiles(envelopes)
    audits = _audits(envelopes, state.config.confirm_trusted)
    filled = 0
    for name in state.tasks:
        entry = _task_entry(state, name, profiles, audits)
        filled += entry["archive_cells_filled"]
        tasks.append(entry)
        if entry["best_speedup"] is not None:
            speedups[name] = entry["best_speedup"]
            better = entry["best_speedup_vs_best"]
            vs_best[name] = better if better is not None else entry["best_speedup"]
    total_cells = len(state.tasks) * state.config.islands * CELLS_PER_ISLAND
    # the search's mutators (tuned candidates are counted per task, as tuned_candidates)
    mutators = sorted({c.mutator for c in state.candidates.values() if c.operator != "tune"})
    from kf.app.kernelbench import kernelbench_section

    compared = mutator_stats(envelopes)  # a mixed population's kinds, side by side
    return {
        **({"mutators": compared} if compared else {}),
        "run_id": state.run_id,
        "seed": state.seed,
        "events": events,
        "finished": bool(finished),
        "finish_reason": finished[0].reason if finished else None,  # type: ignore[attr-defined]
        # the config the run recorded in run.started (a flag's or a --config file's)
        "config": {
            **recorded_config(envelopes),
            "budget": state.config.budget,
            "islands": state.config.islands,
            "max_in_flight": state.config.max_in_flight,
        },
        "tasks": tasks,
        "archive": {"filled_cells": filled, "total_cells": total_cells},
        **headline(
            speedups, vs_best, len(state.tasks), {t["task"] for t in tasks if t["degenerate"]}
        ),
        "tasks_without_compiled_baseline": sum(
            1 for t in tasks if t["best_speedup"] is not None and t["best_speedup_vs_best"] is None
        ),
        "degenerate_tasks": sorted(t["task"] for t in tasks if t["degenerate"]),
        "mutator": mutators[0] if len(mutators) == 1 else mutators,
        "devices": devices,
        "task_checks": task_checks(envelopes),
        "run_stats": run_stats(envelopes),
        # stage reports whose runners ran outside kf's box (--unsafe-no-sandbox)
        "unsandboxed_results": sum(
            1
            for e in envelopes
            if e.type in _STAGE_EVENTS
            and getattr(getattr(decode_event(e), "report", None), "sandbox", "")
            == "unsafe-no-sandbox"
        ),
        # one row per task in KernelBench's terms, and scores per level (kf.app.kernelbench)
        "kernelbench": kernelbench_section(tasks, envelopes),
        "lessons": lessons_section(envelopes),
    }


def recorded_config(envelopes: Iterable[Envelope]) -> dict[str, Any]:
    """The config the run recorded in its ``run.started``, decoded once
    (:meth:`kf.facts.RunStarted.run_config`) and written back as the log's map ({} for a
    log without one)."""
    from kf.facts import RunStarted

    for e in envelopes:
        if e.type == RunStarted.tag:
            started = decode_event(e)
            return started.run_config().wire() if isinstance(started, RunStarted) else {}
    return {}


def config_line(config: dict[str, Any]) -> str:
    """The recorded config in one line: ``config: budget 3, islands 1, ...`` (the tasks
    left out are said elsewhere)."""
    shown = {k: v for k, v in config.items() if k != "skipped_tasks"}
    return "config: " + ", ".join(f"{k} {_said(v)}" for k, v in shown.items())


def _said(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return "[" + ", ".join(_said(v) for v in value) + "]"
    return str(value)


def lessons_section(envelopes: list[Envelope]) -> dict[str, Any]:
    """The run's lessons (issue 48): how many it learned and loaded, how many prompts quoted
    lessons and which, how often; the control arms and controlled comparisons it ran, the
    lessons it verified or retired, and per lesson used what it bought (the mean gain of
    the arm with it over its control, where both were timed)."""
    learned = loaded = prompts = controls = 0
    used: dict[str, int] = {}
    status: dict[str, str] = {}
    compared: list[Any] = []
    for e in envelopes:
        if e.type == "lesson.learned":
            learned += 1
        elif e.type == "lesson.loaded":
            got = getattr(decode_event(e), "lessons", ())
            loaded += len(got)
            status.update({x.lesson_id: x.status for x in got})
        elif e.type == "prompt.chosen":
            ev = decode_event(e)
            controls += getattr(ev, "arm", "") == "control"
            ids = getattr(ev, "lessons", ())
            prompts += bool(ids)
            for i in ids:
                used[i] = used.get(i, 0) + 1
        elif e.type == "lesson.compared":
            compared.append(decode_event(e))
        elif e.type in ("lesson.verified", "lesson.retired"):
            status[getattr(decode_event(e), "lesson_id", "")] = e.type.partition(".")[2]
    per_lesson = {i: _lesson_bought(i, n, status, compared) for i, n in sorted(used.items())}
    return {
        "learned": learned,
        "loaded": loaded,
        "prompts_with_lessons": prompts,
        "used": dict(sorted(used.items())),
        "controls": controls,
        "compared": len(compared),
        "gains": sum(1 for c in compared if c.outcome == "gain"),
        "verified": sum(1 for e in envelopes if e.type == "lesson.verified"),
        "retired": sum(1 for e in envelopes if e.type == "lesson.retired"),
        "per_lesson": per_lesson,
    }


def _lesson_bought(
    lesson_id: str, uses: int, status: dict[str, str], compared: list[Any]
) -> dict[str, Any]:
    """One lesson's part of the run: prompts, comparisons, gains, mean gain, status."""
    mine = [c for c in compared if lesson_id in c.lessons]
    gains = [c.gain for c in mine if c.gain is not None]
    return {
        "prompts": uses,
        "compared": len(mine),
        "gains": sum(1 for c in mine if c.outcome == "gain"),
        "bought": round(sum(gains) / len(gains), 4) if gains else None,
        "status": status.get(lesson_id, "unverified"),
    }


def _task_entry(
    state: ArchiveState, name: str, profiles: dict[str, list[Any]], audits: dict[str, Any]
) -> dict[str, Any]:
    """One task's part of the report: its counts, its best kernel and how it compares
    (eager, torch.compile, the better), what kept candidates out, tuning, the audit."""
    from agents.archive import best_candidate
    from agents.archive_tuning import summary as tuning_summary

    t = state.tasks[name]
    best = best_candidate(state, name)
    entry: dict[str, Any] = {
        "task": name,
        "candidates": t.proposed,
        "compiled": t.compiled,
        "correct": t.correct,
        "profiled": t.profiled,
        "failed": t.failed,
        "duplicates": t.duplicates,  # the same code as an earlier candidate: never run
        "best_speedup": best.speedup if best else None,
        "best_candidate_id": best.id if best else None,
        "best_config": best.config if best else None,
        "best_cell": list(best.cell) if best and best.cell else None,
        "ref_ms": best.ref_ms if best else None,
        "best_ms": best.runtime_ms if best else None,
        "best_std_ms": best.runtime_std_ms if best else None,
        "archive_cells_filled": len(t.elites),
        "skipped": t.skipped,
        "best_flags": list(best.flags) if best else [],
        # candidates kept out of the best list, with the reason
        "suspect": [
            {"candidate_id": c.id, "flags": list(c.flags)}
            for c in state.candidates.values()
            if c.task == name and c.suspect
        ],
        "failures": _failures(state, name),
        "tuning": tuning_summary(state, name),
        "tuned_candidates": sum(
            1 for c in state.candidates.values() if c.task == name and c.operator == "tune"
        ),
        "generalisation_failed": [
            {"candidate_id": c.id, "reason": c.generalisation}
            for c in state.candidates.values()
            if c.task == name and c.generalisation is not None
        ],
    }
    entry.update(_baseline_entry(profiles, name, best.id if best else None))
    audit = audits.get(name)
    # a degenerate task (outputs independent of inputs): its speed-ups mean nothing
    entry["degenerate"] = bool(audit is not None and audit.degenerate)
    entry["audit"] = None if audit is None else msgspec.to_builtins(audit)
    if entry["degenerate"] and best is not None:
        entry["best_flags"] = [
            *entry["best_flags"],
            f"degenerate_task: the task's outputs do not depend on its inputs, so this "
            f"speed-up means nothing ({audit.reason})",  # type: ignore[union-attr]
        ]
    return entry


def task_checks(envelopes: Iterable[Envelope]) -> list[dict[str, Any]]:
    """The run's task checks (``kernel.task_checked``, the last of each task), by task:
    where each ran and what it gave (outputs, eager time), or why it failed."""
    return [
        {
            "task": name,
            "ok": c.ok,
            "device": c.device,
            "eager_ms": c.info.eager_ms if c.info else None,
            "output_shapes": c.info.output_shapes if c.info else None,
            "error": c.error or None,
        }
        for name, c in sorted(fold(envelopes, TaskChecks()).items())
    ]


def _check_lines(report: dict[str, Any]) -> list[str]:
    """One line for the task checks the run recorded: where they ran, and which failed."""
    checks = report.get("task_checks") or []
    if not checks:
        return []
    where = ", ".join(sorted({c["device"] for c in checks}))
    failed = [
        f"{c['task']} ({((c['error'] or '').splitlines() or [''])[0][:120]})"
        for c in checks
        if not c["ok"]
    ]
    passed = len(checks) - len(failed)
    return [
        f"task check on {where}: {passed} passed"
        + (f", {len(failed)} failed: " + "; ".join(failed) if failed else "")
    ]


def _scores(speedups: dict[str, float], vs_best: dict[str, float], n: int) -> dict[str, Any]:
    """fast_p (over ``n`` tasks) and the geomeans (over the tasks with a speed-up)."""
    from agents.archive import geomean

    def fast(values: dict[str, float]) -> dict[str, float]:
        return {
            f"fast_{p:g}": (sum(v > p for v in values.values()) / n if n else 0.0) for p in FAST_P
        }

    return {
        "fast_p": fast(speedups),
        "geomean_speedup": geomean(list(speedups.values())),
        "fast_p_vs_best": fast(vs_best),
        "geomean_speedup_vs_best": geomean(list(vs_best.values())),
    }


def headline(
    speedups: dict[str, float], vs_best: dict[str, float], n: int, degenerate: set[str]
) -> dict[str, Any]:
    """The headline: fast_p and the geomeans over the ``n`` tasks less those the audit
    marked ``degenerate`` (their outputs do not depend on their inputs: a constant passes
    them, and its speed-up means nothing), as KernelBench-Verified leaves out level 2's
    tasks 23, 80 and 83; the degenerate tasks' own scores beside it, under
    ``degenerate``, and ``headline_tasks``, the tasks it counts."""
    keep = {k: v for k, v in speedups.items() if k not in degenerate}
    keep_best = {k: v for k, v in vs_best.items() if k not in degenerate}
    out = {**_scores(keep, keep_best, n - len(degenerate)), "headline_tasks": n - len(degenerate)}
    if degenerate:
        left = {k: v for k, v in speedups.items() if k in degenerate}
        left_best = {k: v for k, v in vs_best.items() if k in degenerate}
        out["degenerate"] = {
            "tasks": sorted(degenerate),
            **_scores(left, left_best, len(degenerate)),
        }
        out["headline_note"] = (
            f"fast_p and the geomeans leave out {len(degenerate)} degenerate task(s) (kf's "
            "audit: their outputs do not depend on their inputs), as KernelBench-Verified does"
        )
    return out


def _failures(state: Any, task: str) -> dict[str, int]:
    """How many of a task's candidates failed, by cause (compile_error, mismatch, …)."""
    out: dict[str, int] = {}
    for c in state.candidates.values():
        if c.task == task and c.status == "failed":
            kind = c.failure or "failed"
            out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))


def _audits(envelopes: Iterable[Envelope], trusted: list[str] | None = None) -> dict[str, Any]:
    """Each task's audit (``kernel.task_audited``): the first from a device whose word the
    run takes (``trusted``, its ``confirm_trusted``; None: every device's), so a device
    the run does not trust can neither drop a task from the headline nor keep a degenerate
    one in it (issue 43)."""
    out: dict[str, Any] = {}
    for env in envelopes:
        if env.type == "kernel.task_audited":
            ev = decode_event(env)
            if trusted is None or ev.device_id in trusted:  # type: ignore[attr-defined]
                out.setdefault(ev.task, ev.audit)  # type: ignore[attr-defined]
    return out


def _profiles(envelopes: Iterable[Envelope]) -> dict[str, list[Any]]:
    """Each task's successful profiles, in log order (``kernel.candidate_profiled``), and
    the verifications that compiled its ``torch.compile`` baseline before any profile
    (``kernel.candidate_verified`` with the phase ``compile_baseline_early``)."""
    out: dict[str, list[Any]] = {}
    for env in envelopes:
        if env.type == "kernel.candidate_profiled":
            ev = decode_event(env)
            if ev.report.ok:  # type: ignore[attr-defined]
                out.setdefault(ev.task, []).append(ev)  # type: ignore[attr-defined]
        elif env.type == "kernel.candidate_verified":
            ev = decode_event(env)
            if _EARLY in ev.report.phases:  # type: ignore[attr-defined]
                out.setdefault(ev.task, []).append(ev)  # type: ignore[attr-defined]
    return out


_EARLY = "compile_baseline_early"  # agents.verifier's phase


def best_baselines(envelopes: Iterable[Envelope], task: str, best_id: str | None) -> dict[str, Any]:
    """A task's best kernel against ``torch.compile`` and the better of eager and compile
    (``best_speedup_vs_compiled``, ``best_speedup_vs_best``, ``compiled_ms``, …), from its
    last profile in these envelopes; None throughout for logs from before the baseline."""
    return _baseline_entry(_profiles(envelopes), task, best_id)


def _baseline_entry(
    profiles: dict[str, list[Any]], task: str, best_id: str | None
) -> dict[str, Any]:
    """The best kernel's speed-ups against ``torch.compile`` and against the better of
    eager and compiled (its last profile's), the compiled time, and the task's compile cost.

    Logs from before the compiled baseline give None throughout.
    """
    evs = [ev for ev in profiles.get(task, []) if isinstance(ev, CandidateProfiled)]
    early = [
        ev.report.phases[_EARLY]
        for ev in profiles.get(task, [])
        if isinstance(ev, CandidateVerified) and _EARLY in ev.report.phases
    ]
    mine = [ev.report for ev in evs if ev.candidate_id == best_id]
    last = mine[-1] if mine else None
    compiled = [ev.report for ev in evs if ev.report.compiled_runtime_ms is not None]
    errors = [ev.report.compile_baseline_error for ev in evs if ev.report.compile_baseline_error]
    return {
        "best_speedup_vs_compiled": last.speedup_vs_compiled if last is not None else None,
        "best_speedup_vs_best": last.speedup_vs_best if last is not None else None,
        "compiled_ms": last.compiled_runtime_ms if last is not None else None,
        # the longest compile of the task's reference a profile or the verifier (before
        # the profiles, agents.verifier) paid (0: all reused)
        "compile_baseline_s": max(
            [r.compile_baseline_s for r in compiled] + (early if compiled else []), default=None
        ),
        "compile_baseline_error": errors[-1] if errors and not compiled else None,
        # the baselines' settings, as the best kernel's profile recorded them ("" in old logs)
        "compile_mode": last.compile_mode if last is not None else "",
        "tf32": last.tf32 if last is not None else "",
    }


def _tuning_line(task: str, s: dict[str, Any]) -> str:
    """One line per tuned shape set: what the tuner found and how the candidate fared."""
    where = f"{task} tuned on {s['device_id']}"
    if "shape" not in s:
        return f"{where}: {s.get('note', '')}"
    timed = s.get("best_ms") is not None and s.get("baseline_ms") is not None
    own = timed and s.get("best_config") == s.get("baseline_config")
    if own:
        found = f"nothing faster than its own configuration ({s['baseline_ms']:.4f} ms)"
    elif timed:
        found = f"{s['best_config']} {s['best_ms']:.4f} ms vs own {s['baseline_ms']:.4f} ms"
    else:
        found = "nothing timed"
    tuned = (
        f"; candidate {s['tuned_candidate_id'][:12]} {s['tuned_status']}"
        + (f" {s['tuned_speedup']:.2f}× over eager" if s.get("tuned_speedup") else "")
        if s.get("tuned_candidate_id")
        else ("" if s.get("improved") or own else "; not beyond the noise: no candidate")
    )
    return f"{where} at {s['shape']}: {found}{tuned}"


def _degenerate_lines(report: dict[str, Any]) -> list[str]:
    """The degenerate tasks on their own line, with their scores (:func:`headline`)."""
    d = report.get("degenerate")
    if not d:
        return []
    fp = ", ".join(f"{k} = {v:.2f}" for k, v in d["fast_p"].items())
    gm = d["geomean_speedup"]
    return [
        f"{report.get('headline_note', '')}; over the other {report.get('headline_tasks')} task(s)",
        f"degenerate, left out: {', '.join(d['tasks'])}: {fp}"
        + (f"; geomean {gm:.2f}×" if gm else ""),
    ]


def _table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """The table's header and one row per task."""
    rows: list[tuple[str, ...]] = [
        (
            "task",
            "cands",
            "compiled",
            "correct",
            "eager ms",
            "t.compile ms",
            "best ms",
            "speedup",
            "vs t.compile",
            "vs best",
            "best",
        )
    ]
    for t in report["tasks"]:
        rows.append(
            (
                t["task"],
                str(t["candidates"]),
                str(t["compiled"]),
                str(t["correct"]),
                f"{t['ref_ms']:.3f}" if t["ref_ms"] else "—",
                f"{t['compiled_ms']:.3f}" if t.get("compiled_ms") else "—",
                f"{t['best_ms']:.3f}" if t["best_ms"] else "—",
                (f"{t['best_speedup']:.2f}×" + ("*" if t.get("degenerate") else ""))
                if t["best_speedup"]
                else "—",
                f"{t['best_speedup_vs_compiled']:.2f}×"
                if t.get("best_speedup_vs_compiled")
                else "—",
                f"{t['best_speedup_vs_best']:.2f}×" if t.get("best_speedup_vs_best") else "—",
                (t["best_candidate_id"] or t["skipped"] or "—")[:40],
            )
        )
    return rows


def _task_notes(report: dict[str, Any]) -> list[str]:
    """The lines under the table that say what to know about each task's results."""
    notes: list[str] = []
    for t in report["tasks"]:
        if t.get("degenerate"):
            notes.append(
                f"{t['task']}: DEGENERATE task: its outputs do not depend on its inputs "
                f"({(t.get('audit') or {}).get('reason', '')}); its speed-ups are flagged"
            )
        if t.get("compile_baseline_error"):
            notes.append(f"{t['task']}: no torch.compile baseline: {t['compile_baseline_error']}")
        notes += [f"{t['task']}: best flagged: {f}" for f in t.get("best_flags", [])]
        notes += [
            f"{t['task']}: {s['candidate_id'][:12]} kept out of best (suspect timing): "
            + "; ".join(s["flags"])
            for s in t.get("suspect", [])
        ]
        notes += [
            f"{t['task']}: {g['candidate_id'][:12]} failed the generalisation gate: {g['reason']}"
            for g in t.get("generalisation_failed", [])
        ]
        notes += [_tuning_line(t["task"], s) for s in t.get("tuning", [])]
    return notes


def _lessons_lines(report: dict[str, Any]) -> list[str]:
    """A line on the run's lessons, if it learned or loaded any, and one per lesson it
    quoted: what its controlled comparisons bought."""
    ls = report.get("lessons") or {}
    if not (ls.get("learned") or ls.get("loaded")):
        return []
    lines = [
        f"lessons: {ls['learned']} learned in this run; {ls['loaded']} loaded, "
        f"{len(ls['used'])} quoted in {ls['prompts_with_lessons']} prompt(s); "
        f"{ls.get('controls', 0)} control arm(s), {ls.get('compared', 0)} controlled "
        f"comparison(s), {ls.get('gains', 0)} gained beyond the noise; "
        f"{ls.get('verified', 0)} verified, {ls.get('retired', 0)} retired"
    ]
    for lesson_id, x in (ls.get("per_lesson") or {}).items():
        bought = "" if x["bought"] is None else f", bought {x['bought']:.2f}x over its control"
        lines.append(
            f"  lesson {lesson_id[:12]} {x['status']}: quoted in {x['prompts']} prompt(s), "
            f"{x['gains']}/{x['compared']} comparisons gained{bought}"
        )
    return lines


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table of the report."""
    rows = _table_rows(report)
    notes = _task_notes(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    fp = report["fast_p"]
    gm = report["geomean_speedup"]
    lines.append("")
    lines.append(
        "fast_p: "
        + ", ".join(f"{k} = {v:.2f}" for k, v in fp.items())
        + f"; geomean speedup over correct tasks: {gm:.2f}×"
        if gm
        else "fast_p: " + ", ".join(f"{k} = {v:.2f}" for k, v in fp.items())
    )
    if "fast_p_vs_best" in report:
        fb, gb = report["fast_p_vs_best"], report["geomean_speedup_vs_best"]
        lines.append(
            "against the better of eager and torch.compile: "
            + ", ".join(f"{k} = {v:.2f}" for k, v in fb.items())
            + (f"; geomean {gb:.2f}×" if gb else "")
            + (
                f" ({report['tasks_without_compiled_baseline']} task(s) without a torch.compile "
                "time count against eager)"
                if report.get("tasks_without_compiled_baseline")
                else ""
            )
        )
    lines += _degenerate_lines(report)
    lines += _check_lines(report)
    kb = report.get("kernelbench") or {}
    if any(r["level"] is not None for r in kb.get("rows", [])):
        from kf.app.kernelbench import format_levels

        lines += format_levels(kb)
    a = report["archive"]
    lines.append(config_line(report["config"]))
    lines.append(
        f"archive: {a['filled_cells']} of {a['total_cells']} cells filled; "
        f"mutator: {report['mutator']}"
    )
    lines += [
        f"{t['task']}: failed by cause: " + ", ".join(f"{k} {v}" for k, v in t["failures"].items())
        for t in report["tasks"]
        if t.get("failures")
    ]
    lines += _lessons_lines(report)
    if report.get("unsandboxed_results"):
        lines.append(
            f"UNSANDBOXED: {report['unsandboxed_results']} stage result(s) came from runners "
            "outside kf's box (--unsafe-no-sandbox): candidates could read kf's secrets and "
            "files and forge results"
        )
    settings = sorted(
        {
            (t.get("compile_mode") or "—", t.get("tf32") or "—")
            for t in report["tasks"]
            if t.get("tf32")
        }
    )
    lines += [f"baselines: torch.compile mode {m}, TF32 {tf}" for m, tf in settings]
    lines += notes
    lines += format_run_stats(report.get("run_stats") or {})
    lines += format_mutator_stats(report.get("mutators") or {})
    integrity = report.get("integrity")
    if integrity is not None:
        if integrity["status"] == "broken":
            lines.insert(
                0,
                f"WARNING: {integrity['message']}\n"
                "WARNING: shown because --ignore-integrity was given: these results come "
                "from a log changed outside kf and prove nothing\n",
            )
        else:
            lines.append(integrity["message"])
    return "\n".join(lines)
