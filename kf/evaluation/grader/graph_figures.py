"""A µs kernel's second figure: N calls in one CUDA graph (issue 47), and which of the
two figures the profile states as its headline.

On a GPU, a candidate whose median call took under :data:`GRAPH_BELOW_MS` is timed
again, after the alternating rounds, as :func:`graph_calls` calls captured in one CUDA
graph and replayed (:mod:`kf.evaluation.runner.graph_timing`): the calls run back to back
with no idle gap in which the clocks could drop and no launch between them. PyTorch
eager and the compiled reference are timed the same way, in turn with the candidate.

**The headline** (:func:`with_hold`): the graph's figures when the candidate, eager and
(where it was timed) the compiled reference all have one; then ``runtime_ms``, the
reference's figures and every speed-up are the graph's, ``method`` is ``graph-N``, and
the per-call figures are kept beside (``events_*``). Otherwise the per-call figures
(``method`` ``events``) with the graph's beside and why one side has none
(``graph_error``). Both sides of a speed-up are always timed by the same method.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import msgspec

from kf.evaluation.grader.measuring import turn
from kf.evaluation.grader.sandbox import RunnerFailed
from kf.evaluation.grader.timing_checks import timing_stats
from kf.evaluation.wire.protocol import Time, Timed
from kf.kernels.launches import legacy_stream_launch
from kf.reports import ProfileReport

__all__ = ["GRAPH_BELOW_MS", "GraphFigures", "graph_calls", "graph_timing", "with_hold"]

#: a candidate whose median call is under this (ms) is timed in a graph too
GRAPH_BELOW_MS = 0.1
#: about this long (ms) a replay of the graph's N calls
REPLAY_MS = 1.0
#: rounds of (candidate, eager, compiled), each side replaying its graph REPLAYS times
ROUNDS, REPLAYS = 3, 5
SIDES = ("candidate", "eager", "compiled")
#: a graph's flag: the candidate's call captured in a graph is not its call outside one
GRAPH_MISMATCH = "graph_mismatch"
#: a kernel launched on the legacy default stream (``<<<grid, block>>>``, no stream, as
#: KernelBench's own examples launch) is not in a graph captured on torch's stream
LEGACY_STREAM_NOTE = (
    "the source launches a kernel on the legacy default stream (<<<grid, block>>> with no "
    "stream), which a CUDA graph on torch's stream does not capture: timed call by call"
)


def graph_calls(median_ms: float) -> int:
    """N for a call of about ``median_ms``: a replay of about :data:`REPLAY_MS`, 10 to
    1000 calls."""
    return max(10, min(1000, math.ceil(REPLAY_MS / max(median_ms, 1e-4))))


class GraphFigures(NamedTuple):
    """Each side's per-call ms of each replay (empty: none, ``errors`` says why)."""

    calls: int
    samples: dict[str, list[float]]
    errors: dict[str, str]
    state_found: str


def graph_timing(timed: Any, median_ms: float) -> GraphFigures | None:
    """The graph's figures of ``timed``'s sides (profiling's ``_Timed``), or None: not a
    GPU, or a candidate slower than :data:`GRAPH_BELOW_MS`."""
    if not timed.stage.device.startswith("cuda") or median_ms >= GRAPH_BELOW_MS:
        return None
    calls = graph_calls(median_ms)
    samples: dict[str, list[float]] = {s: [] for s in SIDES}
    errors: dict[str, str] = {}
    found = ""
    sides = SIDES if timed.compiled_on else SIDES[:2]
    for _ in range(ROUNDS):
        for side in sides:
            if side in errors:
                continue
            reply = _request(timed, side, Time(n=REPLAYS, graph=calls, compiled=side == SIDES[2]))
            found = (reply.state_found if side == "candidate" else "") or found
            if reply.graph_error or not reply.samples_ns:
                errors[side] = reply.graph_error or "no sample"
                samples[side] = []
            else:
                samples[side] += [ns / 1e6 for ns in reply.samples_ns]
    return GraphFigures(calls, samples, errors, found)


def _request(timed: Any, side: str, msg: Time) -> Timed:
    """One graph timing request to ``side``'s runner, in its turn, the clocks read
    around it; the candidate's box quiet while a reference is timed."""
    stage = timed.stage
    what = f"timing {msg.graph} calls in a graph"
    if side == "candidate":
        return timed.clocks.timed(lambda: stage.candidate(msg, what=what))  # type: ignore[no-any-return]

    def call(message: Any, what: str | None = None) -> Any:
        return timed.ref.request(message, stage.deadline.left(), what=what)

    try:
        with stage.candidate_quiet(), turn(call, timed.turns, compiled=side == "compiled"):
            return timed.clocks.timed(lambda: call(msg, what))  # type: ignore[no-any-return]
    except RunnerFailed as exc:  # the reference's graph: no figure, not a task error
        return Timed(samples_ns=[], method=f"graph-{msg.graph}", graph_error=str(exc))


def with_hold(
    report: ProfileReport,
    graph: GraphFigures | None,
    clocks: Any,
    state_found: str,
    source: str = "",
) -> ProfileReport:
    """``report`` with what issue 47 records: the clocks around its timings
    (``clocks``: a :class:`~kf.evaluation.grader.clock_watch.ClockWatch`), the device
    state a call had left, and the graph's figures, the headline chosen as the module
    says. A graph whose output differs is flagged, except where ``source`` (the
    candidate's) launches on the legacy default stream, which a graph does not capture:
    then the reason says so, unflagged (the per-call figure is the headline either way,
    so a candidate gains nothing from a graph that holds less)."""
    flags = list(report.flags)
    if clocks.kept_dropped:
        flags.append(f"clocks_dropped: {clocks.kept_dropped[-1]} (timed again up to 2 times)")
    if state_found:
        flags.append(f"device_state_left: {state_found} (reset before each timed call)")
    if graph is not None and graph.errors.get("candidate", "").startswith("the graph's output"):
        if legacy_stream_launch(source):
            errors = {
                **graph.errors,
                "candidate": f"{LEGACY_STREAM_NOTE} ({graph.errors['candidate']})",
            }
            graph = graph._replace(errors=errors)
        else:
            flags.append(f"{GRAPH_MISMATCH}: {graph.errors['candidate']}")
    report = msgspec.structs.replace(
        report, clocks=clocks.summary(), device_state_found=state_found, flags=tuple(flags)
    )
    return report if graph is None else _graph_headline(report, graph)


def _graph_headline(report: ProfileReport, graph: GraphFigures) -> ProfileReport:
    s = graph.samples
    stats = {side: timing_stats(v) for side, v in s.items() if v}
    c, r, k = stats.get("candidate"), stats.get("eager"), stats.get("compiled")
    beside: dict[str, Any] = {
        "graph_calls": graph.calls,
        "graph_error": "; ".join(f"{side}: {why}" for side, why in graph.errors.items()),
        "graph_runtime_ms": c["mean"] if c else None,
        "graph_ref_runtime_ms": r["mean"] if r else None,
        "graph_compiled_runtime_ms": k["mean"] if k else None,
        "events_runtime_ms": report.runtime_ms,
        "events_ref_runtime_ms": report.ref_runtime_ms,
        "events_speedup": report.speedup,
    }
    compiled_needed = report.compiled_runtime_ms is not None
    if c is None or r is None or (compiled_needed and k is None) or c["mean"] <= 0:
        return msgspec.structs.replace(report, **beside)
    best = min(r["mean"], k["mean"]) if k is not None else None
    return msgspec.structs.replace(
        report,
        **beside,
        method=f"graph-{graph.calls}",
        runtime_ms=c["mean"], runtime_std_ms=c["std"], runtime_median_ms=c["median"],
        runtime_min_ms=c["min"], runtime_ci95_ms=c["ci95"], trials=len(s["candidate"]),
        ref_runtime_ms=r["mean"], ref_runtime_std_ms=r["std"],
        ref_runtime_median_ms=r["median"], ref_runtime_ci95_ms=r["ci95"],
        ref_trials=len(s["eager"]),
        speedup=r["mean"] / c["mean"],
        compiled_runtime_ms=k["mean"] if k else None,
        compiled_runtime_std_ms=k["std"] if k else 0.0,
        compiled_runtime_median_ms=k["median"] if k else 0.0,
        compiled_runtime_ci95_ms=k["ci95"] if k else 0.0,
        compiled_trials=len(s["compiled"]) if k else 0,
        speedup_vs_compiled=k["mean"] / c["mean"] if k else None,
        speedup_vs_best=best / c["mean"] if best is not None else None,
    )  # fmt: skip
