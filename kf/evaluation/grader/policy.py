"""The profiling policy: how a measured profile becomes the speed-up kf states.

One policy for ``kf eval`` and for the profiler agent of ``kf run`` alike
(:func:`stated_profile`). After the profile itself (:func:`kf.evaluation.profile_candidate`:
the candidate against PyTorch eager, and the reference under ``torch.compile``), three
guards against speed-ups that are not real, each of which can only lower a figure:

1. **Re-verification.** A speed-up above 10× is re-verified on fresh seeds and unseen
   shapes before it is stated (:func:`kf.evaluation.grader.verifying.reverify_fast`).
2. **An eager outlier.** When this session's eager time lies well above the median of the
   task's earlier sessions on the same device (on a host busy with builds, PyTorch's
   several kernel launches can be slowed where a candidate's one is not), the speed-up is
   stated against that median, with a flag saying so. Only a caller that has seen earlier
   sessions can apply it: a search does; a lone ``kf eval`` has none, so for it this guard
   never fires.
3. **A challenger within noise.** A candidate whose speed-up beats the incumbent's (the
   task's best so far) by less than the two timings' noise is re-timed paired with it
   (both in fresh runners of one session, timed in alternating rounds:
   :mod:`kf.evaluation.grader.pairing`); when the pairing says it is slower than its measurement
   did, its speed-up is lowered accordingly, never raised above what was measured against
   eager. ``kf eval`` has no incumbent.

``speedup`` (against eager) is what the archive ranks on. The figures against
``torch.compile`` and against the better baseline follow both corrections: a paired
re-timing scales them by the same factor, and an eager outlier lowers the better
baseline's figure where eager was the better one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from kf.evaluation.grader.pairing import paired_times
from kf.evaluation.grader.profiling import profile_candidate
from kf.evaluation.grader.verifying import reverify_fast
from kf.kernels.tasks import Task
from kf.reports import ProfileReport

__all__ = [
    "EAGER_HISTORY",
    "EAGER_OUTLIER",
    "Incumbent",
    "against_usual_eager",
    "eager_median_if_outlier",
    "relative_noise",
    "stated_profile",
    "within_noise",
]

# An eager time is an outlier when it lies above the median of at least EAGER_HISTORY
# earlier sessions by more than EAGER_OUTLIER (relative) and by more than three robust
# standard deviations of those sessions (1.4826 × their median absolute deviation).
EAGER_HISTORY = 3
EAGER_OUTLIER = 0.10

#: what :func:`kf.evaluation.grader.verifying.reverify_fast` takes of the profile's arguments
_REVERIFY_ARGS = ("device", "seed", "timeout_s", "pool", "tolerance", "conditions")


class Incumbent(NamedTuple):
    """The task's best so far, as the caller knows it: its source and its stated figure."""

    candidate_id: str
    source: str
    speedup: float
    noise: float


def relative_noise(report: ProfileReport) -> float:
    """The relative 95% half-width of a speed-up (candidate and eager CIs combined)."""
    cand = report.runtime_ci95_ms / report.runtime_ms if report.runtime_ms > 0 else 0.0
    ref = report.ref_runtime_ci95_ms / report.ref_runtime_ms if report.ref_runtime_ms > 0 else 0.0
    return math.hypot(cand, ref)


def within_noise(challenger: float, c_noise: float, incumbent: float, i_noise: float) -> bool:
    """Whether ``challenger`` beats ``incumbent`` by less than their combined noise."""
    if incumbent <= 0 or challenger <= incumbent:
        return False
    return (challenger - incumbent) / incumbent <= math.hypot(c_noise, i_noise)


def eager_median_if_outlier(history: Sequence[float], eager_ms: float) -> float | None:
    """The median of ``history`` (earlier sessions' eager times of one task on one device)
    when ``eager_ms`` lies well above it (see :data:`EAGER_OUTLIER`); otherwise None.

    Only a slow outlier matters: it inflates a speed-up. A fast one deflates it, which
    errs on the safe side.
    """
    if len(history) < EAGER_HISTORY or eager_ms <= 0:
        return None
    median = statistics.median(history)
    spread = 1.4826 * statistics.median(abs(x - median) for x in history)
    if eager_ms > median * (1 + EAGER_OUTLIER) and eager_ms > median + 3 * spread:
        return median
    return None


def stated_profile(
    task: Task,
    source: str,
    *,
    eager_history: Sequence[float] = (),
    incumbent: Incumbent | None = None,
    **kw: Any,
) -> ProfileReport:
    """Profile ``source`` and state its speed-up by the policy above. ``kw`` are
    :func:`kf.evaluation.profile_candidate`'s arguments; ``eager_history`` the eager times
    of the task's earlier sessions on this device; ``incumbent`` the task's best so far
    (None: nothing to pair with)."""
    report = profile_candidate(task, source, **kw)
    kw.pop("candidate_key", None)  # the re-verification and the pairing start fresh runners
    report = reverify_fast(task, source, report, **{k: kw[k] for k in _REVERIFY_ARGS if k in kw})
    report = against_usual_eager(report, eager_history)
    if not report.ok or incumbent is None:
        return report
    if not within_noise(report.speedup, relative_noise(report), incumbent.speedup, incumbent.noise):
        return report
    return _retime(task, report, source, incumbent, kw)


def against_usual_eager(report: ProfileReport, history: Sequence[float]) -> ProfileReport:
    """The speed-up stated against the usual eager time if this session's was an outlier."""
    if not report.ok or report.runtime_ms <= 0:
        return report
    usual = eager_median_if_outlier(history, report.ref_runtime_ms)
    if usual is None:
        return report
    speedup = min(report.speedup, usual / report.runtime_ms)
    note = (
        f"eager_outlier: this session's eager {report.ref_runtime_ms:.4f} ms is above the "
        f"median {usual:.4f} ms of {len(history)} earlier sessions on this device; "
        f"speed-up stated against the median: {speedup:.3f}× "
        f"(against this session's eager: {report.speedup:.3f}×)"
    )
    best = report.speedup_vs_best
    return msgspec.structs.replace(
        report,
        speedup=speedup,
        speedup_vs_best=None if best is None else min(best, speedup),
        flags=(*report.flags, note),
    )


def _retime(
    task: Task, report: ProfileReport, source: str, incumbent: Incumbent, kw: dict[str, Any]
) -> ProfileReport:
    """Alternate incumbent and challenger; restate the speed-up against the incumbent."""
    times = paired_times(task, source, incumbent.source, **kw)
    if times is None or not times[0] or not times[1]:
        return report
    mine, theirs = times
    t_c, t_i = statistics.fmean(mine), statistics.fmean(theirs)
    # The paired timing decides the ranking, never the size of a speed-up: it may lower
    # the challenger's figure (to below the incumbent's when it lost the pairing), but
    # the figure reported is never higher than what was measured against eager.
    paired = incumbent.speedup * t_i / t_c if t_c > 0 else report.speedup
    speedup = min(report.speedup, paired)
    note = (
        f"retimed: within noise of incumbent {incumbent.candidate_id[:12]} "
        f"({report.speedup:.3f}× vs {incumbent.speedup:.3f}×); timed side by side "
        f"({len(mine)} and {len(theirs)} calls): {t_c:.4f} ms vs {t_i:.4f} ms, "
        f"so {paired:.3f}× by the pairing; reported {speedup:.3f}×"
    )
    # the pairing corrects the challenger's own time: every baseline's figure moves alike
    factor = speedup / report.speedup if report.speedup > 0 else 1.0
    vs_compiled, vs_best = report.speedup_vs_compiled, report.speedup_vs_best
    return msgspec.structs.replace(
        report,
        speedup=speedup,
        speedup_vs_compiled=None if vs_compiled is None else vs_compiled * factor,
        speedup_vs_best=None if vs_best is None else vs_best * factor,
        flags=(*report.flags, note),
    )
