"""The two timing cross-checks, as pure functions of what was measured.

``timer_disagreement``: the grader's wall clock around each timing request of the
candidate, against the samples the candidate's runner reported for it. Every sample
costs more wall time than the kernel: a launch, device-wide synchronisation, the L2
flush before it (on an H200 about 90 µs a call, all told, for a 5 µs kernel). So the
*empty call*'s cost, the same timing loop around a call that does nothing, measured in
the candidate-free reference runner, is subtracted first; and the comparison is made
per request (a batch of calls) and decided by the median batch, so one batch slowed by
the machine does not flag a kernel. A side-stream cheat (0.12 ms claimed, 0.94 ms seen
by the wall clock on an H200) still shows: its work is in the wall clock and not in the
samples.

``cache_suspected``: one call on each of a few fresh input sets against one call on the
repeated inputs made the same way right after it (paired), both less the empty call's
in-process time; a cache keyed on the inputs is fast only on the repeated ones.

**Under host load** (several evaluations and builds at once) the grader's wall clock
stretches while the candidate's samples do not, and an honest 17 µs kernel was flagged
on the H200 with six ``kf eval`` at once. Host scheduling only ever *adds* wall time, so
a disagreement is re-measured before it is flagged (:func:`confirmed`): the batch of
back-to-back calls is timed again and the least disagreeing measurement decides (the
minimum of repeats), and the per-request check is measured again in pairs, each
candidate request right after an empty-call request of the same size in the reference
runner, so that each pair's two sides see the same load (:func:`paired_disagreement`).
A cheat's hidden work (a side stream's, forged samples) is in every measurement, so it
stays flagged; a machine's load is not.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

__all__ = [
    "RATIO",
    "cache_suspected",
    "confirmed",
    "cross_check_flags",
    "paired_disagreement",
    "timer_disagreement",
    "timing_stats",
]

_TIMER = "timer_disagreement"
#: how many times a disagreement is measured again before it is flagged
REMEASURE = 3

RATIO = 5.0  # loose on purpose: a loaded machine stretches the gaps between samples too
WALL_SLACK_MS = 0.05  # host-side work of one honest call the samples need not include
CACHE_SLACK_MS = 0.02


def timer_disagreement(
    batches: Sequence[tuple[int, float, float]],
    empty_ms: float,
    *,
    ratio: float = RATIO,
    slack_ms: float = WALL_SLACK_MS,
) -> str | None:
    """Why the candidate's samples cannot be what the wall clock saw, or None.

    ``batches``: per timing request, (calls, wall ms less the request's round trip, sum of
    the samples in ms); ``empty_ms``: the wall ms of one empty call in the same loop.
    """
    rows = [(n, wall, sampled) for n, wall, sampled in batches if n > 0]
    if not rows:
        return None
    excess = [max(0.0, wall / n - empty_ms) for n, wall, _ in rows]
    sampled = [s / n for n, _, s in rows]
    over = [e - (ratio * s + slack_ms) for e, s in zip(excess, sampled, strict=True)]
    if statistics.median(over) <= 0:
        return None
    return (
        f"timing samples add up to {statistics.median(sampled):.4f} ms a call but the grader's "
        f"wall clock saw {statistics.median(excess):.4f} ms a call beyond an empty call's "
        f"{empty_ms:.4f} ms (median of {len(rows)} batches; {sum(o > 0 for o in over)} disagree)"
    )


def paired_disagreement(
    pairs: Sequence[tuple[int, float, float, float]],
    *,
    ratio: float = RATIO,
    slack_ms: float = WALL_SLACK_MS,
) -> str | None:
    """:func:`timer_disagreement` of re-measured requests, each with the empty call's
    wall ms measured right before it: ``pairs`` of (calls, wall ms, sum of the samples in
    ms, the empty call's wall ms a call then). The median pair decides."""
    rows = [(n, wall, sampled, empty) for n, wall, sampled, empty in pairs if n > 0]
    if not rows:
        return None
    excess = [max(0.0, wall / n - empty) for n, wall, _, empty in rows]
    sampled = [s / n for n, _, s, _ in rows]
    over = [e - (ratio * s + slack_ms) for e, s in zip(excess, sampled, strict=True)]
    if statistics.median(over) <= 0:
        return None
    empties = statistics.median(r[3] for r in rows)
    return (
        f"measured again in {len(rows)} pairs, each right after an empty call "
        f"({empties:.4f} ms): samples {statistics.median(sampled):.4f} ms a call, wall "
        f"clock {statistics.median(excess):.4f} ms beyond the empty call"
    )


def confirmed(
    first: str | None, again: Callable[[], str | None], times: int = REMEASURE
) -> str | None:
    """The batch cross-check's finding ``first`` (or None) confirmed by the minimum of
    repeats: None as soon as one of up to ``times`` more measurements (``again``) agrees,
    the last finding otherwise. Host load only adds wall time, so one measurement that
    agrees shows the disagreement was the machine's; a tampered clock disagrees every
    time. (The samples' own check, :func:`paired_disagreement`, is decided by the median
    of its re-measurements instead: a candidate cannot clear it by one honest request.)"""
    found = first
    for _ in range(times if first is not None else 0):
        found = again()
        if found is None:
            return None
    return found


def cache_suspected(
    fresh_ms: Sequence[float],
    repeated_ms: Sequence[float],
    empty_ms: float = 0.0,
    *,
    ratio: float = RATIO,
    slack_ms: float = CACHE_SLACK_MS,
) -> str | None:
    """Why the candidate looks like it caches results, or None.

    ``fresh_ms``: one call on each fresh input set; ``repeated_ms``: the paired calls on
    repeated inputs; ``empty_ms``: an empty call's in-process time.
    """
    if not fresh_ms or not repeated_ms:
        return None
    fresh, repeated = statistics.median(fresh_ms), statistics.median(repeated_ms)
    if fresh - empty_ms > ratio * max(0.0, repeated - empty_ms) and fresh - repeated > slack_ms:
        return (
            f"{repeated:.4f} ms a call on repeated inputs but {fresh:.4f} ms on fresh ones "
            f"(paired, {len(fresh_ms)} fresh input sets; an empty call takes {empty_ms:.4f} ms)"
        )
    return None


def timing_stats(samples_ms: list[float]) -> dict[str, float]:
    """Mean, sample std, median, min and the 95% confidence half width of the mean."""
    n = len(samples_ms)
    mean = statistics.fmean(samples_ms)
    std = statistics.stdev(samples_ms) if n > 1 else 0.0
    # Student t for small samples, 1.96 beyond 30.
    t_table = {
        2: 12.71,
        3: 4.30,
        4: 3.18,
        5: 2.78,
        6: 2.57,
        8: 2.36,
        10: 2.26,
        15: 2.14,
        20: 2.09,
        30: 2.04,
    }
    t = next((v for k, v in sorted(t_table.items()) if n <= k), 1.96)
    return {
        "mean": mean,
        "std": std,
        "median": statistics.median(samples_ms),
        "min": min(samples_ms),
        "ci95": t * std / math.sqrt(n) if n > 1 else 0.0,
    }


def cross_check_flags(
    in_process_ms: float, outside_ms: float, *, ratio: float = 1.5, min_gap_ms: float = 0.02
) -> tuple[str, ...]:
    """Flag a disagreement over ``ratio``× (and over ``min_gap_ms``) between the two timers."""
    if in_process_ms <= 0 or outside_ms <= 0:
        return (_TIMER,) if abs(in_process_ms - outside_ms) > min_gap_ms else ()
    r = outside_ms / in_process_ms
    if (r > ratio or r < 1 / ratio) and abs(outside_ms - in_process_ms) > min_gap_ms:
        return (_TIMER,)
    return ()
