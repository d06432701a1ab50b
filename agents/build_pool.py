"""The host's build slots, shared by the compilers of every device a worker serves.

A worker for several GPUs runs one compiler per GPU, but builds use the host's cores,
not a GPU: so the compilers draw from one pool of slots (as many as one compiler would
use alone, :func:`agents.worker.compile_concurrency`), and a free slot goes
to the device with the least work built or being built for it — the one closest to
running dry — the oldest request first among equals. A GPU whose queue is long cannot
take every slot while another GPU's candidate waits to be built, and no slot stands
idle while any device's candidate waits. A built candidate counts as the device's work
until its verification rejects it or its timing ends (:meth:`BuildPool.consumed`).

One pool per process and event loop (as the device gates are, :func:`kf.devices.gate.gate_for`).
With one device it behaves as the compiler's own concurrency limit did.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

__all__ = ["BuildPool", "build_pool", "consumed", "forget"]


@dataclass
class _Waiter:
    seq: int
    device_id: str
    future: asyncio.Future[None]


class BuildPool:
    """``slots`` builds at once across devices, granted to the least-supplied device."""

    def __init__(self, slots: int) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.slots = max(1, slots)
        self.running: dict[str, int] = {}  # device id → builds running now
        self.built: dict[str, set[str]] = {}  # device id → candidates built, not yet used up
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()
        self.granted: list[str] = []  # device ids in the order slots were granted (tests)

    def backlog(self, device_id: str) -> int:
        """Work the device has built or being built: what it can run before it waits."""
        return self.running.get(device_id, 0) + len(self.built.get(device_id, ()))

    def busy(self) -> int:
        return sum(self.running.values())

    def _grant(self) -> None:
        while self._waiting and self.busy() < self.slots:
            self._waiting = [w for w in self._waiting if not w.future.done()]
            if not self._waiting:
                return
            # backlogs change while requests wait: rank them now
            best = min(self._waiting, key=lambda w: (self.backlog(w.device_id), w.seq))
            self._waiting.remove(best)
            self.running[best.device_id] = self.running.get(best.device_id, 0) + 1
            self.granted.append(best.device_id)
            best.future.set_result(None)

    @contextlib.asynccontextmanager
    async def slot(self, device_id: str) -> AsyncIterator[None]:
        """Hold one build slot for a candidate of ``device_id`` while the block runs."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(next(self._seq), device_id, loop.create_future())
        self._waiting.append(waiter)
        self._grant()
        try:
            await waiter.future
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release(device_id)  # granted just as we were cancelled
            else:
                waiter.future.cancel()
            raise
        try:
            yield
        finally:
            self._release(device_id)

    def _release(self, device_id: str) -> None:
        self.running[device_id] = max(0, self.running.get(device_id, 0) - 1)
        self._grant()

    def add_built(self, device_id: str, candidate_id: str) -> None:
        """A candidate built for ``device_id`` waits for the device."""
        self.built.setdefault(device_id, set()).add(candidate_id)

    def consumed(self, candidate_id: str) -> None:
        """The candidate's device work ended (rejected or timed)."""
        for ids in self.built.values():
            ids.discard(candidate_id)

    def forget(self, device_id: str) -> None:
        """The device failed: what was built for it no longer counts."""
        self.built.pop(device_id, None)


_POOLS: dict[int, BuildPool] = {}


def _current() -> BuildPool | None:
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(id(loop))
    return pool if pool is not None and pool.loop is loop else None


def build_pool(slots: int) -> BuildPool:
    """This event loop's build pool (made with ``slots`` slots on first use)."""
    pool = _current()
    if pool is None:
        loop = asyncio.get_running_loop()
        pool = _POOLS[id(loop)] = BuildPool(slots)
        pool.loop = loop
    return pool


def consumed(candidate_id: str) -> None:
    """:meth:`BuildPool.consumed` on this loop's pool, if it has one."""
    pool = _current()
    if pool is not None:
        pool.consumed(candidate_id)


def forget(device_id: str) -> None:
    """:meth:`BuildPool.forget` on this loop's pool, if it has one."""
    pool = _current()
    if pool is not None:
        pool.forget(device_id)
