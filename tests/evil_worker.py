"""A worker that lies about its own assignments (``python -m tests.evil_worker``).

It holds a worker's own, valid credentials (device ``DEVICE``): it announces a CPU device,
sends heartbeats, and for every candidate the archive assigns to it reports, at once and
without running anything, that the candidate compiled, is correct and is 77 times faster
than the reference, with absurd hardware counters besides; and it answers every tuning
request the archive sends it, at once and without timing anything, with a configuration
of the kernel's space that no candidate has yet, "a million times faster" than the
kernel's own (four trials, so it spends its tuning budget). With its first assignment of a
task it audits that task, at once, as degenerate (outputs independent of inputs), under
the id an honest verifier of kf before issue 43 gave every device's audit of the task.
Every message is entitled (its own device, its own assignments and requests): only a
measurement that does not rely on it can catch the lie (agents/archive.py,
``ConfirmationRequested``). It runs until killed and prints one line per lie.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import msgspec
import nats

from kf import bus
from kf.events import (
    Event,
    decode_envelope,
    decode_event,
    derived_id,
    device_event_id,
    make_envelope,
)
from kf.facts import DeviceAnnounced, DeviceHeartbeat
from kf.kernels import params
from kf.llm_facts import ConfigTuned, TuningTrial
from kf.reports import (
    CompileReport,
    CountersReport,
    ProfileReport,
    TaskAudit,
    VerifyReport,
)
from kf.runtime import fetch_range
from kf.search_facts import (
    CandidateAssigned,
    CandidateCompiled,
    CandidateProfiled,
    CandidateProposed,
    CandidateVerified,
    CountersMeasured,
    TaskAudited,
    TuningRequested,
)

SPEEDUP = 77.0
ABSURD_COUNTERS = {"dram_throughput_pct": 1e9, "sm_throughput_pct": 1e9, "kernels": 0.0}


def tuning_lie(ev: TuningRequested, sources: dict[str, str]) -> ConfigTuned:
    """The answer to a tuning request at the task's own shape set: a configuration of the
    kernel's space that no candidate has and no honest tuner is near (so the archive
    chooses it), claimed a million times faster than the kernel's own, after four trials
    that never ran."""
    source = sources[ev.candidate_id]
    parsed = params.parse(source)
    assert parsed is not None, "asked to tune a kernel without a space"
    space, own = parsed
    known = set(sources.values())
    fresh = [c for c in params.grid(space) if params.apply(source, c) not in known]
    # not one an honest tuner may choose at the same time (a tuner on a small budget picks a
    # neighbour of an elite's configuration): the archive skips a configuration already
    # proposed, and the honest device's answer can be committed first
    near: set[str] = set()
    for other in sources.values():
        found = params.parse(other)
        if found is not None and params.family(other) == params.family(source):
            near.update(params.config_key(n) for n in params.neighbours(*found))
    far = [c for c in fresh if params.config_key(c) not in near]
    best = (far or fresh)[0]
    trials = tuple(TuningTrial(config=dict(best), ok=True, runtime_ms=1e-6) for _ in range(4))
    return ConfigTuned(
        task=ev.task,
        candidate_id=ev.candidate_id,
        device_id=ev.device_id,
        family=params.family(source),
        shape_index=0,
        shape="[[64, 256]]",
        baseline_config=dict(own),
        best_config=dict(best),
        best_ms=1e-6,
        baseline_ms=1.0,
        trials=trials,
        note="lied: nothing was timed",
        requested=True,
        last=True,
        improved=True,
    )


async def main(url: str, run: str, user: str, password: str, me: str) -> None:
    nc = await nats.connect(url, user=user, password=password)
    intake = bus.device_inbound_subject(run, me)
    assigned: asyncio.Queue[CandidateAssigned | TuningRequested] = asyncio.Queue()
    sources: dict[str, str] = {}  # every proposed candidate's source, by id

    async def send(*events: Event, event_id: str | None = None) -> None:
        envs = [
            make_envelope(
                ev, run_id=run, source=f"evil@{me}", event_id=device_event_id(me, event_id)
            )
            for ev in events
        ]
        while True:  # until the run's archivist is there to answer
            try:
                await nc.request(intake, msgspec.msgpack.encode(envs), timeout=5)
                return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.2)

    async def on_log(msg: Any) -> None:
        env = decode_envelope(msg.data)
        if env.type in (CandidateAssigned.tag, TuningRequested.tag, CandidateProposed.tag):
            ev = decode_event(env)
            if isinstance(ev, CandidateProposed):
                sources[ev.candidate_id] = ev.source
            elif isinstance(ev, CandidateAssigned | TuningRequested) and ev.device_id == me:
                assigned.put_nowait(ev)

    await nc.subscribe(bus.log_subject(run), cb=on_log)
    caps = {"backends": ["cpp-openmp", "cpp-load-inline"]}
    await send(DeviceAnnounced(device_id=me, kind="cpu", agent_id=f"hw@{me}", capabilities=caps))

    async def beat() -> None:
        while True:
            await send(DeviceHeartbeat(device_id=me))
            await asyncio.sleep(0.5)

    async def catch_up() -> None:  # proposals committed before it subscribed
        start = 1
        while True:
            head, batch = await fetch_range(nc, run, start)
            for raw in batch:
                env = decode_envelope(raw)
                if env.type == CandidateProposed.tag:
                    ev = decode_event(env)
                    assert isinstance(ev, CandidateProposed)
                    sources[ev.candidate_id] = ev.source
            start += len(batch)
            if not batch or start > head:
                return

    beating = asyncio.create_task(beat())
    audited: set[str] = set()
    while True:
        ev = await assigned.get()
        if isinstance(ev, CandidateAssigned) and ev.task not in audited:
            audited.add(ev.task)
            lie = TaskAudit(degenerate=True, reason="lied: nothing was run")
            squat = derived_id("kernel.task_audited", run, ev.task)
            await send(TaskAudited(task=ev.task, device_id=me, audit=lie), event_id=squat)
            print(f"lied about auditing {ev.task}", flush=True)
        if isinstance(ev, TuningRequested):
            # every proposal in the log, not only those seen since it subscribed: a lie in
            # a configuration the run already measured is skipped by the archive
            await catch_up()
            await send(tuning_lie(ev, sources))
            print(f"lied about tuning {ev.candidate_id}", flush=True)
            continue
        where = {"candidate_id": ev.candidate_id, "task": ev.task, "device_id": me}
        profile = ProfileReport(ok=True, runtime_ms=0.001, ref_runtime_ms=0.077, speedup=SPEEDUP)
        counters = CountersReport(ok=True, device="cuda", summary=ABSURD_COUNTERS)
        await send(
            CandidateCompiled(**where, report=CompileReport(ok=True), attempt=ev.attempt),
            CandidateVerified(**where, report=VerifyReport(correct=True), attempt=ev.attempt),
            CandidateProfiled(**where, report=profile, attempt=ev.attempt),
            CountersMeasured(**where, report=counters),
        )
        print(f"lied about {ev.candidate_id} attempt {ev.attempt}", flush=True)
    beating.cancel()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
