"""What the compiler, verifier and profiler share: the run's tasks and candidate sources
for their device, which candidates a stage takes (``claim``) and the outcome event it
answers with (``outcome``); the gate that keeps timing alone on the device is
:mod:`kf.devices.gate`.

Each of the three is its own agent (its own kind, its own reactions); a worker process
hosts them next to the device they serve. The blocking evaluation calls run in threads
(``asyncio.to_thread``); every candidate runs in its own sandboxed process
(:mod:`kf.evaluation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, TypeVar

import msgspec

from kf.agent import Agent, AgentContext
from kf.devices.gate import Turns, gate_for
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.pools import runner_pool
from kf.evaluation.grader.session import GradingSession
from kf.evaluation.wire.tolerance import Tolerance
from kf.events import Event, Record
from kf.facts import DeviceLeft, RunStarted
from kf.kernels.tasks import Seed, Task, UserTest
from kf.kernels.tuning import bind_shape
from kf.search_facts import (
    CandidateAssigned,
    CandidateCompiled,
    CandidateProfiled,
    CandidateProposed,
    CandidateRejected,
    CandidateVerified,
)
from kf.settings import current

__all__ = ["EvaluatorAgent", "EvaluatorState"]

_R = TypeVar("_R")
#: a stage's outcome: what the compiler, verifier or profiler says of one candidate
_Outcome = TypeVar(
    "_Outcome", CandidateCompiled, CandidateVerified, CandidateRejected, CandidateProfiled
)
#: what starts a stage: the candidate's assignment, or the previous stage's outcome
Routed = CandidateAssigned | CandidateCompiled | CandidateVerified


class EvaluatorState(msgspec.Struct, kw_only=True):
    """The run's tasks (from RunStarted) and the sources of candidates for this device."""

    seed: int = 0
    tasks: dict[str, Any] = {}  # name → Task (not serialised: rebuilt from the log)
    sources: dict[str, str] = {}
    tolerance: Tolerance = Tolerance()  # the run's (config atol, rtol, tolerance)
    # the run's other measuring conditions (config compile_baseline, compile_mode, tf32,
    # device_inputs): every stage is graded under the recorded run's, never this process's
    conditions: Conditions = Conditions()
    shapes: dict[
        str, int
    ] = {}  # tuned candidate id → its shape set (kf.kernels.tuning), when not 0


class EvaluatorAgent(Agent[EvaluatorState]):
    """Base of compiler, verifier and profiler: knows tasks and candidate sources."""

    listens: ClassVar[tuple[type[Event], ...] | None] = (RunStarted, CandidateProposed)
    concurrency = 1

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.device = str(ctx.options.get("device", "cpu"))
        self.device_id = str(ctx.options.get("device_id", self.device))
        self.timeout_s = float(ctx.options.get("timeout_s", 180.0))
        # the compile stage's own limit (None: $KF_BUILD_TIMEOUT_S, default 600 s)
        build = ctx.options.get("build_timeout_s")
        self.build_timeout_s = float(build) if build else None

    def initial_state(self) -> EvaluatorState:
        return EvaluatorState()

    def evolve(self, state: EvaluatorState, rec: Record) -> EvaluatorState:
        ev = rec.event
        if isinstance(ev, RunStarted):
            state.seed = ev.seed
            config = ev.run_config()
            state.tolerance = Tolerance.of(config)
            state.conditions = Conditions.of(config)
            state.tasks = {
                t.name: Task.from_source(
                    t.name,
                    t.source,
                    path=t.path,
                    seeds=tuple(Seed(name=n, source=s) for n, s in t.seeds),
                    tests=tuple(UserTest(name=n, source=s) for n, s in t.tests),
                    settings=t.settings,
                    origin=t.origin,
                )
                for t in ev.tasks
            }
        elif isinstance(ev, CandidateProposed):
            state.sources[ev.candidate_id] = ev.source
            if ev.shape_index:
                state.shapes[ev.candidate_id] = ev.shape_index
        return state

    def mine(self, device_id: str) -> bool:
        """Whether work routed to ``device_id`` is this worker's."""
        return device_id == self.device_id

    def snapshot(self, state: EvaluatorState) -> Any:
        return {"tasks": sorted(state.tasks), "candidates": len(state.sources)}

    def lookup(self, state: EvaluatorState, task: str, cid: str) -> tuple[Task, str] | None:
        """The task and source of a candidate this agent serves, or None. A tuned candidate
        gets the task bound to its shape set, so every stage runs at those shapes."""
        t = state.tasks.get(task)
        src = state.sources.get(cid)
        if t is None or src is None:
            return None
        index = state.shapes.get(cid, 0)
        return (bind_shape(t, index) if index else t), src

    def claim(self, state: EvaluatorState, ev: Routed) -> tuple[Task, str] | None:
        """The task and source of the candidate ``ev`` routes to this device, or None: it
        is another device's, unknown here, or this device failed (it takes no more work)."""
        if not self.mine(ev.device_id):
            return None
        found = self.lookup(state, ev.task, ev.candidate_id)
        return None if found is None or self.device_down() else found

    def grading(
        self, state: EvaluatorState, task: Task, source: str
    ) -> Callable[..., GradingSession]:
        """What makes the grading session of ``source`` for ``task`` on this agent's device
        (its keyword arguments are the session's, over these):
        the run's seed, its recorded tolerance and measuring conditions (``state``, folded
        from ``run.started``), the device's runner pool and the stage's time limit. A maker
        rather than the session: for a GPU, making one imports torch and counts the
        devices, which belongs in the stage's thread, not the event loop."""
        return functools.partial(
            GradingSession,
            task,
            source,
            device=self.device,
            seed=state.seed,
            pool=runner_pool(self.device),
            timeout_s=self.timeout_s,
            tolerance=state.tolerance,
            conditions=state.conditions,
        )

    @contextlib.asynccontextmanager
    async def timing_gate(
        self, peak_device_mb: float | None, *, shared: bool = True, yielding: bool = False
    ) -> AsyncIterator[dict[str, Callable[[], AbstractContextManager[object]]]]:
        """The device gate for a stage that times (:mod:`kf.devices.gate`): shared (from
        the start, or ``shared=False`` only where the stage asks), with the device alone
        for each timing; what it yields are the session's ``alone`` and ``sharing``.
        ``yielding``: its turns go after every other stage's (:class:`Turns`).

        A candidate whose last stage held more device memory than a big task
        (``$KF_BIG_TASK_MB``) has the device alone throughout instead (no hooks: the
        session's own lock is uncontended then): big tasks are graded one at a time, and
        a big verification waiting for that turn while sharing the gate would wait on a
        stage that waits for it to leave."""
        gate = gate_for(self.device)
        big = current().over_big_task(peak_device_mb)
        if self.device.startswith("cuda") and big:
            async with await gate.exclusive(self.kind, yielding=yielding):
                yield {}
        else:
            async with Turns(gate, shared=shared, label=self.kind, yielding=yielding) as turns:
                yield {"alone": turns.alone, "sharing": turns.sharing}

    def runner_key(self, ev: Routed) -> str:
        """What names ``ev``'s candidate, attempt and device to the runner pool: a runner
        that built or verified it is kept for its next stage here, for it alone
        (:attr:`kf.evaluation.GradingSession.candidate_key`)."""
        return f"{self.ctx.run_id}:{ev.candidate_id}:{ev.attempt}:{self.device_id}"

    def outcome(self, cls: type[_Outcome], ev: Routed, report: Any) -> _Outcome:
        """The stage's outcome ``cls`` with ``report`` for ``ev``'s candidate and attempt."""
        return cls(
            candidate_id=ev.candidate_id,
            task=ev.task,
            device_id=self.device_id,
            report=report,
            attempt=ev.attempt,
        )

    def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:
        return ()

    # -- a device that fails (kf.devices) ---------------------------------------------------

    def device_down(self) -> bool:
        """Whether this agent's device failed in this process: it takes no more work."""
        from kf.devices import health

        return health.failure(self.device_id) is not None

    async def stage(self, call: Callable[[], Awaitable[_R]]) -> _R | list[Event]:
        """Run one stage; if it went wrong in a way the device can and a fresh process
        cannot use the device either, the device failed: instead of the stage's result
        (which would blame the candidate), ``device.left`` with the reason, once, and
        the archive re-dispatches the device's candidates to the others."""
        try:
            report = await call()
        except Exception as exc:
            from kf.evaluation.grader.sandbox import RunnerStartError

            kind = "runner_start" if isinstance(exc, RunnerStartError) else "error"
            gone = await self._device_check(True, kind, str(exc))
            if gone is not None:
                return gone
            raise
        failed = not bool(getattr(report, "ok", getattr(report, "correct", True)))
        text = f"{getattr(report, 'error', '') or ''}\n{getattr(report, 'log', '') or ''}"
        gone = await self._device_check(failed, getattr(report, "failure_kind", None), text)
        if gone is not None:
            return gone
        return report

    async def _device_check(self, failed: bool, kind: str | None, text: str) -> list[Event] | None:
        from agents import build_pool
        from kf.devices import health

        injected = health.record_stage(self.device_id)
        why = health.failure(self.device_id) or injected
        if why is None and failed and health.looks_like_device_error(kind, text):
            why = await asyncio.to_thread(health.probe_health, self.device)
        if why is None:
            return None
        if not health.mark_failed(self.device_id, why):
            return []
        self.ctx.log.error("device_failed", device=self.device_id, reason=why)
        build_pool.forget(self.device_id)
        return [DeviceLeft(device_id=self.device_id, reason=f"device failed: {why}")]
