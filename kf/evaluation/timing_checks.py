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
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["RATIO", "cache_suspected", "timer_disagreement"]

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
