"""The device gate: one readers-writer gate per device, shared by every agent a worker
hosts next to it. Timing takes it exclusively (a profile, a tuning session, counters, a
hardware agent's measurements); compiling and verifying share it.

One gate per device per process and event loop (:func:`gate_for`); the agents of one
worker serving one device all see the same gate.

A stage that times only part of the way (a profile: loading, checking and compiling
the baseline before its timing; counters: a runner started under ncu before its one
measured call) holds the gate through :class:`Turns`: shared while it prepares, and
exclusive only for each timing, which its grading thread asks for (:meth:`Turns.alone`).
A turn that decides no verdict (the counters' ncu run of a task's new best) yields: it
is taken only when no other turn is asked for, so the timings waiting go first.

Each hold has a label (its stage: ``verify``, ``profiler``, ``counters``, ...). When an
exclusive hold ends, the gate logs ``device_turn`` (INFO): its label, the seconds it
waited and held, and what it waited on: the shared holders by label when it asked, and
whether another exclusive hold was held or asked for before it. So a run's log says what
kept the timing turn waiting (``bench/throughput_gpu.py`` sums it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections import Counter
from collections.abc import Iterator

import structlog

log = structlog.get_logger("kf.devices.gate")

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
        self._waiting_yielding = 0  # of those, the turns that let the others go first
        self._holders: Counter[str] = Counter()  # the shared holds, by label

    async def shared(self, label: str = "shared") -> _Hold:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and self._waiting_exclusive == 0)
            self._shared += 1
            self._holders[label] += 1
        return _Hold(self, exclusive=False, label=label)

    async def exclusive(self, label: str = "exclusive", *, yielding: bool = False) -> _Hold:
        """The device alone, once no stage shares it and no other has it alone; no new
        share is given while this waits. ``yielding``: after every turn asked for without
        it, even those asked later (what waits on no timing goes last: counters)."""
        asked = time.monotonic()
        async with self._cond:
            waited_on = dict(+self._holders)
            behind = self._exclusive or self._waiting_exclusive > 0
            self._waiting_exclusive += 1
            self._waiting_yielding += yielding

            def free() -> bool:
                first = self._waiting_exclusive - self._waiting_yielding
                return not self._exclusive and self._shared == 0 and not (yielding and first)

            try:
                await self._cond.wait_for(free)
            finally:
                self._waiting_exclusive -= 1
                self._waiting_yielding -= yielding
            self._exclusive = True
        hold = _Hold(self, exclusive=True, label=label)
        hold.waited = (time.monotonic() - asked, waited_on, behind)
        return hold

    async def _release(self, exclusive: bool, label: str = "shared") -> None:
        async with self._cond:
            if exclusive:
                self._exclusive = False
            else:
                self._shared -= 1
                self._holders[label] -= 1
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

    def __init__(
        self, gate: DeviceGate, *, shared: bool = True, label: str = "turns", yielding: bool = False
    ) -> None:
        self.gate = gate
        self.label = label
        self.yielding = yielding  # its turns go after the others' (DeviceGate.exclusive)
        self._shared_from_start = shared
        self._loop: asyncio.AbstractEventLoop | None = None
        self._held: bool | None = None  # exclusive?, None: nothing held
        self._hold_now: _Hold | None = None
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
            if self._hold_now is not None:
                await self._hold_now.__aexit__()
                self._held = self._hold_now = None
            if exclusive is None or self._closed:
                return
            if exclusive:
                hold = await self.gate.exclusive(self.label, yielding=self.yielding)
            else:
                hold = await self.gate.shared(self.label)
            if self._closed:  # left while waiting: the gate is not kept
                await hold.__aexit__()
                return
            self._held, self._hold_now = exclusive, hold

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
    def __init__(self, gate: DeviceGate, *, exclusive: bool, label: str) -> None:
        self.gate = gate
        self.exclusive = exclusive
        self.label = label
        self.since = time.monotonic()
        #: an exclusive hold's wait: seconds, the shared holders by label when it asked,
        #: and whether another exclusive hold was held or waited for then
        self.waited: tuple[float, dict[str, int], bool] | None = None
        self._released = False

    async def __aenter__(self) -> _Hold:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._released:
            return
        self._released = True
        await self.gate._release(self.exclusive, self.label)
        if self.waited is not None:
            waited_s, waited_on, behind = self.waited
            log.info(
                "device_turn",
                label=self.label,
                waited_s=round(waited_s, 3),
                held_s=round(time.monotonic() - self.since, 3),
                waited_on=waited_on,
                behind_a_turn=behind,
            )


_GATES: dict[tuple[int, str], DeviceGate] = {}


def gate_for(device: str) -> DeviceGate:
    """The gate of ``device`` in this process and event loop."""
    key = (id(asyncio.get_running_loop()), device)
    gate = _GATES.get(key)
    if gate is None:
        gate = _GATES[key] = DeviceGate()
    return gate
