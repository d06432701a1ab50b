"""The device gate: one readers-writer gate per device, shared by every agent a worker
hosts next to it. Timing takes it exclusively (a profile, a tuning session, counters, a
hardware agent's measurements); compiling and verifying share it.

One gate per device per process and event loop (:func:`gate_for`); the agents of one
worker serving one device all see the same gate.

A stage that times only part of the way (a profile: loading, checking and compiling
the baseline before its timing; counters: a runner started under ncu before its one
measured call) holds the gate through :class:`Turns`: shared while it prepares, and
exclusive only for each timing, which its grading thread asks for (:meth:`Turns.alone`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Iterator

__all__ = ["DeviceGate", "GateClosed", "Turns", "gate_for"]


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


class GateClosed(RuntimeError):
    """The stage holding :class:`Turns` ended (cancelled: kf is stopping) while its
    grading thread waited for a turn; the thread stops timing."""


class Turns:
    """A stage's hold on ``gate``: shared from entering (on the event loop) to leaving
    (``shared=False``: nothing until the grading thread asks, :meth:`sharing`), exclusive
    inside each :meth:`alone` block (entered from the stage's grading thread).

    To time, the shared hold is given back and the exclusive one taken, never held
    together (two stages turning at once would each wait for the other's share). Leaving
    releases whatever is held, and a thread still waiting for its turn gets
    :class:`GateClosed` instead.
    """

    def __init__(self, gate: DeviceGate, *, shared: bool = True) -> None:
        self.gate = gate
        self._shared_from_start = shared
        self._loop: asyncio.AbstractEventLoop | None = None
        self._held: bool | None = None  # exclusive?, None: nothing held
        self._closed = False
        self._changing = asyncio.Lock()
        self._pending: concurrent.futures.Future[None] | None = None

    async def __aenter__(self) -> Turns:
        self._loop = asyncio.get_running_loop()
        if self._shared_from_start:
            await self._hold(False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closed = True
        if self._pending is not None:
            self._pending.cancel()  # a turn waited for: it will not be taken
        await self._hold(None)

    async def _hold(self, exclusive: bool | None) -> None:
        """Give back what is held, then take ``exclusive`` (None: nothing)."""
        async with self._changing:
            if self._held is not None:
                await self.gate._release(self._held)
                self._held = None
            if exclusive is None or self._closed:
                return
            hold = await (self.gate.exclusive() if exclusive else self.gate.shared())
            if self._closed:  # left while waiting: the gate is not kept
                await hold.__aexit__()
                return
            self._held = exclusive

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """From the grading thread: the device to this stage alone inside the block,
        then back to what it held before. Raises :class:`GateClosed` when the stage has
        ended."""
        before = self._held
        self._from_thread(True)
        try:
            yield
        finally:
            with contextlib.suppress(GateClosed):  # the block's own error goes first
                self._from_thread(before)

    @contextlib.contextmanager
    def sharing(self) -> Iterator[None]:
        """From the grading thread: a share of the device inside the block (nothing new
        where the stage holds one already), for work that runs on it without timing."""
        if self._held is not None:
            yield
            return
        self._from_thread(False)
        try:
            yield
        finally:
            with contextlib.suppress(GateClosed):
                self._from_thread(None)

    def _from_thread(self, exclusive: bool | None) -> None:
        loop = self._loop
        if loop is None or self._closed or loop.is_closed():
            raise GateClosed("the stage holding the device gate has ended")
        future = asyncio.run_coroutine_threadsafe(self._hold(exclusive), loop)
        self._pending = future
        try:
            while True:
                try:
                    future.result(timeout=0.5)
                    break
                except concurrent.futures.TimeoutError:
                    if self._closed or loop.is_closed():
                        future.cancel()
                        raise GateClosed("the stage ended while it waited for its turn") from None
        except concurrent.futures.CancelledError:
            raise GateClosed("the stage ended while it waited for its turn") from None
        finally:
            self._pending = None
        if self._closed:
            raise GateClosed("the stage ended while it waited for its turn")


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
