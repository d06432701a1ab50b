"""The CPU hardware agent: announces the CPU's capabilities on connect, heartbeats with its
load while it serves, and announces when it leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import msgspec

from hardware_agents.cpu import host_id, probe
from kf.agent import Agent, AgentContext
from kf.events import Event, Record
from kf.facts import DeviceAnnounced, DeviceHeartbeat, DeviceLeft

__all__ = ["CpuHardwareAgent"]


class CpuHardwareAgent(Agent[None]):
    """Owns the CPU device's description; its events are observations of the machine."""

    kind = "hardware"
    listens = ()

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.device = str(ctx.options.get("device", "cpu"))
        self.device_id = str(ctx.options.get("device_id") or f"{host_id()}/{self.device}")
        self.heartbeat_s = float(ctx.options.get("heartbeat_s", 10.0))
        self.measure = bool(ctx.options.get("measure", True))
        self._beat: asyncio.Task[None] | None = None

    def initial_state(self) -> None:
        return None

    def react(self, state: None, rec: Record) -> Sequence[Event]:
        return ()

    async def on_start(self) -> None:
        caps = await asyncio.to_thread(probe, measure=self.measure)
        capabilities: dict[str, Any] = msgspec.to_builtins(caps)
        self.emit(
            DeviceAnnounced(
                device_id=self.device_id,
                kind="cpu",
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
