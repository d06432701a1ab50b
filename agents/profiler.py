"""The profiler: times verified candidates alone on the device and states their speed-ups
by kf's one profiling policy (:mod:`kf.evaluation.grader.policy`, which ``kf eval`` follows too):
re-verification above 10×, the eager-outlier correction against the task's earlier
sessions on this device, and a paired re-timing of a challenger within noise of the
task's best. This agent's part is what the policy needs to know of the run: every
profile's speed and noise, the eager times per task and device, and each task's best
elite. The archive stays a pure fold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from agents.build_pool import consumed
from agents.evaluator import EvaluatorAgent, EvaluatorState
from kf.agent import AgentContext
from kf.evaluation import ProfileReport
from kf.evaluation.grader.policy import Incumbent, relative_noise, stated_profile
from kf.evaluation.grader.pools import runner_pool
from kf.evaluation.grader.profiling import await_baselined_reference
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.kernels.tasks import Task
from kf.search_facts import (
    CandidateProfiled,
    CandidateProposed,
    CandidateVerified,
    EliteAdmitted,
    GeneralisationFailed,
)

__all__ = ["Profiler", "ProfilerState"]


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

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self._task_locks: dict[str, asyncio.Lock] = {}

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
        assert isinstance(state, ProfilerState)
        if not isinstance(ev, CandidateVerified) or (found := self.claim(state, ev)) is None:
            return ()
        task, source = found

        async def profile() -> ProfileReport:
            # before the share: a wait for the task's baselined runner holds up no timing
            await asyncio.to_thread(
                await_baselined_reference, task, device=self.device,
                conditions=state.conditions, pool=runner_pool(self.device),
            )  # fmt: skip
            # loading, checking and re-verifying share the device; each timing has it
            # alone (``timing_gate``). The verifier compiled the task's torch.compile
            # baseline already: on a GPU as the run started, else after the task's first
            # correct candidate (agents.verifier)
            async with self.timing_gate(ev.report.peak_device_mb) as hooks:
                return await asyncio.to_thread(
                    self._profile, state, task, ev.candidate_id, source, hooks.get("alone"),
                    self.runner_key(ev),
                )  # fmt: skip

        # one profile of a task at a time: the next one's incumbent is this one, and it
        # takes the reference runner holding the task's compiled baseline
        async with self._task_lock(task.name):
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
        out.append(self.outcome(CandidateProfiled, ev, report))
        return out

    def _task_lock(self, task: str) -> asyncio.Lock:
        return self._task_locks.setdefault(task, asyncio.Lock())

    def _profile(
        self,
        state: ProfilerState,
        task: Task,
        cid: str,
        source: str,
        alone: Callable[[], AbstractContextManager[object]] | None = None,
        key: str | None = None,
    ) -> ProfileReport:
        index = state.shapes.get(cid, 0)
        shape = f"#{index}" if index else ""
        history = state.eager_ms.get(f"{task.name}@{self.device_id}{shape}", [])
        best = state.best.get(task.name)
        incumbent = None
        # a tuned candidate at another shape set ranks nowhere: no pairing with the elite
        if best is not None and best != cid and not index and best in state.sources:
            speedup, noise = state.timings.get(best, (0.0, 0.0))
            incumbent = Incumbent(best, state.sources[best], speedup, noise)
        return stated_profile(
            task, source, eager_history=history, incumbent=incumbent, device=self.device,
            seed=state.seed, timeout_s=self.timeout_s, tolerance=state.tolerance,
            conditions=state.conditions, pool=runner_pool(self.device), alone=alone,
            candidate_key=key,
        )  # fmt: skip
