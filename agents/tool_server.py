"""Where a mutator's tools run: on the worker that hosts a device, over NATS request/reply.

A tool-using episode (``agents.tool_mutator``) or a coding agent's ``check`` script
(``agents.cli_mutator``) must run candidates where a device of the run is, in that
device's sandboxed runners, beside the pipeline's own work. Each worker (``kf worker``,
or the local worker of ``kf run``) therefore serves tool requests for its device on
``kf.<run>.tool.<device>`` (:class:`ToolServer`); a mutator anywhere sends requests with
:class:`BusTools` and gets the answer on ``kf.<run>.toolreply.<device>.<nonce>``, a
subject only that device's worker may publish on (:mod:`kf.auth`). Compiling and checking
share the device with the pipeline's builds and verifications; timing and counters wait
for the device to themselves (the worker's :class:`~kf.devices.gate.DeviceGate`).

The server is not an agent: it records nothing (the mutator records every tool result as
``episode.tool_called``). A request carries the task's source; the task runs, like the
candidate, only in the box. What the server does read of the log is the run's start
(``run.started``, fetched from the archivist once, at the first request): a tool grades
at the run's recorded tolerance and under its recorded measuring conditions (TF32, where
inputs are made, the compiled baseline's mode), as the pipeline's own stages do, never
under this worker process's settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from typing import Any

import msgspec
import structlog

from kf import bus
from kf.devices.gate import gate_for
from kf.evaluation.grader.baseline_settings import BaselineSettingError, Conditions
from kf.evaluation.wire.tolerance import Tolerance
from kf.events import EventError, decode_envelope, decode_event
from kf.facts import RunStarted
from kf.llm.tools import DEVICE_TOOLS, ToolReply, run_device_tool
from kf.runtime import fetch_range

__all__ = ["BusTools", "RunUnknown", "ToolServer", "run_started"]

log = structlog.get_logger("kf.tools")

_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(dict[str, Any])


class RunUnknown(Exception):
    """The run's start could not be read from its log (not committed yet, no archivist
    answering, or a recorded config kf cannot use)."""


async def run_started(nc: Any, run_id: str, *, batch: int = 32) -> RunStarted:
    """The run's ``run.started``, read from the archivist's committed log (it is the
    first event of a run's log, or among the first few: agents that started early may
    have recorded theirs before it); :class:`RunUnknown` when the log does not hold it."""
    start = 1
    while True:
        try:
            head, events = await fetch_range(nc, run_id, start, limit=batch)
        except Exception as exc:  # no archivist answering, a refusal
            raise RunUnknown(f"the run's log could not be read: {exc}") from exc
        for data in events:
            try:
                env = decode_envelope(data)
                ev = decode_event(env) if env.type == RunStarted.tag else None
            except EventError as exc:
                raise RunUnknown(f"the run's log holds an unreadable event: {exc}") from exc
            if isinstance(ev, RunStarted):
                return ev
        start += len(events)
        if not events or start > head:
            raise RunUnknown(f"run {run_id!r} has not started: its log holds no run.started")


class ToolServer:
    """Answers tool requests for one device of a run until ``stop``."""

    def __init__(
        self,
        nc: Any,
        run_id: str,
        device: str,
        device_id: str,
        *,
        concurrency: int = 4,
        timeout_s: float = 300.0,
    ) -> None:
        self.nc = nc
        self.run_id = run_id
        self.device = device
        self.device_id = device_id
        self.timeout_s = timeout_s
        self.served = 0
        self._slots = asyncio.Semaphore(max(1, concurrency))
        self._tasks: set[asyncio.Task[None]] = set()
        self._measuring: tuple[Tolerance, Conditions] | None = None

    async def measuring(self) -> tuple[Tolerance, Conditions]:
        """The run's recorded tolerance and measuring conditions (from its ``run.started``,
        read once); :class:`RunUnknown` when they cannot be read."""
        if self._measuring is None:
            config = (await run_started(self.nc, self.run_id)).run_config()
            try:
                self._measuring = (Tolerance.of(config), Conditions.of(config))
            except (BaselineSettingError, TypeError, ValueError) as exc:
                raise RunUnknown(f"the run's recorded config is not usable: {exc}") from exc
        return self._measuring

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Subscribe, serve, and on ``stop`` finish the requests being served."""
        sub = await self.nc.subscribe(bus.tool_subject(self.run_id, self.device_id), cb=self._on)
        await self.nc.flush()
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on(self, msg: Any) -> None:
        t = asyncio.create_task(self._serve(msg))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _serve(self, msg: Any) -> None:
        prefix = bus.tool_reply_subject(self.run_id, self.device_id, "")
        if not msg.reply or not msg.reply.startswith(prefix):
            log.warning("tool_request_without_valid_reply", reply=msg.reply)
            return
        try:
            req = _DEC.decode(msg.data)
            tool = str(req["tool"])
            if tool not in DEVICE_TOOLS:
                raise ValueError(f"unknown tool {tool!r}")
            args = (str(req["task"]), str(req["task_source"]), str(req["source"]))
            seed = int(req.get("seed", 0))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            await self._refuse(msg.reply, f"bad tool request: {exc}", str(exc))
            return
        try:
            tolerance, conditions = await self.measuring()
        except RunUnknown as exc:  # graded under this process's settings, it would mislead
            await self._refuse(msg.reply, f"the tool cannot run yet: {exc}", str(exc))
            return
        async with self._slots:
            gate = gate_for(self.device)
            label = f"tool:{tool}"
            timed = tool in ("time", "counters")
            hold = await (gate.exclusive(label) if timed else gate.shared(label))
            async with hold:
                reply = await asyncio.to_thread(
                    run_device_tool,
                    tool,
                    *args,
                    device=self.device,
                    seed=seed,
                    timeout_s=min(self.timeout_s, float(req.get("timeout_s", self.timeout_s))),
                    device_id=self.device_id,
                    tolerance=tolerance,
                    conditions=conditions,
                )
        self.served += 1
        with contextlib.suppress(Exception):
            await self.nc.publish(msg.reply, _ENC.encode(reply.wire()))

    async def _refuse(self, reply_to: str, text: str, error: str) -> None:
        """Answer a request that runs no tool with why."""
        reply = ToolReply(ok=False, text=text, error=error, ran_on=self.device_id)
        with contextlib.suppress(Exception):
            await self.nc.publish(reply_to, _ENC.encode(reply.wire()))


class BusTools:
    """Asks a device's :class:`ToolServer` to run a tool; the answer or a reply saying
    why there is none (no answer within the timeout, a garbled answer)."""

    def __init__(self, nc: Any, run_id: str) -> None:
        self.nc = nc
        self.run_id = run_id

    async def run(
        self,
        device_id: str,
        tool: str,
        task: str,
        task_source: str,
        source: str,
        *,
        seed: int,
        timeout_s: float,
    ) -> ToolReply:
        """One request/reply to ``device_id``'s worker; a request that found no worker
        listening is sent again twice, a quarter of a second apart (a worker that has just
        subscribed, or reconnected after the server restarted, may not be known yet: CI
        saw one "no responders" right after a flushed subscription)."""
        request = _ENC.encode(
            {
                "tool": tool,
                "task": task,
                "task_source": task_source,
                "source": source,
                "seed": seed,
                "timeout_s": timeout_s,
            }
        )
        for attempt in range(3):
            reply = await self._once(device_id, request, timeout_s)
            if reply.error != "no responders" or attempt == 2:
                break
            await asyncio.sleep(0.25)
        return reply

    async def _once(self, device_id: str, request: bytes, timeout_s: float) -> ToolReply:
        """``request`` sent once to ``device_id``'s worker, and its answer."""
        reply_to = bus.tool_reply_subject(self.run_id, device_id, secrets.token_hex(8))
        sub = await self.nc.subscribe(reply_to, max_msgs=1)
        try:
            await self.nc.publish(bus.tool_subject(self.run_id, device_id), request, reply=reply_to)
            # the worker may queue it behind the device's timing; allow for that
            msg = await sub.next_msg(timeout=timeout_s * 2 + 30)
        except TimeoutError:
            return ToolReply(
                ok=False,
                text=f"the tool got no answer from device {device_id} in time",
                error="no answer",
                ran_on=device_id,
            )
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if not msg.data:  # the server's "no responders" status: no worker serves that device
            return ToolReply(
                ok=False,
                text=f"no worker serves tools for device {device_id}",
                error="no responders",
                ran_on=device_id,
            )
        try:
            # the reply subject is the device's own (kf.auth): it speaks for that device
            return dataclasses.replace(ToolReply.from_wire(_DEC.decode(msg.data)), ran_on=device_id)
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            return ToolReply(
                ok=False, text="the tool's answer was garbled", error=str(exc), ran_on=device_id
            )
