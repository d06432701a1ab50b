"""``kf report``: a run's results, folded from its log with the archive's own fold.

KernelBench's ``fast_p``: the fraction of the run's tasks whose best kernel is correct
and more than ``p`` times faster than PyTorch eager (``fast_0`` counts correct tasks).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kf.agent import AgentContext
from kf.events import Envelope, Record, decode_event
from kf.log import EventLog

__all__ = [
    "FAST_P",
    "build_report",
    "build_report_from",
    "fold_archive",
    "fold_envelopes",
    "format_table",
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


def fold_archive(elog: EventLog) -> Any:
    """The archive state after the whole log."""
    return fold_envelopes(elog.read())


def fold_envelopes(envelopes: Iterable[Envelope]) -> Any:
    """The archive state after these committed envelopes (in ``seq`` order)."""
    from agents.archive import ArchiveAgent

    agent = ArchiveAgent(AgentContext(run_id="", agent_id="archive@report"))
    state = agent.initial_state()
    for env in envelopes:
        if agent.listens_to(env.type):
            state = agent.evolve(state, Record(env, decode_event(env)))
    return state


def build_report(db: str | Path) -> dict[str, Any]:
    """The JSON report of ``kf report --json``, from a log file."""
    with EventLog(db, readonly=True) as elog:
        return build_report_from(list(elog.read()))


def build_report_from(envelopes: list[Envelope]) -> dict[str, Any]:
    """The JSON report from committed envelopes (a log file, or a run followed over NATS)."""
    from agents.archive import CELLS_PER_ISLAND, best_candidate, geomean

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
    filled = 0
    for name, t in state.tasks.items():
        best = best_candidate(state, name)
        filled += len(t.elites)
        entry = {
            "task": name,
            "candidates": t.proposed,
            "compiled": t.compiled,
            "correct": t.correct,
            "profiled": t.profiled,
            "failed": t.failed,
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
            "generalisation_failed": [
                {"candidate_id": c.id, "reason": c.generalisation}
                for c in state.candidates.values()
                if c.task == name and c.generalisation is not None
            ],
        }
        tasks.append(entry)
        if best is not None and best.speedup is not None:
            speedups[name] = best.speedup
    n = len(state.tasks)
    total_cells = n * state.config.islands * CELLS_PER_ISLAND
    mutators = sorted({c.mutator for c in state.candidates.values()})
    return {
        "run_id": state.run_id,
        "seed": state.seed,
        "events": events,
        "finished": bool(finished),
        "finish_reason": finished[0].reason if finished else None,  # type: ignore[attr-defined]
        "config": {
            "budget": state.config.budget,
            "islands": state.config.islands,
            "max_in_flight": state.config.max_in_flight,
        },
        "tasks": tasks,
        "archive": {"filled_cells": filled, "total_cells": total_cells},
        "fast_p": {
            f"fast_{p:g}": (sum(1 for s in speedups.values() if s > p) / n if n else 0.0)
            for p in FAST_P
        },
        "geomean_speedup": geomean(list(speedups.values())),
        "mutator": mutators[0] if len(mutators) == 1 else mutators,
        "devices": devices,
        # stage reports whose runners ran outside kf's box (--unsafe-no-sandbox)
        "unsandboxed_results": sum(
            1
            for e in envelopes
            if e.type in _STAGE_EVENTS
            and getattr(getattr(decode_event(e), "report", None), "sandbox", "")
            == "unsafe-no-sandbox"
        ),
    }


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table of the report."""
    rows = [("task", "cands", "compiled", "correct", "eager ms", "best ms", "speedup", "best")]
    for t in report["tasks"]:
        rows.append(
            (
                t["task"],
                str(t["candidates"]),
                str(t["compiled"]),
                str(t["correct"]),
                f"{t['ref_ms']:.3f}" if t["ref_ms"] else "—",
                f"{t['best_ms']:.3f}" if t["best_ms"] else "—",
                f"{t['best_speedup']:.2f}×" if t["best_speedup"] else "—",
                (t["best_candidate_id"] or t["skipped"] or "—")[:40],
            )
        )
    notes: list[str] = []
    for t in report["tasks"]:
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
    a = report["archive"]
    lines.append(
        f"archive: {a['filled_cells']} of {a['total_cells']} cells filled; "
        f"mutator: {report['mutator']}"
    )
    if report.get("unsandboxed_results"):
        lines.append(
            f"UNSANDBOXED: {report['unsandboxed_results']} stage result(s) came from runners "
            "outside kf's box (--unsafe-no-sandbox): candidates could read kf's secrets and "
            "files and forge results"
        )
    lines += notes
    return "\n".join(lines)
