"""The verifier: KernelBench's correctness protocol on every compiled candidate."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agents.build_pool import consumed
from agents.evaluator import EvaluatorAgent, EvaluatorState, gate_for
from kf.devices import runner_pool
from kf.evaluation import VerifyReport, verify_candidate
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.search_facts import (
    CandidateCompiled,
    CandidateProposed,
    CandidateRejected,
    CandidateVerified,
    GeneralisationFailed,
)

__all__ = ["Verifier"]


class Verifier(EvaluatorAgent):
    """Five seeded trials against the reference, in separate processes; evidence recorded."""

    kind = "verifier"
    listens = (RunStarted, CandidateProposed, CandidateCompiled)

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        ev = rec.event
        if not isinstance(ev, CandidateCompiled) or not ev.report.ok or not self.mine(ev.device_id):
            return ()
        found = self.lookup(state, ev.task, ev.candidate_id)
        if found is None or self.device_down():
            return ()
        task, source = found

        async def verify() -> VerifyReport:
            async with await gate_for(self.device).shared():
                return await asyncio.to_thread(
                    verify_candidate,
                    task,
                    source,
                    device=self.device,
                    seed=state.seed,
                    timeout_s=self.timeout_s,
                    pool=runner_pool(self.device),
                )

        report = await self.stage(verify)
        if isinstance(report, list):  # the device failed: its candidates go elsewhere
            return report
        if not report.correct:
            consumed(ev.candidate_id)
        cls = CandidateVerified if report.correct else CandidateRejected
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
        return [
            *gate,
            cls(
                candidate_id=ev.candidate_id,
                task=ev.task,
                device_id=self.device_id,
                report=report,
                attempt=ev.attempt,
            ),
        ]
