"""A hostile client holding one worker's credentials (``python -m tests.nats_forger``).

It follows the committed log (a worker may read it) until a candidate is assigned to
``victim``, then tries, in order:

1. a forged ``run.finished`` published on the committed subject;
2. a 77× profile of that candidate claiming the victim's device, on its own intake;
3. the same profile claiming its own device (the candidate was never assigned to it);
4. the profile on the victim's intake subject, and on the general intake;
5. on its own intake, as itself, results it was never given the work for (issue 43, ND1):
   a degenerate audit of the victim's task, a tuning answer nobody asked it for, and a
   failed reaction to the victim candidate's proposal (which would fail that candidate);
6. first of all, as soon as the victim is assigned a candidate: a heartbeat of its own
   (an event it may send) under the id the victim's compiler will give its result, plain
   and in the victim's id space, so that the log would drop the real result as a
   duplicate (the probe's "predictable reaction ids").

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
from kf.events import (
    Envelope,
    decode_envelope,
    decode_event,
    derived_id,
    device_event_id,
    encode_envelope,
    make_envelope,
)
from kf.facts import DeviceHeartbeat, ReactionFailed, RunFinished
from kf.llm_facts import ConfigTuned
from kf.reports import ProfileReport, TaskAudit
from kf.runtime import fetch_range
from kf.search_facts import CandidateAssigned, CandidateProfiled, TaskAudited


async def main(url: str, run: str, user: str, password: str, me: str, victim: str) -> None:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(url, user=user, password=password, error_cb=on_error)
    assigned: asyncio.Future[tuple[CandidateAssigned, int, str]] = asyncio.Future()

    async def on_log(msg: Any) -> None:
        env = decode_envelope(msg.data)
        if env.type == CandidateAssigned.tag and not assigned.done():
            ev = decode_event(env)
            assert isinstance(ev, CandidateAssigned)
            if ev.device_id == victim:
                assigned.set_result((ev, env.seq or 0, env.event_id))

    await nc.subscribe(bus.log_subject(run), cb=on_log)
    ev, seq, assign_id = await asyncio.wait_for(assigned, 240)
    replies: dict[str, Any] = {"preempt": await _preempt(nc, run, me, victim, assign_id)}

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
    replies["unentitled"] = await _unentitled(nc, run, me, ev)
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


async def _preempt(nc: Any, run: str, me: str, victim: str, assign_id: str) -> Any:
    """Step 6: take the ids the victim's compiler will give its result to ``assign_id``."""
    plain = derived_id("compiler", assign_id, 0)
    envs = [
        make_envelope(DeviceHeartbeat(device_id=me), run_id=run, source=f"x@{me}", event_id=i)
        for i in (plain, device_event_id(victim, plain))
    ]
    subject = bus.device_inbound_subject(run, me)
    reply = await nc.request(subject, msgspec.msgpack.encode(envs), timeout=10)
    return {"ids": [e.event_id for e in envs], **msgspec.msgpack.decode(reply.data)}


async def _proposal(nc: Any, run: str, candidate_id: str) -> str:
    """The event id of ``candidate_id``'s proposal, from the committed log."""
    start = 1
    while True:
        head, batch = await fetch_range(nc, run, start)
        for raw in batch:
            env = decode_envelope(raw)
            proposal = env.type == "kernel.candidate_proposed"
            if proposal and getattr(decode_event(env), "candidate_id", None) == candidate_id:
                return env.event_id
        start += len(batch)
        if not batch or start > head:
            raise LookupError(f"no proposal of {candidate_id} in the log")


async def _unentitled(nc: Any, run: str, me: str, ev: CandidateAssigned) -> Any:
    """Step 5: results speaking for its own device about work it was never given."""
    audit = TaskAudited(
        task=ev.task, device_id=me, audit=TaskAudit(degenerate=True, reason="forged")
    )
    tuned = ConfigTuned(
        task=ev.task,
        candidate_id=ev.candidate_id,
        device_id=me,
        family="forged",
        shape_index=0,
        shape="[[1]]",
        baseline_config={},
        best_config={},
        baseline_ms=1.0,
        best_ms=1e-6,
        requested=True,
        last=True,
        improved=True,
    )
    failure = ReactionFailed(kind="compiler", agent_id=f"compiler@{me}", event_type="x", error="!")
    proposal = await _proposal(nc, run, ev.candidate_id)
    envs: list[Envelope] = [
        make_envelope(audit, run_id=run, source=f"verifier@{me}", event_id="forged-audit"),
        make_envelope(tuned, run_id=run, source=f"tuner@{me}", event_id="forged-tuned"),
        make_envelope(
            failure,
            run_id=run,
            source=f"compiler@{me}",
            event_id="forged-failure",
            caused_by=proposal,
        ),
    ]
    subject = bus.device_inbound_subject(run, me)
    reply = await nc.request(subject, msgspec.msgpack.encode(envs), timeout=10)
    return msgspec.msgpack.decode(reply.data)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:7]))
