"""The archivist: the log's single writer, and host of the archive's decision agents.

It receives batches of envelopes on ``kf.R.in`` and on each device's ``kf.R.in.dev.<D>``,
validates each one (bad ones go to the log's ``rejected`` table, are counted and logged;
the rest of the batch is unaffected), refuses — the same way — what the sender is not
entitled to say (:class:`kf.auth.Entitlements`: a device's observations only on that
device's subject, a stage result only for an attempt assigned to that device, no
decisions from outside),
deduplicates by ``event_id``, commits in one transaction, lets the hosted agents (the
MAP-Elites archive and selection) fold the committed events and append their decisions,
replies to the producers, and publishes every committed envelope on ``kf.R.log`` in
``seq`` order. It also serves committed ranges on ``kf.R.fetch``.

Restart: the log is the state. On start the archivist folds the whole log into its hosted
agents and answers any event they had not yet answered, then serves again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from kf import bus
from kf.agent import Agent, AgentContext
from kf.auth import Entitlements
from kf.events import (
    Envelope,
    EventError,
    Record,
    decode_envelope,
    decode_event,
    encode_envelope,
    make_envelope,
)
from kf.facts import DeviceLost
from kf.log import EventLog, LogBusy
from kf.runtime import AgentCrashed, cancel_and_wait, reaction_envelopes

__all__ = ["Archivist", "ArchivistStats"]

log = structlog.get_logger("kf.archivist")

_ENC = msgspec.msgpack.Encoder()
_BATCH = msgspec.msgpack.Decoder(list[msgspec.Raw])
_FETCH = msgspec.msgpack.Decoder(dict[str, Any])
_MAX_FETCH_BYTES = 768 * 1024


class _NotIntake(ValueError):
    """A batch on a subject that is no intake of this run."""


class _Local:
    """Envelopes the archivist observed itself (a device gone silent), queued for commit."""

    def __init__(self, envelopes: list[Envelope]) -> None:
        self.envelopes = envelopes


_DEVICE_ALIVE = ("device.announced", "device.heartbeat")
_DEVICE_GONE = ("device.left", "device.lost")


class ArchivistStats(msgspec.Struct, kw_only=True):
    """Counters, for logs and tests."""

    committed: int = 0
    duplicates: int = 0
    rejected: int = 0  # invalid bytes or envelopes, and refusals (below)
    refused: int = 0  # valid events their sender was not entitled to send
    batches: int = 0
    decisions: int = 0
    busy_waits: int = 0  # commits retried while another connection held the write lock


class Archivist:
    """Single writer of the run's log; hosts pure decision agents that fold it."""

    kind = "archivist"

    def __init__(
        self,
        ctx: AgentContext,
        *,
        db: str | Path | None = None,
        hosted: Sequence[type[Agent[Any]]] = (),
        nc: Client | None = None,
    ) -> None:
        self.ctx = ctx
        db = db or ctx.options.get("db")
        if not db:
            raise ValueError("the archivist needs a log path (--db)")
        self.db_path = Path(db)
        self.nc = nc
        self.hosted_types = tuple(hosted)
        self.stats = ArchivistStats()
        self.log_: EventLog | None = None
        self._queue: asyncio.Queue[Msg | _Local] = asyncio.Queue()
        self._last_seen: dict[str, float] = {}  # device → monotonic time last heard
        self.heartbeat_timeout_s = float(ctx.options.get("heartbeat_timeout_s", 30.0))
        # a device holding candidates that answers none of them for this long is lost, even
        # while it heartbeats (issue 43, NX9); 0: never
        self.assignment_timeout_s = float(ctx.options.get("assignment_timeout_s", 0.0) or 0.0)
        self._given: dict[tuple[str, int], float] = {}  # (candidate, attempt) → when assigned
        self._answered: dict[str, float] = {}  # device → when it last answered its work
        self._hosted: list[tuple[Agent[Any], Any]] = []
        self._busy = False  # waiting for another connection's write lock
        self.entitlements = Entitlements()

    # -- hosted agents -------------------------------------------------------------------

    async def _start_hosted(self, elog: EventLog) -> None:
        """Fold the whole log into the hosted agents; answer what they had not answered."""
        agents = [
            cls(AgentContext(run_id=self.ctx.run_id, agent_id=self.ctx.agent_id))
            for cls in self.hosted_types
        ]
        for a in agents:
            if not a.decides:
                raise TypeError(f"hosted agent {a.kind} must be a pure decision agent")
        states = [a.initial_state() for a in agents]
        answered: set[tuple[str, str]] = set()
        history: list[Envelope] = []
        for env in elog.read():
            history.append(env)
            self._track_device(env)
            self.entitlements.fold(env)
            if env.caused_by is not None:
                answered.add((env.source_kind, env.caused_by))
        self._hosted = list(zip(agents, states, strict=True))
        pending: list[Envelope] = []
        for env in history:
            pending.extend(self._fold_hosted(env, answered))
        for env in await self._commit_decisions(elog, pending, answered):
            self.entitlements.fold(env)

    def _fold_hosted(
        self, env: Envelope, answered: set[tuple[str, str]] | None = None
    ) -> list[Envelope]:
        """Fold one committed envelope into every hosted agent; return their decisions."""
        out: list[Envelope] = []
        rec: Record | None = None
        for i, (agent, before) in enumerate(self._hosted):
            if not agent.listens_to(env.type):
                continue
            try:
                if rec is None:
                    rec = Record(env, decode_event(env))
                state = agent.evolve(before, rec)
                self._hosted[i] = (agent, state)
                if answered is not None and (agent.kind, env.event_id) in answered:
                    continue
                events = agent.react(state, rec)
            except Exception as exc:
                raise AgentCrashed(
                    f"hosted {agent.kind} failed on seq {env.seq} ({env.type}): {exc!r}"
                ) from exc
            assert isinstance(events, Sequence), f"{agent.kind}.react must be synchronous"
            source = f"{agent.kind}@{self.ctx.agent_id.partition('@')[2]}"
            out.extend(reaction_envelopes(agent.kind, source, env, events))
        return out

    async def _commit_decisions(
        self,
        elog: EventLog,
        pending: list[Envelope],
        answered: set[tuple[str, str]] | None = None,
    ) -> list[Envelope]:
        """Append decisions, fold them back in, and repeat until the agents are quiet."""
        committed: list[Envelope] = []
        while pending:
            new = await self._append(elog, pending)
            self.stats.decisions += len(new)
            committed.extend(new)
            pending = []
            for env in new:
                pending.extend(self._fold_hosted(env, answered))
        return committed

    async def _append(self, elog: EventLog, envelopes: list[Envelope]) -> list[Envelope]:
        """Commit; while another connection (a user's sqlite shell) holds the database's
        write lock, wait without blocking the loop and retry — nothing is lost meanwhile."""
        started = time.monotonic()
        delay, warned = 0.05, -1.0
        while True:
            try:
                committed = elog.append(envelopes)
            except LogBusy as exc:
                self.stats.busy_waits += 1
                self._busy = True
                waited = time.monotonic() - started
                if waited - warned >= 10.0 or warned < 0:
                    warned = waited
                    log.warning("log_busy", waited_s=round(waited, 1), error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if self._busy:
                self._busy = False
                now = time.monotonic()
                self._last_seen = dict.fromkeys(self._last_seen, now)
                self._given = dict.fromkeys(self._given, now)
                self._answered = dict.fromkeys(self._answered, now)
                log.warning("log_busy_over", waited_s=round(now - started, 1))
            return committed

    def _track_device(self, env: Envelope) -> None:
        if env.type == "search.candidate_assigned" or (
            env.type.startswith("kernel.candidate_") and env.type != "kernel.candidate_proposed"
        ):
            self._track_work(env)
            return
        if env.type in _DEVICE_ALIVE or env.type in _DEVICE_GONE:
            device = getattr(decode_event(env), "device_id", None)
            if device is None:
                return
            if env.type in _DEVICE_ALIVE:
                self._last_seen[device] = time.monotonic()
            else:
                self._last_seen.pop(device, None)

    def _track_work(self, env: Envelope) -> None:
        """When each attempt was given out, and when each device last answered its work
        (a stage result: compiled, verified, rejected, profiled)."""
        ev = decode_event(env)
        device = getattr(ev, "device_id", None)
        if not isinstance(device, str):
            return
        now = time.monotonic()
        if env.type == "search.candidate_assigned":
            self._given[(str(getattr(ev, "candidate_id", "")), int(getattr(ev, "attempt", 0)))] = (
                now
            )
        else:
            self._answered[device] = now

    def _unanswered(self, now: float) -> list[DeviceLost]:
        """Devices that hold candidates and have answered none of them for longer than the
        assignment timeout: each is lost (its candidates go elsewhere), with the reason.
        What a device holds is the archive's own fold (its candidates in flight there)."""
        timeout = self.assignment_timeout_s
        archive = next((st for a, st in self._hosted if a.kind == "archive"), None)
        if timeout <= 0 or archive is None:
            return []
        held: dict[str, list[tuple[str, int]]] = {}
        for c in getattr(archive, "candidates", {}).values():
            if c.in_flight and c.device_id is not None:
                held.setdefault(c.device_id, []).append((c.id, c.attempt))
        lost: list[DeviceLost] = []
        for device, work in sorted(held.items()):
            given = min(self._given.setdefault(k, now) for k in work)
            since = max(given, self._answered.get(device, given))
            if now - since <= timeout:
                continue
            self._answered[device] = now  # once: the loss is committed before the next look
            silent = round(now - since, 1)
            first = min(work, key=lambda k: self._given[k])
            reason = (
                f"no answer to its {len(work)} assignment(s) (candidate {first[0][:12]} "
                f"attempt {first[1]} the oldest) for {silent:g} s, past the assignment "
                f"timeout of {timeout:g} s, while it still heartbeats: its work goes to "
                "other devices"
            )
            log.warning("device_unanswering", device=device, silent_s=silent, held=len(work))
            lost.append(DeviceLost(device_id=device, silent_s=silent, reason=reason))
        return lost

    async def _watchdog(self, nc: Client | None = None) -> None:
        """Record ``device.lost`` for a device silent longer than the heartbeat timeout, or
        holding candidates it has answered none of for longer than the assignment timeout.

        The silence is an observation (wall clock, made here); what follows from it — the
        re-dispatch of that device's candidates — is the archive's decision. While the
        archivist itself is cut off from NATS it hears no one, so nothing is declared lost
        then, and every device's clock starts again when the connection is back.
        """
        timeout = self.heartbeat_timeout_s
        cut_off = False
        while True:
            await asyncio.sleep(max(0.1, min(timeout / 4, 1.0)))
            now = time.monotonic()
            if self._busy:  # their heartbeats wait in our queue: the silence is ours
                continue
            if nc is not None and not nc.is_connected:
                cut_off = True
                continue
            if cut_off:
                cut_off = False
                for device in self._last_seen:
                    self._last_seen[device] = now
                self._given = dict.fromkeys(self._given, now)
                self._answered = dict.fromkeys(self._answered, now)
                continue
            for lost in self._unanswered(now):
                env = make_envelope(lost, run_id=self.ctx.run_id, source=self.ctx.agent_id)
                self._queue.put_nowait(_Local([env]))
            for device, seen in sorted(self._last_seen.items()):
                if now - seen > timeout:
                    del self._last_seen[device]
                    log.warning("device_lost", device=device, silent_s=round(now - seen, 1))
                    lost = DeviceLost(device_id=device, silent_s=round(now - seen, 1))
                    env = make_envelope(lost, run_id=self.ctx.run_id, source=self.ctx.agent_id)
                    self._queue.put_nowait(_Local([env]))

    def hosted_states(self) -> dict[str, Any]:
        """Current hosted states by kind (for tests and reports)."""
        return {a.kind: s for a, s in self._hosted}

    # -- serving -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Open the log, fold it, serve until ``stop``, then finish the queued batches."""
        structlog.contextvars.bind_contextvars(agent=self.ctx.agent_id, run=self.ctx.run_id)
        elog = EventLog(self.db_path)
        self.log_ = elog
        own_nc = self.nc is None
        nc = self.nc
        if nc is None:
            url = self.ctx.options.get("nats_url")
            if not url:
                raise ValueError("the archivist needs a NATS URL")
            nc = await bus.connect(bus.BusOptions.from_env(url, name=self.ctx.agent_id))
        try:
            await self._start_hosted(elog)
            in_subs = [
                await nc.subscribe(
                    subject, cb=self._on_inbound, pending_msgs_limit=-1, pending_bytes_limit=-1
                )
                for subject in bus.intake_subjects(self.ctx.run_id)
            ]
            fetch_sub = await nc.subscribe(bus.fetch_subject(self.ctx.run_id), cb=self._on_fetch)
            await nc.flush()
            log.info("archivist_ready", db=str(self.db_path), head=elog.head)
            if ready is not None:
                ready.set()
            writer = asyncio.create_task(self._writer(nc, elog))
            watchdog = asyncio.create_task(self._watchdog(nc))
            stopping = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({writer, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if writer.done():
                    writer.result()  # a failed writer propagates: the log cannot be served
                for sub in in_subs:
                    await sub.unsubscribe()
                # let what already arrived be committed and answered
                try:
                    await asyncio.wait_for(self._queue.join(), 30)
                except TimeoutError:
                    log.error("archivist_drain_timeout", queued=self._queue.qsize())
                await fetch_sub.unsubscribe()
            finally:
                stopping.cancel()
                watchdog.cancel()
                await cancel_and_wait(writer)
        finally:
            log.info("archivist_stopped", **msgspec.structs.asdict(self.stats), head=elog.head)
            elog.close()
            if own_nc:
                await bus.close(nc)

    async def _on_inbound(self, msg: Msg) -> None:
        self._queue.put_nowait(msg)

    async def _on_fetch(self, msg: Msg) -> None:
        elog = self.log_
        assert elog is not None
        try:
            req = _FETCH.decode(msg.data)
            start = int(req.get("from", 1))
            limit = max(0, min(int(req.get("limit", 1000)), 5000))
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            self.stats.rejected += 1
            log.warning("bad_fetch_request", error=str(exc))
            if _answerable(msg):
                await msg.respond(_ENC.encode({"error": f"bad fetch request: {exc}"}))
            return
        events: list[bytes] = []
        size = 0
        if limit:
            for body in elog.read_raw(start, start + limit - 1):
                size += len(body)
                if events and size > _MAX_FETCH_BYTES:
                    break
                events.append(body)
        if _answerable(msg):
            await msg.respond(_ENC.encode({"head": elog.head, "events": events}))

    def _validate(
        self, subject: str, device: str | None, raw: bytes, elog: EventLog
    ) -> Envelope | tuple[str, str]:
        """The envelope, or ``(event id, reason)`` for one that is kept out of the log."""
        event_id = ""
        try:
            env = decode_envelope(raw)
            event_id = env.event_id
            if env.run_id != self.ctx.run_id:
                raise EventError(f"event for run {env.run_id!r} sent to run {self.ctx.run_id!r}")
            if env.seq is not None:
                raise EventError("inbound events must not carry a seq (only the log assigns it)")
            ev = decode_event(env)  # known types must match their schema
        except EventError as exc:
            self.stats.rejected += 1
            log.warning("event_rejected", subject=subject, reason=str(exc), size=len(raw))
            elog.reject(subject, str(exc), raw)
            return event_id, str(exc)
        refusal = self.entitlements.check(device, env, ev)
        if refusal is not None:
            reason = f"refused: {refusal}"
            self.stats.rejected += 1
            self.stats.refused += 1
            log.warning("event_refused", subject=subject, event_id=event_id, reason=reason)
            elog.reject(subject, reason, raw)
            return event_id, reason
        return env

    async def _writer(self, nc: Client, elog: EventLog) -> None:
        while True:
            msgs = [await self._queue.get()]
            while not self._queue.empty() and len(msgs) < 256:
                msgs.append(self._queue.get_nowait())
            try:
                await self._commit_batch(nc, elog, msgs)
            finally:
                for _ in msgs:
                    self._queue.task_done()

    async def _commit_batch(self, nc: Client, elog: EventLog, msgs: list[Msg | _Local]) -> None:
        """Validate, commit, let hosted agents decide, reply, publish — one batch."""
        accepted: list[Envelope] = []
        replies: list[tuple[Msg, list[tuple[str, str]]]] = []
        for msg in msgs:
            if isinstance(msg, _Local):
                accepted.extend(msg.envelopes)
                continue
            refused: list[tuple[str, str]] = []
            is_intake, device = bus.intake_device(self.ctx.run_id, msg.subject)
            try:
                items = _BATCH.decode(msg.data)
                if not is_intake:
                    raise _NotIntake(f"{msg.subject} names no device (not a device token)")
            except (msgspec.DecodeError, msgspec.ValidationError, _NotIntake) as exc:
                self.stats.rejected += 1
                reason = (
                    f"refused: {exc}"
                    if isinstance(exc, _NotIntake)
                    else f"not a batch of kf envelopes: {exc}"
                )
                log.warning("message_rejected", subject=msg.subject, reason=reason)
                elog.reject(msg.subject, reason, msg.data)
                refused.append(("", reason))
                replies.append((msg, refused))
                continue
            for raw in items:
                got = self._validate(msg.subject, device, bytes(raw), elog)
                if isinstance(got, Envelope):
                    accepted.append(got)
                else:
                    refused.append(got)
            replies.append((msg, refused))
        self.stats.batches += 1
        committed = await self._append(elog, accepted)
        for env in committed:
            self._track_device(env)
        self.stats.duplicates += len(accepted) - len(committed)
        self.stats.committed += len(committed)
        pending: list[Envelope] = []
        for env in committed:
            pending.extend(self._fold_hosted(env))
        committed.extend(await self._commit_decisions(elog, pending))
        for env in committed:
            self.entitlements.fold(env)
        # Replies and publications are best effort: a producer that misses its reply
        # retries (and is deduplicated); a subscriber that misses an event fills the gap.
        for msg, refused in replies:
            if _answerable(msg):
                try:
                    await msg.respond(_ENC.encode({"ok": True, "rejected": refused}))
                except Exception as exc:
                    log.info("reply_failed", error=repr(exc))
        subject = bus.log_subject(self.ctx.run_id)
        for env in committed:
            try:
                await nc.publish(subject, encode_envelope(env))
            except Exception as exc:
                log.info("publish_failed", seq=env.seq, error=repr(exc))


def _answerable(msg: Msg) -> bool:
    """Whether to answer ``msg``: it asks for a reply, and not on a kf subject (a reply
    there would be published with the archivist's rights, e.g. onto the committed log)."""
    return bool(msg.reply) and not msg.reply.startswith("kf.")
