"""The profiler: times verified candidates against PyTorch eager (and the reference under
``torch.compile``, see :func:`kf.evaluation.profile_candidate`), alone on the device.

Two guards against speed-ups that are not real: a speed-up above 10× is re-verified
(fresh seeds and unseen shapes) before it is reported, and a challenger whose speed-up
beats the task's best by less than the two timings' noise is re-timed paired with
that incumbent (alternating, same session) before the archive sees it; when the pairing
says it is slower than its measurement did, its speed-up is lowered accordingly (never
raised above what was measured against eager), so the archive's plain comparison decides
on the paired measurement. The archive stays a pure fold.

A third guard catches a session whose eager timing was itself an outlier (on a host busy
with builds, PyTorch's several kernel launches can be slowed where a candidate's one is
not): when this session's eager time lies well above the median of the task's earlier
sessions on the same device, the speed-up is stated against that median instead, with a
flag saying so. It only ever lowers a speed-up.

``speedup`` (against eager) is what the archive ranks on. The figures against
``torch.compile`` and against the better baseline follow both corrections: a paired
re-timing scales them by the same factor, and an eager outlier lowers the better
baseline's figure where eager was the better one.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Sequence

import msgspec

from agents.build_pool import consumed
from agents.evaluator import EvaluatorAgent, EvaluatorState, gate_for
from kf.devices import runner_pool
from kf.evaluation import ProfileReport, profile_candidate
from kf.evaluation.stages import reverify_fast
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.search_facts import (
    CandidateProfiled,
    CandidateProposed,
    CandidateVerified,
    EliteAdmitted,
    GeneralisationFailed,
)
from kf.tasks import Task

__all__ = ["Profiler", "ProfilerState", "relative_noise", "within_noise"]

RETIME_ROUNDS = 2
# An eager time is an outlier when it lies above the median of at least EAGER_HISTORY
# earlier sessions by more than EAGER_OUTLIER (relative) and by more than three robust
# standard deviations of those sessions (1.4826 × their median absolute deviation).
EAGER_HISTORY = 3
EAGER_OUTLIER = 0.10


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


class ProfilerState(EvaluatorState, kw_only=True):
    """The evaluator's state plus each task's best elite, every profile's speed and noise,
    and the eager times measured so far per task and device."""

    best: dict[str, str] = {}  # task → candidate id of its fastest elite
    timings: dict[str, tuple[float, float]] = {}  # candidate id → (speed-up, relative noise)
    eager_ms: dict[str, list[float]] = {}  # "task@device id" → eager ms of each session


class Profiler(EvaluatorAgent):
    """Warm-up, many trials, mean / spread / CI, eager timed in the same session."""

    kind = "profiler"
    listens = (RunStarted, CandidateProposed, CandidateVerified, CandidateProfiled, EliteAdmitted)

    def initial_state(self) -> ProfilerState:
        return ProfilerState()

    def evolve(self, state: EvaluatorState, rec: Record) -> EvaluatorState:
        state = super().evolve(state, rec)
        assert isinstance(state, ProfilerState)
        ev = rec.event
        if isinstance(ev, CandidateProfiled) and ev.report.ok:
            state.timings[ev.candidate_id] = (ev.report.speedup, relative_noise(ev.report))
            if ev.report.ref_runtime_ms > 0:
                index = state.shapes.get(ev.candidate_id, 0)
                key = f"{ev.task}@{ev.device_id}" + (f"#{index}" if index else "")
                state.eager_ms.setdefault(key, []).append(ev.report.ref_runtime_ms)
        elif isinstance(ev, EliteAdmitted):
            current = state.timings.get(state.best.get(ev.task, ""), (0.0, 0.0))[0]
            if ev.speedup > current:
                state.best[ev.task] = ev.candidate_id
        return state

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        ev = rec.event
        if not isinstance(ev, CandidateVerified) or not self.mine(ev.device_id):
            return ()
        assert isinstance(state, ProfilerState)
        found = self.lookup(state, ev.task, ev.candidate_id)
        if found is None or self.device_down():
            return ()
        task, source = found

        async def profile() -> ProfileReport:
            async with await gate_for(self.device).exclusive():
                return await asyncio.to_thread(self._profile, state, task, ev.candidate_id, source)

        report = await self.stage(profile)
        if isinstance(report, list):  # the device failed: its candidates go elsewhere
            return report
        consumed(ev.candidate_id)
        out: list[Event] = []
        if report.failure_kind == "reverify_failed":
            out.append(
                GeneralisationFailed(
                    candidate_id=ev.candidate_id,
                    task=ev.task,
                    device_id=self.device_id,
                    reason=report.error or "failed re-verification",
                    stage="reverify",
                )
            )
        out.append(
            CandidateProfiled(
                candidate_id=ev.candidate_id,
                task=ev.task,
                device_id=self.device_id,
                report=report,
                attempt=ev.attempt,
            )
        )
        return out

    def _profile(self, state: ProfilerState, task: Task, cid: str, source: str) -> ProfileReport:
        kw = {
            "device": self.device,
            "seed": state.seed,
            "timeout_s": self.timeout_s,
            "tolerance": state.tolerance,
            "pool": runner_pool(self.device),
        }
        report = profile_candidate(task, source, **kw)  # type: ignore[arg-type]
        report = reverify_fast(task, source, report, **kw)  # type: ignore[arg-type]
        index = state.shapes.get(cid, 0)
        report = self._against_usual_eager(state, task.name, report, index)
        incumbent = state.best.get(task.name)
        # a tuned candidate at another shape set ranks nowhere: no pairing with the elite
        if not report.ok or incumbent is None or incumbent == cid or index:
            return report
        inc_speedup, inc_noise = state.timings.get(incumbent, (0.0, 0.0))
        inc_source = state.sources.get(incumbent)
        if inc_source is None or not within_noise(
            report.speedup, relative_noise(report), inc_speedup, inc_noise
        ):
            return report
        return self._retime(task, report, source, incumbent, inc_source, inc_speedup, kw)

    def _against_usual_eager(
        self, state: ProfilerState, task: str, report: ProfileReport, index: int = 0
    ) -> ProfileReport:
        """State the speed-up against the usual eager time if this session's was an outlier
        (the usual one at the same shape set)."""
        if not report.ok or report.runtime_ms <= 0:
            return report
        shape = f"#{index}" if index else ""
        history = state.eager_ms.get(f"{task}@{self.device_id}{shape}", [])
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
        self,
        task: Task,
        report: ProfileReport,
        source: str,
        incumbent: str,
        inc_source: str,
        inc_speedup: float,
        kw: dict[str, object],
    ) -> ProfileReport:
        """Alternate incumbent and challenger; restate the speed-up against the incumbent."""
        mine: list[float] = []
        theirs: list[float] = []
        for _ in range(RETIME_ROUNDS):
            inc = profile_candidate(task, inc_source, **kw)  # type: ignore[arg-type]
            again = profile_candidate(task, source, **kw)  # type: ignore[arg-type]
            if not (inc.ok and again.ok):
                return report
            theirs.append(inc.runtime_ms)
            mine.append(again.runtime_ms)
        t_c, t_i = statistics.fmean(mine), statistics.fmean(theirs)
        # The paired timing decides the ranking, never the size of a speed-up: it may lower
        # the challenger's figure (to below the incumbent's when it lost the pairing), but
        # the figure reported is never higher than what was measured against eager.
        paired = inc_speedup * t_i / t_c if t_c > 0 else report.speedup
        speedup = min(report.speedup, paired)
        note = (
            f"retimed: within noise of incumbent {incumbent[:12]} ({report.speedup:.3f}× vs "
            f"{inc_speedup:.3f}×); paired over {RETIME_ROUNDS} rounds: {t_c:.4f} ms vs "
            f"{t_i:.4f} ms, so {paired:.3f}× by the pairing; reported {speedup:.3f}×"
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
