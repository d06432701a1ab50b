"""A worker that takes work and never answers (``python -m tests.silent_worker``).

It holds a worker's own, valid credentials (device ``DEVICE``): it announces a CPU device
and sends a heartbeat twice a second for ever, and answers none of the candidates the
archive assigns to it (issue 43, NX9). It prints one line per assignment it sits on.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import msgspec
import nats

from kf import bus
from kf.events import Event, decode_envelope, decode_event, device_event_id, make_envelope
from kf.facts import DeviceAnnounced, DeviceHeartbeat
from kf.search_facts import CandidateAssigned


async def main(url: str, run: str, user: str, password: str, me: str) -> None:
    nc = await nats.connect(url, user=user, password=password)
    intake = bus.device_inbound_subject(run, me)

    async def send(ev: Event) -> None:
        envs = [make_envelope(ev, run_id=run, source=f"silent@{me}", event_id=device_event_id(me))]
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
            if isinstance(ev, CandidateAssigned) and ev.device_id == me:
                print(f"sitting on {ev.candidate_id} attempt {ev.attempt}", flush=True)

    await nc.subscribe(bus.log_subject(run), cb=on_log)
    caps = {"backends": ["cpp-openmp", "cpp-load-inline"]}
    await send(DeviceAnnounced(device_id=me, kind="cpu", agent_id=f"hw@{me}", capabilities=caps))
    while True:
        await send(DeviceHeartbeat(device_id=me))
        await asyncio.sleep(0.5)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
