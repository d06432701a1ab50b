"""The verifier: KernelBench's correctness protocol on every compiled candidate.

Before it verifies a task's first candidate, it audits the task (is its reference output
input-independent? :mod:`kf.evaluation.grader.audit`) and records ``kernel.task_audited`` under
an id derived from the run, the task and its device, so the log holds one audit per task
and device. Another device's audit spares it its own only when the run takes that
device's word (its ``confirm_trusted``, issue 43): an untrusted device's audit, a lie
or not, neither stops a trusted device's audit nor decides the report (kf.app.report).
After a task's first correct candidate it compiles the task's ``torch.compile`` baseline
for the profiles to come (:meth:`Verifier._verify`).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Sequence

import msgspec

from agents.build_pool import consumed
from agents.evaluator import EvaluatorAgent, EvaluatorState
from kf.agent import AgentContext
from kf.devices.gate import gate_for
from kf.evaluation import GradingSession, VerifyReport, verify_session
from kf.evaluation.grader.audit import audit_task
from kf.evaluation.grader.baseline import compile_early
from kf.evaluation.grader.pools import runner_pool
from kf.evaluation.grader.sandbox import default_pool
from kf.events import Event, Record, derived_id
from kf.facts import RunStarted
from kf.kernels.tasks import Task, TaskError
from kf.search_facts import (
    CandidateCompiled,
    CandidateProposed,
    CandidateRejected,
    CandidateVerified,
    GeneralisationFailed,
    TaskAudited,
)

__all__ = ["Verifier"]


class Verifier(EvaluatorAgent):
    """Five seeded trials against the reference, in separate processes; evidence recorded."""

    kind = "verifier"
    listens = (RunStarted, CandidateProposed, CandidateCompiled, TaskAudited)

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self._audited: set[str] = set()  # tasks audited (or being audited) by this agent
        self._baselined: set[str] = set()  # tasks whose compiled baseline it made early
        #: seconds a baseline compiled as the run started took, for the task's first
        #: correct verification to report (kf report counts them)
        self._compiled_at_start: dict[str, float] = {}
        self._trusted: list[str] | None = None  # the run's confirm_trusted

    def evolve(self, state: EvaluatorState, rec: Record) -> EvaluatorState:
        state = super().evolve(state, rec)
        ev = rec.event
        if isinstance(ev, RunStarted):
            trusted = ev.run_config().trust.confirm_trusted
            self._trusted = list(trusted) if trusted is not None else None
        elif isinstance(ev, TaskAudited) and (
            self._trusted is None or ev.device_id in (*self._trusted, self.device_id)
        ):
            self._audited.add(ev.task)
        return state

    async def _audit(self, state: EvaluatorState, task: Task) -> None:
        """Audit ``task`` once (see the module doc); the event id makes it once per run and
        device."""
        if task.name in self._audited:
            return
        self._audited.add(task.name)
        audit = await asyncio.to_thread(
            audit_task,
            task,
            device=self.device,
            seed=state.seed,
            timeout_s=self.timeout_s,
            tolerance=state.tolerance,
            conditions=state.conditions,
        )
        ev = TaskAudited(task=task.name, device_id=self.device_id, audit=audit)
        audit_id = derived_id("kernel.task_audited", self.ctx.run_id, task.name, self.device_id)
        self.emit(ev, event_id=audit_id)

    def _verify(self, task: Task, make: Callable[[], GradingSession]) -> VerifyReport:
        """Verify; after the first correct candidate of a task, compile the task's
        ``torch.compile`` baseline in a reference runner while the gate is still shared
        (:func:`kf.evaluation.grader.baseline.compile_early`): host work that the
        profile's exclusive turn would otherwise wait on, 5-15 s of it per task on an
        H200 host. The seconds it took are the report's phase ``compile_baseline_early``."""
        session = make()
        report = verify_session(session)
        if not report.correct:
            return report
        seconds = self._compiled_at_start.pop(task.name, None)
        if task.name not in self._baselined:
            self._baselined.add(task.name)
            early = compile_early(session)
            if early is not None and not early.cached and not early.error:
                seconds = early.compile_s
        if seconds is None:
            return report
        phases = {**report.phases, "compile_baseline_early": seconds}
        return msgspec.structs.replace(report, phases=phases)

    async def _baselines_at_start(self, state: EvaluatorState) -> None:
        """On a GPU, compile the tasks' ``torch.compile`` baselines as the run starts,
        all at once (up to one per core) sharing the gate: the first candidates are still
        building then. Compiled after a task's first correct candidate instead, each held
        the gate shared for 10-16 s on the H200 while profiles waited to time. At most as
        many tasks as the pool keeps reference runners for, less one per verification at
        once (more would evict each other's). All at once because no timing can start
        while any of them holds its share: four at a time, twelve tasks' compiles ended in
        three waves, the last 66 s into the run, and the first timing waited for it (run
        h, docs/decisions.md)."""
        if not self.device.startswith("cuda") or not state.conditions.compile_baseline:
            return
        room = (runner_pool(self.device) or default_pool()).max_references - self.concurrency
        slots = asyncio.Semaphore(max(1, min(room, len(os.sched_getaffinity(0)))))

        async def one(task: Task) -> None:
            async with slots, await gate_for(self.device).shared("baseline"):
                if task.name in self._baselined or self.device_down():
                    return
                self._baselined.add(task.name)
                early = await asyncio.to_thread(compile_early, self.grading(state, task, "")())
                if early is not None and not early.cached and not early.error:
                    self._compiled_at_start[task.name] = early.compile_s

        await asyncio.gather(*(one(t) for t in list(state.tasks.values())[: max(0, room)]))

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        ev = rec.event
        if isinstance(ev, RunStarted):
            await self._baselines_at_start(state)
            return ()
        if not isinstance(ev, CandidateCompiled) or not ev.report.ok:
            return ()
        if (found := self.claim(state, ev)) is None:
            return ()
        task, source = found

        async def verify() -> VerifyReport:
            async with await gate_for(self.device).shared("verify"):
                await self._audit(state, task)
                session = functools.partial(
                    self.grading(state, task, source), candidate_key=self.runner_key(ev)
                )
                try:
                    # made in the thread: for a GPU, a session imports torch and counts
                    # the devices, which must not hold up the event loop
                    return await asyncio.to_thread(self._verify, task, session)
                except TaskError as exc:
                    # the reference failed mid-verification: the candidate still gets a
                    # verdict (else it waits forever), one that blames the task
                    return VerifyReport(
                        correct=False,
                        failure_kind="task_error",
                        error=f"the task's reference failed during verification: {exc}",
                    )

        report = await self.stage(verify)
        if isinstance(report, list):  # the device failed: its candidates go elsewhere
            return report
        if not report.correct:
            consumed(ev.candidate_id)
        gate: list[Event] = []
        if report.failure_kind == "generalisation_failed":
            gate.append(
                GeneralisationFailed(
                    candidate_id=ev.candidate_id,
                    task=ev.task,
                    device_id=self.device_id,
                    reason=report.error or "failed on unseen input shapes",
                )
            )
        if report.correct:
            return [*gate, self.outcome(CandidateVerified, ev, report)]
        return [*gate, self.outcome(CandidateRejected, ev, report)]
