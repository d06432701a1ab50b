"""The CUDA hardware agent, and the compiler a CUDA worker uses.

The hardware agent announces one GPU (probed in a child process), heartbeats while it
serves and announces when it leaves, as the CPU one does. :class:`CudaCompiler` differs
from the CPU compiler in one way: building CUDA code (NVRTC, nvcc, Triton) happens on
the host's cores, not on the GPU, so compiles neither wait for nor block the device
gate that keeps timing alone on the GPU, and several run at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any

import msgspec

from agents.compiler import Compiler
from agents.evaluator import EvaluatorState
from hardware_agents.cpu import host_id
from hardware_agents.cuda import probe_in_subprocess
from kf.agent import Agent, AgentContext
from kf.evaluation import compile_candidate
from kf.events import Event, Record
from kf.facts import DeviceAnnounced, DeviceHeartbeat, DeviceLeft
from kf.search_facts import CandidateAssigned, CandidateCompiled

__all__ = ["CudaCompiler", "CudaHardwareAgent", "compile_concurrency"]


def compile_concurrency() -> int:
    """Compiles at once on a CUDA worker: ``$KF_CUDA_COMPILE_JOBS`` or half the cores."""
    env = os.environ.get("KF_CUDA_COMPILE_JOBS")
    if env:
        return max(1, int(env))
    return max(2, len(os.sched_getaffinity(0)) // 2)


class CudaHardwareAgent(Agent[None]):
    """Owns one GPU's description; its events are observations of the machine."""

    kind = "hardware"
    listens = ()

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.device = str(ctx.options.get("device", "cuda:0"))
        self.device_id = str(ctx.options.get("device_id") or f"{host_id()}/{self.device}")
        self.heartbeat_s = float(ctx.options.get("heartbeat_s", 10.0))
        self.measure = bool(ctx.options.get("measure", True))
        self._beat: asyncio.Task[None] | None = None

    def initial_state(self) -> None:
        return None

    def react(self, state: None, rec: Record) -> Sequence[Event]:
        return ()

    async def on_start(self) -> None:
        caps = await asyncio.to_thread(probe_in_subprocess, self.device, measure=self.measure)
        capabilities: dict[str, Any] = msgspec.to_builtins(caps)
        self.emit(
            DeviceAnnounced(
                device_id=self.device_id,
                kind="cuda",
                agent_id=self.ctx.agent_id,
                capabilities=capabilities,
            )
        )
        self._beat = asyncio.create_task(self._heartbeats())

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self.emit(DeviceHeartbeat(device_id=self.device_id))

    async def on_stop(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
        self.emit(DeviceLeft(device_id=self.device_id, reason="worker stopped"))


class CudaCompiler(Compiler):
    """Builds candidates for a GPU on the host's cores, many at once, beside the timing."""

    concurrency = compile_concurrency()

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        ev = rec.event
        if not isinstance(ev, CandidateAssigned) or not self.mine(ev.device_id):
            return ()
        found = self.lookup(state, ev.task, ev.candidate_id)
        if found is None:
            return ()
        task, source = found
        report = await asyncio.to_thread(
            compile_candidate, task, source, device=self.device, timeout_s=self.timeout_s
        )
        return [
            CandidateCompiled(
                candidate_id=ev.candidate_id,
                task=ev.task,
                device_id=self.device_id,
                report=report,
                attempt=ev.attempt,
            )
        ]
