"""The compiler: builds each proposed candidate in a sandbox and records the outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agents.evaluator import EvaluatorAgent, EvaluatorState, gate_for
from kf.evaluation import CompileReport, compile_candidate
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.search_facts import CandidateAssigned, CandidateCompiled, CandidateProposed
from kf.tasks import Task

__all__ = ["Compiler"]


class Compiler(EvaluatorAgent):
    """Imports the candidate and constructs ``ModelNew`` (building its native code)."""

    kind = "compiler"
    listens = (RunStarted, CandidateProposed, CandidateAssigned)
    concurrency = 2

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        ev = rec.event
        if not isinstance(ev, CandidateAssigned) or not self.mine(ev.device_id):
            return ()
        found = self.lookup(state, ev.task, ev.candidate_id)
        if found is None:
            return ()
        task, source = found
        report = await self.build(task, source)
        return [
            CandidateCompiled(
                candidate_id=ev.candidate_id,
                task=ev.task,
                device_id=self.device_id,
                report=report,
                attempt=ev.attempt,
            )
        ]

    async def build(self, task: Task, source: str) -> CompileReport:
        """Compile in a sandbox, sharing the device with verification (timing waits)."""
        async with await gate_for(self.device).shared():
            return await asyncio.to_thread(
                compile_candidate, task, source, device=self.device, timeout_s=self.build_timeout_s
            )
