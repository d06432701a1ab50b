"""The profiler: times verified candidates against PyTorch eager, alone on the device."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agents.evaluator import EvaluatorAgent, EvaluatorState, gate_for
from kf.evaluation import profile_candidate
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.search_facts import CandidateProfiled, CandidateProposed, CandidateVerified

__all__ = ["Profiler"]


class Profiler(EvaluatorAgent):
    """Warm-up, many trials, mean / spread / CI, eager timed in the same session."""

    kind = "profiler"
    listens = (RunStarted, CandidateProposed, CandidateVerified)

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        ev = rec.event
        if not isinstance(ev, CandidateVerified) or not self.mine(ev.device_id):
            return ()
        found = self.lookup(state, ev.task, ev.candidate_id)
        if found is None:
            return ()
        task, source = found
        async with await gate_for(self.device).exclusive():
            report = await asyncio.to_thread(
                profile_candidate,
                task,
                source,
                device=self.device,
                seed=state.seed,
                timeout_s=self.timeout_s,
            )
        return [
            CandidateProfiled(
                candidate_id=ev.candidate_id,
                task=ev.task,
                device_id=self.device_id,
                report=report,
                attempt=ev.attempt,
            )
        ]
