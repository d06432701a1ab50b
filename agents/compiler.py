"""The compiler: builds each proposed candidate in a sandbox and records the outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agents.build_pool import build_pool
from agents.evaluator import EvaluatorAgent, EvaluatorState
from kf.devices.gate import gate_for
from kf.evaluation import CompileReport, GradingSession, compile_session
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.pools import runner_pool
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.kernels.tasks import Task
from kf.search_facts import CandidateAssigned, CandidateCompiled, CandidateProposed

__all__ = ["Compiler"]


class Compiler(EvaluatorAgent):
    """Imports the candidate and constructs ``ModelNew`` (building its native code)."""

    kind = "compiler"
    listens = (RunStarted, CandidateProposed, CandidateAssigned)
    concurrency = 2

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        ev = rec.event
        if not isinstance(ev, CandidateAssigned) or (found := self.claim(state, ev)) is None:
            return ()
        task, source = found
        # the host's build slots are shared by the compilers of all its devices
        pool = build_pool(self.concurrency)

        async def build() -> CompileReport:
            async with pool.slot(self.device_id):
                return await self.build(task, source, state.conditions, self.runner_key(ev))

        report = await self.stage(build)
        if isinstance(report, list):  # the device failed: its candidates go elsewhere
            return report
        if report.ok:
            pool.add_built(self.device_id, ev.candidate_id)
        return [self.outcome(CandidateCompiled, ev, report)]

    async def build(
        self, task: Task, source: str, conditions: Conditions, key: str | None = None
    ) -> CompileReport:
        """Compile in a sandbox, sharing the device with verification (timing waits)."""
        async with await gate_for(self.device).shared("build"):
            return await self.build_now(task, source, conditions, key)

    async def build_now(
        self, task: Task, source: str, conditions: Conditions, key: str | None = None
    ) -> CompileReport:
        """Compile in a sandbox now, in a thread (for a GPU, making a session imports torch
        and counts the devices); the runner is set up under the run's ``conditions``, and
        kept under ``key`` for the candidate's verification (:meth:`runner_key`)."""
        pool = runner_pool(self.device)
        return await asyncio.to_thread(
            lambda: compile_session(
                GradingSession(
                    task, source, device=self.device, pool=pool, conditions=conditions,
                    candidate_key=key, timeout_s=self.timeout_s,  # the later stages' limit
                ),
                self.build_timeout_s,
            )
        )  # fmt: skip
