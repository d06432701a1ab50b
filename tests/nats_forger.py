"""A hostile client holding one worker's credentials (``python -m tests.nats_forger``).

It follows the committed log (a worker may read it) until a candidate is assigned to
``victim``, then tries, in order:

1. a forged ``run.finished`` published on the committed subject;
2. a 77× profile of that candidate claiming the victim's device, on its own intake;
3. the same profile claiming its own device (the candidate was never assigned to it);
4. the profile on the victim's intake subject, and on the general intake.

It prints one JSON object: the server's errors it heard (permission violations) and the
archivist's replies to its requests (what it refused, and why).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import msgspec
import nats

from kf import bus
from kf.evaluation.grader.reports import ProfileReport
from kf.events import decode_envelope, decode_event, encode_envelope, make_envelope
from kf.facts import RunFinished
from kf.search_facts import CandidateAssigned, CandidateProfiled


async def main(url: str, run: str, user: str, password: str, me: str, victim: str) -> None:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(url, user=user, password=password, error_cb=on_error)
    assigned: asyncio.Future[tuple[CandidateAssigned, int]] = asyncio.Future()

    async def on_log(msg: Any) -> None:
        env = decode_envelope(msg.data)
        if env.type == CandidateAssigned.tag and not assigned.done():
            ev = decode_event(env)
            assert isinstance(ev, CandidateAssigned)
            if ev.device_id == victim:
                assigned.set_result((ev, env.seq or 0))

    await nc.subscribe(bus.log_subject(run), cb=on_log)
    ev, seq = await asyncio.wait_for(assigned, 240)

    forged_end = make_envelope(
        RunFinished(reason="budget spent"), run_id=run, source="archive@forged", seq=seq + 1
    )
    await nc.publish(bus.log_subject(run), encode_envelope(forged_end))
    await nc.flush()

    report = ProfileReport(ok=True, runtime_ms=0.001, ref_runtime_ms=0.077, speedup=77.0)

    def profile(device: str, tag: str) -> bytes:
        fake = CandidateProfiled(
            candidate_id=ev.candidate_id,
            task=ev.task,
            device_id=device,
            report=report,
            attempt=ev.attempt,
        )
        env = make_envelope(fake, run_id=run, source="profiler@forged", event_id=f"forged-{tag}")
        return msgspec.msgpack.encode([env])

    replies: dict[str, Any] = {}
    mine = bus.device_inbound_subject(run, me)
    for tag, device in (("as-victim", victim), ("as-me", me)):
        reply = await nc.request(mine, profile(device, tag), timeout=10)
        replies[tag] = msgspec.msgpack.decode(reply.data)
    timeouts: list[str] = []
    for tag, subject in (
        ("victim-intake", bus.device_inbound_subject(run, victim)),
        ("general-intake", bus.inbound_subject(run)),
    ):
        try:
            await nc.request(subject, profile(victim, tag), timeout=2)
            replies[tag] = "answered"
        except nats.errors.TimeoutError:
            timeouts.append(tag)
    await nc.flush()
    await nc.close()
    print(
        json.dumps(
            {
                "candidate_id": ev.candidate_id,
                "errors": errors,
                "replies": replies,
                "unanswered": timeouts,
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:7]))
