"""The counter collector: Nsight Compute's hardware counters for a task's new bests.

A plug-in agent of a GPU worker (the archive and the other agents know nothing of it):
when a candidate profiled on this worker's device beats every earlier candidate of its
task there (and carries no flag that makes its timing suspect), it runs that candidate
once more under ``ncu`` with the device to itself and records a ``CountersMeasured``
observation: DRAM and SM throughput shares, occupancy, registers and bytes moved per
kernel. Only new bests are measured, so the counters describe the kernels that matter
without slowing the search by a profiler run per candidate. Without ``ncu`` (or with
``KF_NCU=0``) it records nothing.

Counters decide no verdict, and ncu's turn with the device took 1-12 s on the H200 while
every timing waited, so the collector keeps to a share of the device's time
(``$KF_COUNTERS_SHARE``, 0.1): a new best waits until the collector's turns so far are
within that share of the time since it started, one measurement at a time, and a new best
that a newer best of its task overtook while it waited is not measured (the log says
``counters_skipped``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

from agents.evaluator import EvaluatorAgent, EvaluatorState
from kf.agent import AgentContext
from kf.cuda.ncu import find_ncu
from kf.evaluation.grader.counters import counters_session
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.kernels.tasks import Task
from kf.reports import CountersReport, is_suspect
from kf.search_facts import CandidateProfiled, CandidateProposed, CountersMeasured
from kf.settings import current

__all__ = ["CounterCollector", "CounterState", "TurnBudget"]


class TurnBudget:
    """The share of a device's time a collector's turns may take: :meth:`wait_s` says how
    long until the turns held so far (:meth:`counting`) are within ``share`` of the time
    since the budget was made."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.clock = clock
        self.since = clock()
        self.held_s = 0.0

    def wait_s(self) -> float:
        """Seconds to wait before the next turn (0: within the share now)."""
        return max(0.0, self.held_s / self.share - (self.clock() - self.since))

    def counting(
        self, alone: Callable[[], AbstractContextManager[object]]
    ) -> Callable[[], AbstractContextManager[object]]:
        """``alone`` (a session's turn), with the seconds each turn is held counted."""

        @contextlib.contextmanager
        def counted() -> Iterator[None]:
            with alone():
                start = self.clock()
                try:
                    yield
                finally:
                    self.held_s += self.clock() - start

        return counted


class CounterState(EvaluatorState, kw_only=True):
    """Each task's best speed-up on this device so far, and the candidates that set one."""

    best: dict[str, float] = {}
    new_bests: set[str] = set()


class CounterCollector(EvaluatorAgent):
    """Runs a task's new best once under ncu and records its counters."""

    kind = "counters"
    listens = (RunStarted, CandidateProposed, CandidateProfiled)
    #: new bests waiting for their measurement at once (one is measured at a time)
    concurrency = 64
    #: why ncu cannot run on this worker (it failed before any candidate code ran), once
    #: it has: the collector then measures nothing more in this process
    unusable: str | None = None

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        #: each task's newest best to reach this collector's reactions (candidate id)
        self.newest: dict[str, str] = {}
        self._budget: TurnBudget | None = None  # made at the first new best
        self._one_at_a_time: asyncio.Lock | None = None  # made on the event loop
        #: set as the run's agents drain: bests not yet measured are not measured then
        self._draining: asyncio.Event | None = None

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
        self.newest[ev.task] = ev.candidate_id
        if self._budget is None:
            self._budget = TurnBudget(current().counters_share)
        self._one_at_a_time = self._one_at_a_time or asyncio.Lock()
        draining = self._drain_event()
        async with self._one_at_a_time:
            if self.unusable:  # found while this one waited
                return ()
            wait = self._budget.wait_s()
            if wait > 0 and not draining.is_set():
                self.ctx.log.info("counters_deferred", task=ev.task, wait_s=round(wait, 1))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(draining.wait(), wait)
            if draining.is_set():
                # nothing waits for counters to decide the run, and ncu's runner takes
                # seconds to start: the run's end does not wait for a backlog of them
                self.ctx.log.info(
                    "counters_skipped", task=ev.task, candidate=ev.candidate_id,
                    why="the run ended before its turn",
                )  # fmt: skip
                return ()
            if self.newest.get(ev.task) != ev.candidate_id:
                self.ctx.log.info(
                    "counters_skipped", task=ev.task, candidate=ev.candidate_id,
                    why="a newer best of its task came while it waited",
                )  # fmt: skip
                return ()
            report = await self._measure(state, ev, *found, self._budget)
        if report.unusable:
            # every later try would fail the same way, each with the device to itself
            self.unusable = report.error or "ncu could not start a runner"
            self.ctx.log.warning("counters_off", device=self.device, why=self.unusable[:500])
        return [
            CountersMeasured(
                candidate_id=ev.candidate_id, task=ev.task, device_id=self.device_id, report=report
            )
        ]

    def _drain_event(self) -> asyncio.Event:
        if self._draining is None:
            self._draining = asyncio.Event()
        return self._draining

    async def on_drain(self) -> None:
        """The run ended: the new bests still waiting for their turn are not measured
        (the one being measured finishes)."""
        self._drain_event().set()

    async def _measure(
        self, state: EvaluatorState, ev: CandidateProfiled, task: Task, source: str,
        budget: TurnBudget,
    ) -> CountersReport:  # fmt: skip
        """The counters of ``ev``'s candidate, its turns counted in ``budget``."""
        # at the run's recorded tolerance and under its conditions, as every stage grades
        session = self.grading(state, task, source)
        # the runner under ncu starts holding nothing, is loaded and checked sharing the
        # device, and its one measured call has it alone (``timing_gate``), after every
        # timing waiting then: counters decide no verdict, and ncu's turn takes seconds
        gate = self.timing_gate(ev.report.peak_device_mb, shared=False, yielding=True)
        async with gate as given:
            start = time.monotonic()
            hooks = dict(given)
            if "alone" in hooks:
                hooks["alone"] = budget.counting(hooks["alone"])
            # made in the thread: for a GPU, a session imports torch and counts the devices
            report = await asyncio.to_thread(lambda: counters_session(session(**hooks)))
            if "alone" not in hooks:  # a big task: the device alone throughout
                budget.held_s += time.monotonic() - start
        return report
