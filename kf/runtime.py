"""The agent runtime: outbox, ordered committed feed, and the runner with its lifecycle.

Delivery. Producers put envelopes into an :class:`Outbox`, which sends them in batches as
NATS requests to the archivist (on the general intake, or on its device's intake for an
agent that speaks for a device: see :mod:`kf.bus`) and retries (same ``event_id``) until
the archivist replies that they are committed. The archivist deduplicates by
``event_id``, so retries are safe. An outbox lives in memory: if its process dies, what
it had not delivered is produced again on restart, because reactions get deterministic
ids (:func:`kf.events.derived_id`) and an agent re-reacts, during catch-up, to every event
its kind has not yet answered.

Order. :class:`CommittedFeed` yields committed envelopes strictly in ``seq`` order: it
subscribes first, catches up from the log, buffers what arrives early, fills gaps with
fetch requests and polls the head when idle (a lost last message leaves no later gap).

Lifecycle. ``start → ready → drain``: the runner calls ``on_start``, catches up, sets
``ready``, follows the live log, and on ``stop`` stops taking events, calls ``on_drain``
(an agent cuts optional queued work short), lets running reactions finish, flushes the
outbox and drains the connection.

Supervision policy. A ``react`` that raises is logged with its traceback, counted and
recorded as a ``ReactionFailed`` event; the agent goes on. An ``evolve`` that raises means
the agent's state can no longer be trusted: the runner stops with :class:`AgentCrashed`,
and :func:`supervise` restarts it from the log (up to ``max_restarts`` times, with
backoff) before giving up loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from kf import bus, shutdown
from kf.agent import Agent, AgentContext
from kf.events import (
    Decision,
    Envelope,
    Event,
    EventError,
    Record,
    decode_envelope,
    decode_event,
    derived_id,
    device_event_id,
    make_envelope,
)
from kf.facts import AgentStarted, AgentStopped, ReactionFailed

__all__ = [
    "AgentCrashed",
    "AgentRunner",
    "CommittedFeed",
    "Outbox",
    "cancel_and_wait",
    "fetch_range",
    "interrupted",
    "reaction_envelopes",
    "supervise",
]

log = structlog.get_logger("kf.runtime")

#: seconds a cancelled runner spends at most on its clean-up (cut reactions short, stop
#: the agent, record ``agent.stopped``)
INTERRUPT_S = 3.0

_BATCH_ENCODER = msgspec.msgpack.Encoder()
_REPLY_DECODER = msgspec.msgpack.Decoder(dict[str, Any])
_FETCH_DECODER = msgspec.msgpack.Decoder(dict[str, Any])


def reaction_envelopes(
    kind: str, source: str, cause: Envelope, events: Sequence[Event]
) -> list[Envelope]:
    """Stamp what an agent of ``kind`` returned in reaction to ``cause``.

    Ids are derived from (kind, cause, index), so a retried or repeated reaction reuses
    them and commits once; decisions carry ``based_on`` = the cause's ``seq``.
    """
    return [
        make_envelope(
            ev,
            run_id=cause.run_id,
            source=source,
            event_id=derived_id(kind, cause.event_id, i),
            caused_by=cause.event_id,
            based_on=cause.seq if isinstance(ev, Decision) else None,
        )
        for i, ev in enumerate(events)
    ]


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, without swallowing a cancellation of
    the caller itself (``suppress(CancelledError)`` around the wait would: a SIGTERM that
    arrives then would be lost and the caller would carry on draining)."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise


class AgentCrashed(RuntimeError):
    """An agent's fold failed; its state cannot be trusted and it must restart from the log."""


class Outbox:
    """Sends envelopes to the archivist until each is acknowledged as committed."""

    def __init__(
        self,
        nc: Client,
        run_id: str,
        *,
        batch: int = 512,
        window: int = 4,
        timeout_s: float = 5.0,
        subject: str | None = None,
    ) -> None:
        self.nc = nc
        self.subject = subject or bus.inbound_subject(run_id)
        self.batch = batch
        self.window = window
        self.timeout_s = timeout_s
        self._pending: deque[Envelope] = deque()
        self._wake = asyncio.Event()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._slots = asyncio.Semaphore(window)
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0
        self.retries = 0
        self.refused = 0

    def put(self, envelopes: Sequence[Envelope]) -> None:
        """Queue envelopes; never blocks."""
        if envelopes:
            self._pending.extend(envelopes)
            self._idle.clear()
            self._wake.set()

    @property
    def backlog(self) -> int:
        """Envelopes queued or in flight."""
        return len(self._pending) + self._inflight

    async def run(self) -> None:
        """Send until cancelled."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    await self._slots.acquire()
                    if not self._pending:
                        self._slots.release()
                        break
                    n = min(self.batch, len(self._pending))
                    chunk = [self._pending.popleft() for _ in range(n)]
                    self._inflight += n
                    t = asyncio.create_task(self._send(chunk))
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)
        finally:
            for t in list(self._tasks):
                t.cancel()

    async def _send(self, chunk: list[Envelope]) -> None:
        payload = _BATCH_ENCODER.encode(chunk)
        delay = 0.05
        try:
            while True:
                try:
                    msg = await self.nc.request(self.subject, payload, timeout=self.timeout_s)
                    reply = _REPLY_DECODER.decode(msg.data)
                    if reply.get("error"):
                        raise RuntimeError(str(reply["error"]))
                    for event_id, reason in reply.get("rejected", []):
                        self.refused += 1
                        log.error("event_refused", event_id=event_id, reason=reason)
                    self.sent += len(chunk)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.retries += 1
                    log.debug("outbox_retry", error=repr(exc), events=len(chunk))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
        finally:
            self._inflight -= len(chunk)
            self._slots.release()
            if not self._pending and self._inflight == 0:
                self._idle.set()

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued is committed; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


async def fetch_range(
    nc: Client, run_id: str, start: int, *, limit: int = 1000, timeout_s: float = 5.0
) -> tuple[int, list[bytes]]:
    """Ask the archivist for committed envelopes from ``start``: ``(head, [bytes…])``."""
    msg = await nc.request(
        bus.fetch_subject(run_id),
        _BATCH_ENCODER.encode({"from": start, "limit": limit}),
        timeout=timeout_s,
    )
    reply = _FETCH_DECODER.decode(msg.data)
    if reply.get("error"):
        raise RuntimeError(f"fetch refused: {reply['error']}")
    return int(reply["head"]), list(reply["events"])


class _FeedClosed(Exception):
    """:meth:`CommittedFeed.close` was called while the feed was fetching."""


class CommittedFeed:
    """Committed envelopes of one run, in ``seq`` order, with no gaps and no repeats."""

    def __init__(self, nc: Client, run_id: str, *, start: int = 1, idle_poll_s: float = 0.5):
        self.nc = nc
        self.run_id = run_id
        self.next_seq = start
        self.idle_poll_s = idle_poll_s
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._early: dict[int, Envelope] = {}
        self._sub: Any = None
        self._closed = False
        self.gaps_filled = 0
        self.bad_messages = 0

    def close(self) -> None:
        """End the iteration within ``idle_poll_s`` (and any fetch retries), whether or not
        a cancellation reaches it: Python 3.11's ``asyncio.wait_for`` can swallow one
        that arrives as its inner wait completes, and a runner stopping then waited on
        the feed for ever (the NATS-restart test's rare hang, reproduced 1 run in 7)."""
        self._closed = True

    async def subscribe(self) -> None:
        """Start buffering live events (call before catching up)."""

        async def on_msg(msg: Msg) -> None:
            self._queue.put_nowait(msg.data)

        self._sub = await self.nc.subscribe(
            bus.log_subject(self.run_id), cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1
        )

    async def unsubscribe(self) -> None:
        """Stop the live subscription."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def catch_up(self) -> list[Envelope]:
        """Everything committed from ``next_seq`` to the current head (advances the feed)."""
        out: list[Envelope] = []
        while True:
            head, batch = await self._fetch(self.next_seq)
            for data in batch:
                env = decode_envelope(data)
                if env.seq == self.next_seq:
                    out.append(env)
                    self.next_seq += 1
            if self.next_seq > head or not batch:
                return out

    async def _fetch(self, start: int) -> tuple[int, list[bytes]]:
        delay = 0.05
        while True:
            if self._closed:
                raise _FeedClosed
            try:
                return await fetch_range(self.nc, self.run_id, start)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("fetch_retry", start=start, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def __aiter__(self) -> AsyncIterator[Envelope]:
        try:
            async for env in self._follow():
                yield env
        except _FeedClosed:
            return

    async def _follow(self) -> AsyncIterator[Envelope]:
        while not self._closed:
            try:
                data = await asyncio.wait_for(self._queue.get(), self.idle_poll_s)
            except TimeoutError:
                for env in await self.catch_up():
                    yield env
                continue
            try:
                env = decode_envelope(data)
            except EventError as exc:
                self.bad_messages += 1
                log.error("bad_committed_message", error=str(exc))
                continue
            if env.seq is None or env.seq < self.next_seq:
                continue
            if env.seq > self.next_seq:
                self._early[env.seq] = env
                self.gaps_filled += 1
                for got in await self.catch_up():
                    self._early.pop(got.seq or 0, None)
                    yield got
            else:
                self.next_seq += 1
                yield env
            while self.next_seq in self._early:
                nxt = self._early.pop(self.next_seq)
                self.next_seq += 1
                yield nxt
            for stale in [s for s in self._early if s < self.next_seq]:
                del self._early[stale]


class AgentRunner:
    """Runs one :class:`~kf.agent.Agent` against a run: catch-up, live events, drain."""

    def __init__(self, agent: Agent[Any], nc: Client, *, react_to_history: bool = True) -> None:
        self.agent = agent
        self.ctx: AgentContext = agent.ctx
        self.nc = nc
        self.react_to_history = react_to_history
        # an agent that speaks for a device (it has a ``device_id``) sends on that device's
        # intake, the only subject its credentials may publish on (kf.auth)
        device = getattr(agent, "device_id", None)
        # ... and its event ids lie in that device's id space (kf.events.device_id_prefix)
        self.device: str | None = device if isinstance(device, str) else None
        self.outbox = Outbox(
            nc,
            self.ctx.run_id,
            subject=bus.intake_subject(
                self.ctx.run_id, device if isinstance(device, str) else None
            ),
        )
        self.state: Any = agent.initial_state()
        self.folded = 0  # last seq folded
        self.reactions_failed = 0
        self._sem = asyncio.Semaphore(max(1, agent.concurrency))
        self._reactions: set[asyncio.Task[None]] = set()
        self._cut: list[Record] = []  # reactions cancelled before they answered
        self.ctx.emit = self._emit_spontaneous
        self.log = self.ctx.log
        # an agent that talks on the bus itself (a mutator asking devices to run tools)
        bind = getattr(agent, "bind_bus", None)
        if callable(bind):
            bind(nc)

    # -- emitting --------------------------------------------------------------------

    def _emit_spontaneous(self, ev: Event, *, event_id: str | None = None) -> None:
        if self.device is not None:
            event_id = device_event_id(self.device, event_id)
        self.outbox.put(
            [make_envelope(ev, run_id=self.ctx.run_id, source=self.ctx.agent_id, event_id=event_id)]
        )

    def envelopes_for(self, rec: Record, events: Sequence[Event]) -> list[Envelope]:
        """Stamp the events a reaction returned (see :func:`reaction_envelopes`), in the
        id space of the device the agent speaks for, if any."""
        envs = reaction_envelopes(self.agent.kind, self.ctx.agent_id, rec.envelope, events)
        if self.device is None:
            return envs
        return [
            msgspec.structs.replace(e, event_id=device_event_id(self.device, e.event_id))
            for e in envs
        ]

    # -- folding and reacting ----------------------------------------------------------

    def _fold(self, env: Envelope) -> Record | None:
        self.folded = env.seq or self.folded
        if not self.agent.listens_to(env.type):
            return None
        try:
            rec = Record(env, decode_event(env))
        except EventError as exc:
            self.log.error("undecodable_committed_event", seq=env.seq, error=str(exc))
            return None
        try:
            self.state = self.agent.evolve(self.state, rec)
        except Exception as exc:
            raise AgentCrashed(
                f"{self.agent.kind}: evolve failed on seq {env.seq} ({env.type}): {exc!r}"
            ) from exc
        return rec

    async def _react(self, state: Any, rec: Record) -> None:
        try:
            out = self.agent.react(state, rec)
            events = await out if inspect.isawaitable(out) else out
            if shutdown.stopping():  # it may rest on processes the stop killed
                self._cut.append(rec)
                return
            self.outbox.put(self.envelopes_for(rec, list(events)))
        except asyncio.CancelledError:
            self._cut.append(rec)
            raise
        except Exception as exc:
            if shutdown.stopping():
                self._cut.append(rec)
                return
            self.reactions_failed += 1
            self.log.error("react_failed", seq=rec.seq, event_type=rec.envelope.type, exc_info=True)
            failure = ReactionFailed(
                kind=self.agent.kind,
                agent_id=self.ctx.agent_id,
                event_type=rec.envelope.type,
                error=repr(exc)[:2000],
                traceback=traceback.format_exc()[-8000:],
            )
            self.outbox.put(self.envelopes_for(rec, [failure]))
        finally:
            self._sem.release()

    async def _schedule(self, rec: Record) -> None:
        await self._sem.acquire()
        if self.agent.concurrency <= 1:
            await self._react(self.state, rec)
            return
        t = asyncio.create_task(self._react(self.state, rec))
        self._reactions.add(t)
        t.add_done_callback(self._reactions.discard)

    # -- lifecycle ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Start, catch up, set ``ready``, follow the log until ``stop``, then drain."""
        structlog.contextvars.bind_contextvars(agent=self.ctx.agent_id, run=self.ctx.run_id)
        outbox_task = asyncio.create_task(self.outbox.run())
        feed = CommittedFeed(self.nc, self.ctx.run_id)
        try:
            await feed.subscribe()
            await self.agent.on_start()
            self._emit_spontaneous(
                AgentStarted(kind=self.agent.kind, agent_id=self.ctx.agent_id, pid=_pid())
            )
            history = await feed.catch_up()
            answered = {
                e.caused_by
                for e in history
                if e.caused_by is not None and e.source_kind == self.agent.kind
            }
            for env in history:
                rec = self._fold(env)
                if rec is not None and self.react_to_history and env.event_id not in answered:
                    await self._schedule(rec)
            self.log.info("agent_ready", folded=self.folded, caught_up=len(history))
            if ready is not None:
                ready.set()
            stop_wait = asyncio.create_task(stop.wait())
            it = feed.__aiter__()
            nxt: asyncio.Future[Envelope] | None = None
            try:
                while not stop.is_set():
                    nxt = asyncio.ensure_future(it.__anext__())
                    done, _ = await asyncio.wait(
                        {nxt, stop_wait}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if nxt not in done:
                        feed.close()  # ends it even if the cancel below is swallowed
                        nxt.cancel()
                        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                            await nxt
                        break
                    rec = self._fold(nxt.result())
                    if rec is not None:
                        await self._schedule(rec)
            finally:
                stop_wait.cancel()
                if nxt is not None and not nxt.done():
                    feed.close()
                    nxt.cancel()
                with contextlib.suppress(Exception):
                    await it.aclose()  # type: ignore[attr-defined]
            await self._drain()
        except asyncio.CancelledError:
            # in a task of its own: this one is being cancelled, and what the clean-up
            # awaits (cancel_and_wait in on_stop) would end at once
            cleanup = asyncio.create_task(self._interrupted())
            await asyncio.wait({cleanup}, timeout=INTERRUPT_S)
            raise
        finally:
            await feed.unsubscribe()
            await cancel_and_wait(outbox_task)

    async def _interrupted(self) -> None:
        """The runner was cancelled (a signal, or the run ending on an error): cut the
        reactions in flight short (a stage's thread is left to the process's stop,
        :mod:`kf.shutdown`) and record which events' reactions were cut short in
        ``agent.stopped`` (reason ``interrupted: …``). None of them was answered, so an
        agent of this kind reacts to them again when the run resumes (catch-up
        re-reacts to what its kind has not answered): an evaluation cut short is redone,
        never recorded as the candidate's failure.

        ``on_stop`` is not called: it is a drained agent's (a hardware agent's says
        ``device.left``, after which the archive re-dispatches the device's candidates,
        and a resumed run evaluated each cut-short one twice, once on catch-up and once
        re-dispatched). An interrupted worker's device is left to the heartbeat timeout,
        as a killed one's is."""
        for t in list(self._reactions):
            t.cancel()
        if self._reactions:
            await asyncio.wait(self._reactions, timeout=0.5)
        cut = sorted({r.seq or 0: r for r in self._cut}.values(), key=lambda r: r.seq or 0)
        self._emit_spontaneous(
            AgentStopped(kind=self.agent.kind, agent_id=self.ctx.agent_id, reason=interrupted(cut))
        )
        if not await self.outbox.flush(timeout_s=1.0):  # the bus may be what died
            self.log.info("outbox_not_flushed", backlog=self.outbox.backlog)
        self.log.info("agent_interrupted", folded=self.folded, cut=len(cut))

    async def _drain(self) -> None:
        await self.agent.on_drain()
        if self._reactions:
            await asyncio.gather(*self._reactions, return_exceptions=True)
        await self.agent.on_stop()
        self._emit_spontaneous(AgentStopped(kind=self.agent.kind, agent_id=self.ctx.agent_id))
        if not await self.outbox.flush(timeout_s=10.0):
            self.log.error("outbox_not_flushed", backlog=self.outbox.backlog)
        self.log.info("agent_drained", folded=self.folded, failed=self.reactions_failed)


def interrupted(cut: Sequence[Record]) -> str:
    """``agent.stopped``'s reason when reactions were cut short: ``interrupted``, then
    the events whose reactions were (``type #seq``, with the candidate where there is one)."""
    if not cut:
        return "interrupted"
    parts = []
    for rec in cut:
        candidate = getattr(rec.event, "candidate_id", None)
        parts.append(f"{rec.envelope.type} #{rec.seq}" + (f" ({candidate})" if candidate else ""))
    return "interrupted: cut short, redone on resume: " + ", ".join(parts)


def _pid() -> int:
    import os

    return os.getpid()


async def supervise(
    make: Callable[[], Any],
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    *,
    max_restarts: int = 3,
    name: str = "agent",
) -> None:
    """Run ``make().run(stop, ready)``; restart after :class:`AgentCrashed`, with backoff.

    After ``max_restarts`` crashes the last error propagates (the process exits non-zero).
    """
    crashes = 0
    while True:
        runnable = make()
        try:
            await runnable.run(stop, ready)
            return
        except AgentCrashed as exc:
            crashes += 1
            log.error("agent_crashed", agent=name, crashes=crashes, error=str(exc))
            if crashes > max_restarts:
                raise
            await asyncio.sleep(min(0.2 * 2**crashes, 5.0))
