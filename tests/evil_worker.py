"""A worker that lies about its own assignments (``python -m tests.evil_worker``).

It holds a worker's own, valid credentials (device ``DEVICE``): it announces a CPU device,
sends heartbeats, and for every candidate the archive assigns to it reports, at once and
without running anything, that the candidate compiled, is correct and is 77 times faster
than the reference. Every message is entitled (its own device, its own assignments): only
a measurement that does not rely on it can catch the lie (agents/archive.py,
``ConfirmationRequested``). It runs until killed and prints one line per lie.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import msgspec
import nats

from kf import bus
from kf.evaluation.grader.reports import CompileReport, ProfileReport, VerifyReport
from kf.events import Event, decode_envelope, decode_event, make_envelope
from kf.facts import DeviceAnnounced, DeviceHeartbeat
from kf.search_facts import (
    CandidateAssigned,
    CandidateCompiled,
    CandidateProfiled,
    CandidateVerified,
)

SPEEDUP = 77.0


async def main(url: str, run: str, user: str, password: str, me: str) -> None:
    nc = await nats.connect(url, user=user, password=password)
    intake = bus.device_inbound_subject(run, me)
    assigned: asyncio.Queue[CandidateAssigned] = asyncio.Queue()

    async def send(*events: Event) -> None:
        envs = [make_envelope(ev, run_id=run, source=f"evil@{me}") for ev in events]
        while True:  # until the run's archivist is there to answer
            try:
                await nc.request(intake, msgspec.msgpack.encode(envs), timeout=5)
                return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.2)

    async def on_log(msg: Any) -> None:
        env = decode_envelope(msg.data)
        if env.type == CandidateAssigned.tag:
            ev = decode_event(env)
            assert isinstance(ev, CandidateAssigned)
            if ev.device_id == me:
                assigned.put_nowait(ev)

    await nc.subscribe(bus.log_subject(run), cb=on_log)
    caps = {"backends": ["cpp-openmp", "cpp-load-inline"]}
    await send(DeviceAnnounced(device_id=me, kind="cpu", agent_id=f"hw@{me}", capabilities=caps))

    async def beat() -> None:
        while True:
            await send(DeviceHeartbeat(device_id=me))
            await asyncio.sleep(0.5)

    beating = asyncio.create_task(beat())
    while True:
        ev = await assigned.get()
        where = {"candidate_id": ev.candidate_id, "task": ev.task, "device_id": me}
        profile = ProfileReport(ok=True, runtime_ms=0.001, ref_runtime_ms=0.077, speedup=SPEEDUP)
        await send(
            CandidateCompiled(**where, report=CompileReport(ok=True), attempt=ev.attempt),
            CandidateVerified(**where, report=VerifyReport(correct=True), attempt=ev.attempt),
            CandidateProfiled(**where, report=profile, attempt=ev.attempt),
        )
        print(f"lied about {ev.candidate_id} attempt {ev.attempt}", flush=True)
    beating.cancel()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
