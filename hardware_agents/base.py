"""What every hardware agent does: announce its device when it connects, heartbeat while
it serves, and announce when it leaves. A device kind only says how to probe itself."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, ClassVar

from hardware_agents.cpu import host_id
from kf.agent import Agent, AgentContext
from kf.events import Event, Record
from kf.facts import DeviceAnnounced, DeviceHeartbeat, DeviceLeft

__all__ = ["HardwareAgent"]


class HardwareAgent(Agent[None]):
    """Owns one device's description; its events are observations of the machine."""

    kind = "hardware"
    listens = ()
    device_kind: ClassVar[str] = ""  # "cpu", "cuda", …
    default_device: ClassVar[str] = ""

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.device = str(ctx.options.get("device", self.default_device))
        self.device_id = str(ctx.options.get("device_id") or f"{host_id()}/{self.device}")
        self.heartbeat_s = float(ctx.options.get("heartbeat_s", 10.0))
        self.measure = bool(ctx.options.get("measure", True))
        self._beat: asyncio.Task[None] | None = None

    def probe(self) -> dict[str, Any]:
        """The device's capabilities (blocking; runs in a thread)."""
        raise NotImplementedError

    def initial_state(self) -> None:
        return None

    def react(self, state: None, rec: Record) -> Sequence[Event]:
        return ()

    async def on_start(self) -> None:
        capabilities = await asyncio.to_thread(self.probe)
        self.emit(
            DeviceAnnounced(
                device_id=self.device_id,
                kind=self.device_kind,
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
