"""The device gate: one readers-writer gate per device, shared by every agent a worker
hosts next to it. Timing takes it exclusively (a profile, a tuning session, counters, a
hardware agent's measurements); compiling and verifying share it.

One gate per device per process and event loop (:func:`gate_for`); the agents of one
worker serving one device all see the same gate.
"""

from __future__ import annotations

import asyncio

__all__ = ["DeviceGate", "gate_for"]


class DeviceGate:
    """A readers-writer gate per device: timing is exclusive; compiling and verifying share.

    On a CPU every stage competes for the same cores, so a profile waits until no
    compile or verification is running, and none starts while it times.
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting_exclusive = 0

    async def shared(self) -> _Hold:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and self._waiting_exclusive == 0)
            self._shared += 1
        return _Hold(self, exclusive=False)

    async def exclusive(self) -> _Hold:
        async with self._cond:
            self._waiting_exclusive += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
            finally:
                self._waiting_exclusive -= 1
            self._exclusive = True
        return _Hold(self, exclusive=True)

    async def _release(self, exclusive: bool) -> None:
        async with self._cond:
            if exclusive:
                self._exclusive = False
            else:
                self._shared -= 1
            self._cond.notify_all()


class _Hold:
    def __init__(self, gate: DeviceGate, *, exclusive: bool) -> None:
        self.gate = gate
        self.exclusive = exclusive

    async def __aenter__(self) -> _Hold:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.gate._release(self.exclusive)


_GATES: dict[tuple[int, str], DeviceGate] = {}


def gate_for(device: str) -> DeviceGate:
    """The gate of ``device`` in this process and event loop."""
    key = (id(asyncio.get_running_loop()), device)
    gate = _GATES.get(key)
    if gate is None:
        gate = _GATES[key] = DeviceGate()
    return gate
