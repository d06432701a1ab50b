"""The counter collector: Nsight Compute's hardware counters for a task's new bests.

A plug-in agent of a GPU worker (the archive and the other agents know nothing of it):
when a candidate profiled on this worker's device beats every earlier candidate of its
task there (and carries no flag that makes its timing suspect), it runs that candidate
once more under ``ncu`` with the device to itself and records a ``CountersMeasured``
observation: DRAM and SM throughput shares, occupancy, registers and bytes moved per
kernel. Only new bests are measured, so the counters describe the kernels that matter
without slowing the search by a profiler run per candidate. Without ``ncu`` (or with
``KF_NCU=0``) it records nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agents.evaluator import EvaluatorAgent, EvaluatorState
from kf.cuda.ncu import find_ncu
from kf.evaluation.grader.counters import counters_session
from kf.evaluation.grader.reports import is_suspect
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.search_facts import CandidateProfiled, CandidateProposed, CountersMeasured

__all__ = ["CounterCollector", "CounterState"]


class CounterState(EvaluatorState, kw_only=True):
    """Each task's best speed-up on this device so far, and the candidates that set one."""

    best: dict[str, float] = {}
    new_bests: set[str] = set()


class CounterCollector(EvaluatorAgent):
    """Runs a task's new best once under ncu and records its counters."""

    kind = "counters"
    listens = (RunStarted, CandidateProposed, CandidateProfiled)
    #: why ncu cannot run on this worker (it failed before any candidate code ran), once
    #: it has: the collector then measures nothing more in this process
    unusable: str | None = None

    def initial_state(self) -> CounterState:
        return CounterState()

    def evolve(self, state: EvaluatorState, rec: Record) -> EvaluatorState:
        state = super().evolve(state, rec)
        assert isinstance(state, CounterState)
        ev = rec.event
        if (
            isinstance(ev, CandidateProfiled)
            and self.mine(ev.device_id)
            and ev.report.ok
            and not is_suspect(ev.report.flags)
            and ev.report.speedup > state.best.get(ev.task, 0.0)
        ):
            state.best[ev.task] = ev.report.speedup
            state.new_bests.add(ev.candidate_id)
        return state

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        ev = rec.event
        assert isinstance(state, CounterState)
        if not isinstance(ev, CandidateProfiled) or ev.candidate_id not in state.new_bests:
            return ()
        if not self.device.startswith("cuda") or find_ncu() is None or self.unusable:
            return ()
        found = self.lookup(state, ev.task, ev.candidate_id)
        if found is None:
            return ()
        task, source = found
        # at the run's recorded tolerance and under its conditions, as every stage grades
        session = self.grading(state, task, source)
        # the runner under ncu starts holding nothing, is loaded and checked sharing the
        # device, and its one measured call has it alone (``timing_gate``), after every
        # timing waiting then: counters decide no verdict, and ncu's turn takes seconds
        gate = self.timing_gate(ev.report.peak_device_mb, shared=False, yielding=True)
        async with gate as hooks:
            # made in the thread: for a GPU, a session imports torch and counts the devices
            report = await asyncio.to_thread(lambda: counters_session(session(**hooks)))
        if report.unusable:
            # every later try would fail the same way, each with the device to itself
            self.unusable = report.error or "ncu could not start a runner"
            self.ctx.log.warning("counters_off", device=self.device, why=self.unusable[:500])
        return [
            CountersMeasured(
                candidate_id=ev.candidate_id, task=ev.task, device_id=self.device_id, report=report
            )
        ]
