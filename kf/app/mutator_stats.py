"""How the mutators of a mixed population compare: per candidate and per unit of cost.

In a run with ``mutator_weights`` (``kf run --mutators``) the prompt evolver records which
mutator answers each selection (``prompt.chosen.agent``: ``""`` the single-shot call,
``tools`` a tool-using episode, ``cli`` the coding-agent command). Folding the log, per
kind: selections answered, candidates proposed, failed mutations, candidates verified
correct, the best speed-up, the model's tokens (every ``llm.called`` of those selections),
the seconds spent (the single-shot calls' latency; an episode's wall time, tools
included), the tool calls made and the episodes cut short; and from those, correct
kernels per candidate, per thousand tokens and per minute.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kf.events import Envelope, decode_event

__all__ = ["format_mutator_stats", "mutator_stats"]

_TYPES = frozenset(
    {
        "prompt.chosen",
        "kernel.candidate_proposed",
        "kernel.mutation_failed",
        "kernel.candidate_profiled",
        "kernel.candidate_verified",
        "llm.called",
        "episode.ended",
    }
)


def _kind(agent: str) -> str:
    return agent or "single"


def mutator_stats(envelopes: Iterable[Envelope]) -> dict[str, dict[str, Any]]:
    """Per mutator kind, the comparison above; empty for a run without ``mutator_weights``
    (where every selection is single-shot and there is nothing to compare)."""
    chosen: dict[tuple[str, int], str] = {}
    cand_kind: dict[str, str] = {}
    mixed = False
    rows: dict[str, dict[str, Any]] = {}

    def row(kind: str) -> dict[str, Any]:
        return rows.setdefault(kind, _empty_row())

    correct: set[str] = set()
    for env in envelopes:
        if env.type not in _TYPES:
            continue
        ev: Any = decode_event(env)
        if env.type == "prompt.chosen":
            kind = _kind(ev.agent)
            mixed = mixed or bool(ev.agent)
            chosen[(ev.task, ev.selection)] = kind
            row(kind)["selections"] += 1
        elif env.type == "kernel.candidate_proposed":
            kind_ = chosen.get((ev.task, ev.selection)) if ev.selection is not None else None
            if kind_ is not None:
                cand_kind[ev.candidate_id] = kind_
                row(kind_)["candidates"] += 1
        elif env.type == "kernel.mutation_failed":
            kind_ = chosen.get((ev.task, ev.selection))
            if kind_ is not None:
                row(kind_)["mutation_failed"] += 1
        elif env.type in ("kernel.candidate_verified", "kernel.candidate_profiled"):
            kind_ = cand_kind.get(ev.candidate_id)
            if kind_ is None:
                continue
            r = row(kind_)
            if env.type == "kernel.candidate_verified" and ev.candidate_id not in correct:
                correct.add(ev.candidate_id)
                r["correct"] += 1
            elif env.type == "kernel.candidate_profiled" and ev.report.ok:
                best = r["best_speedup"]
                r["best_speedup"] = (
                    ev.report.speedup if best is None else max(best, ev.report.speedup)
                )
        elif env.type == "llm.called":
            kind_ = chosen.get((ev.task, ev.selection)) if ev.selection is not None else None
            if kind_ is not None and ev.purpose in ("init", "mutate"):
                r = row(kind_)
                r["tokens"] += ev.prompt_tokens + ev.completion_tokens
                if not ev.episode:
                    r["seconds"] += ev.latency_s
        elif env.type == "episode.ended":
            kind_ = chosen.get((ev.task, ev.selection)) if ev.selection is not None else None
            if kind_ is not None:
                r = row(kind_)
                r["seconds"] += ev.seconds
                r["tool_calls"] += ev.tool_calls
                r["episodes_cut_short"] += int(ev.ended != "answered")
    if not mixed:
        return {}
    for r in rows.values():
        _add_rates(r)
    return dict(sorted(rows.items()))


def _empty_row() -> dict[str, Any]:
    """A mutator kind's counts before any of its events."""
    return {
        "selections": 0,
        "candidates": 0,
        "mutation_failed": 0,
        "correct": 0,
        "best_speedup": None,
        "tokens": 0,
        "seconds": 0.0,
        "tool_calls": 0,
        "episodes_cut_short": 0,
    }


def _add_rates(r: dict[str, Any]) -> None:
    """Round a row's seconds and add its correct candidates per candidate, per 1k tokens
    and per minute (None where the divisor is 0)."""
    r["seconds"] = round(r["seconds"], 3)
    n = r["candidates"]
    r["correct_per_candidate"] = round(r["correct"] / n, 3) if n else None
    r["correct_per_1k_tokens"] = (
        round(1000 * r["correct"] / r["tokens"], 4) if r["tokens"] else None
    )
    r["correct_per_minute"] = round(60 * r["correct"] / r["seconds"], 3) if r["seconds"] else None


def format_mutator_stats(stats: dict[str, dict[str, Any]]) -> list[str]:
    """Lines for ``kf report``'s table."""
    if not stats:
        return []
    lines = ["mutators (per selection's recorded choice):"]
    for kind, r in stats.items():
        best = f"{r['best_speedup']:.2f}×" if r["best_speedup"] else "—"
        per_tok = r["correct_per_1k_tokens"]
        per_min = r["correct_per_minute"]
        lines.append(
            f"  {kind:<6} {r['selections']} selections, {r['candidates']} candidates, "
            f"{r['correct']} correct, best {best}; {r['tokens']} tokens, {r['seconds']:.1f} s, "
            f"{r['tool_calls']} tool calls, {r['episodes_cut_short']} cut short; correct per "
            f"1k tokens {per_tok if per_tok is not None else '—'}, per minute "
            f"{per_min if per_min is not None else '—'}"
        )
    return lines
