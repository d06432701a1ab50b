"""What every hardware agent does: announce its device when it connects, heartbeat while
it serves, and announce when it leaves. A device kind only says how to probe itself.

A kind whose measurements take a while (``announce_before_measuring``) announces what it
can describe at once, so work can be routed to it, then measures with the device to
itself (the exclusive side of its device gate, which timing also takes) and announces
again with the measured figures. The later announcement supersedes the earlier one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, ClassVar

from hardware_agents.cpu import host_id
from kf.agent import Agent, AgentContext
from kf.devices.gate import gate_for
from kf.events import Event, Record
from kf.facts import DeviceAnnounced, DeviceHeartbeat, DeviceLeft
from kf.runtime import cancel_and_wait

__all__ = ["HardwareAgent"]


class HardwareAgent(Agent[None]):
    """Owns one device's description; its events are observations of the machine."""

    kind = "hardware"
    listens = ()
    device_kind: ClassVar[str] = ""  # "cpu", "cuda", …
    default_device: ClassVar[str] = ""
    announce_before_measuring: ClassVar[bool] = False

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.device = str(ctx.options.get("device", self.default_device))
        self.device_id = str(ctx.options.get("device_id") or f"{host_id()}/{self.device}")
        self.heartbeat_s = float(ctx.options.get("heartbeat_s", 10.0))
        self.measure = bool(ctx.options.get("measure", True))
        self._beat: asyncio.Task[None] | None = None
        self._measuring: asyncio.Task[None] | None = None

    def probe(self, measure: bool) -> dict[str, Any]:
        """The device's capabilities, with measured figures if ``measure`` (blocking; runs
        in a thread)."""
        raise NotImplementedError

    def initial_state(self) -> None:
        return None

    def react(self, state: None, rec: Record) -> Sequence[Event]:
        return ()

    async def on_start(self) -> None:
        later = self.measure and self.announce_before_measuring
        capabilities = await asyncio.to_thread(self.probe, self.measure and not later)
        self._announce(capabilities)
        self._beat = asyncio.create_task(self._heartbeats())
        if later:
            self._measuring = asyncio.create_task(self._measure())

    def _announce(self, capabilities: dict[str, Any]) -> None:
        self.emit(
            DeviceAnnounced(
                device_id=self.device_id,
                kind=self.device_kind,
                agent_id=self.ctx.agent_id,
                capabilities=capabilities,
            )
        )

    async def _measure(self) -> None:
        """Measure with the device to ourselves, then announce the measured figures."""
        try:
            async with await gate_for(self.device).exclusive("hardware"):
                capabilities = await asyncio.to_thread(self.probe, True)
        except Exception as exc:  # the first announcement stands (a cancel is no Exception)
            self.ctx.log.warning("device_measurement_failed", device=self.device, error=str(exc))
            return
        self._announce(capabilities)

    async def _heartbeats(self) -> None:
        from kf.devices.health import failure

        while True:
            await asyncio.sleep(self.heartbeat_s)
            if failure(self.device_id) is not None:  # recorded as left, with the reason
                return
            self.emit(DeviceHeartbeat(device_id=self.device_id, utilisation_pct=self.utilisation()))

    def utilisation(self) -> float | None:
        """The device's mean utilisation since the last call, in percent (None: not
        sampled; a GPU's agent samples it)."""
        return None

    async def on_stop(self) -> None:
        from kf.devices.health import failure

        for task in (self._measuring, self._beat):
            if task is not None:
                await cancel_and_wait(task)
        if failure(self.device_id) is None:
            self.emit(DeviceLeft(device_id=self.device_id, reason="worker stopped"))
