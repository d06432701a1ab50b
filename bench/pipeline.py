"""Event pipeline benchmark (issue 2): publish → committed throughput, replay fold rate, latency.

Run: .venv/bin/python bench/pipeline.py [--events 40000] [--replay 100000]

What it measures, on a real nats-server over loopback and a real SQLite log (WAL,
synchronous=FULL):
1. throughput: four publishing agents (separate NATS connections, each with its own
   outbox) send N events in total; the clock runs from the first put to the moment every
   outbox has its acknowledgements (all committed). It then checks the log: every event
   present exactly once, seq gapless.
2. replay: a 100,000-event log folded by replay.fold (read, decode, fold) — events/s.
3. latency: one event at a time, put → committed → delivered to a subscribing agent;
   p50 / p99 over the samples.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kf import bus
from kf.agent import AgentContext
from kf.bus import EmbeddedServer
from kf.events import Record, make_envelope
from kf.log import EventLog
from kf.logs import configure
from kf.replay import fold
from kf.runtime import AgentRunner, Outbox
from tests.harness import archivist, pings
from tests.tally import Pinged, Tally


async def throughput(url: str, db: Path, n: int) -> dict[str, float]:
    conns = [await bus.connect(bus.BusOptions(url)) for _ in range(4)]
    async with archivist(url, "bench", db, hosted=()) as arch:
        outboxes = [Outbox(nc, "bench") for nc in conns]
        tasks = [asyncio.create_task(o.run()) for o in outboxes]
        batches = [pings(f"p{k}", n // 4, "bench") for k in range(4)]
        t0 = time.perf_counter()
        for o, b in zip(outboxes, batches, strict=True):
            o.put(b)
        for o in outboxes:
            assert await o.flush(300)
        dt = time.perf_counter() - t0
        for t in tasks:
            t.cancel()
        stats = arch.stats
    for nc in conns:
        await bus.close(nc)
    with EventLog(db, readonly=True) as elog:
        ids = [e.event_id for e in elog.read()]
        seqs = [e.seq for e in elog.read()]
    lost = n - len(set(ids))
    dup = len(ids) - len(set(ids))
    gapless = seqs == list(range(1, len(seqs) + 1))
    return {
        "events": n,
        "seconds": dt,
        "rate": n / dt,
        "lost": lost,
        "duplicated": dup,
        "gapless": float(gapless),
        "batches": stats.batches,
    }


def replay_rate(db: Path, n: int) -> dict[str, float]:
    with EventLog(db) as elog:
        for i in range(0, n, 5000):
            elog.append(pings("r", min(5000, n - i), "replay", start=i))
    with EventLog(db, readonly=True) as elog:
        t0 = time.perf_counter()
        res = fold(elog, [Tally])
        dt = time.perf_counter() - t0
    assert res.events == n and res.snapshots["tally"].count == n
    return {"events": n, "seconds": dt, "rate": n / dt}


async def latency(url: str, db: Path, samples: int) -> dict[str, float]:
    nc = await bus.connect(bus.BusOptions(url))
    sub_nc = await bus.connect(bus.BusOptions(url))
    arrived: dict[str, float] = {}
    got = asyncio.Event()
    async with archivist(url, "lat", db, hosted=()):
        runner = AgentRunner(Tally(AgentContext(run_id="lat", agent_id="tally@lat")), sub_nc)
        orig = runner.agent.evolve

        def evolve(state, rec: Record):  # type: ignore[no-untyped-def]
            arrived[rec.event_id] = time.perf_counter()
            got.set()
            return orig(state, rec)

        runner.agent.evolve = evolve  # type: ignore[method-assign]
        runner.agent.react = lambda s, r: ()  # type: ignore[method-assign]
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(runner.run(stop, ready))
        await ready.wait()
        o = Outbox(nc, "lat")
        ot = asyncio.create_task(o.run())
        lat: list[float] = []
        for i in range(samples):
            env = make_envelope(
                Pinged(producer="l", n=i), run_id="lat", source="l@b", event_id=f"lat-{i}"
            )
            got.clear()
            t0 = time.perf_counter()
            o.put([env])
            while env.event_id not in arrived:
                await got.wait()
                got.clear()
            lat.append((arrived[env.event_id] - t0) * 1e3)
        stop.set()
        await task
        ot.cancel()
    await bus.close(nc)
    await bus.close(sub_nc)
    lat.sort()
    return {
        "samples": samples,
        "p50_ms": statistics.median(lat),
        "p99_ms": lat[int(0.99 * (len(lat) - 1))],
        "max_ms": lat[-1],
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=40000)
    ap.add_argument("--replay", type=int, default=100000)
    ap.add_argument("--samples", type=int, default=1000)
    args = ap.parse_args()
    configure("WARNING", json=True)
    tmp = Path(tempfile.mkdtemp(prefix="kf-bench-"))
    with EmbeddedServer() as srv:
        tp = await throughput(srv.url, tmp / "tp.db", args.events)
        lt = await latency(srv.url, tmp / "lat.db", args.samples)
    rp = replay_rate(tmp / "replay.db", args.replay)
    print(
        "kf event pipeline benchmark — real nats-server on loopback, SQLite WAL + synchronous=FULL"
    )
    print(
        f"throughput: 4 publishers × {args.events // 4} events → committed: "
        f"{tp['rate']:,.0f} events/s ({tp['seconds']:.2f} s); lost {tp['lost']}, "
        f"duplicated {tp['duplicated']}, seq gapless: {bool(tp['gapless'])}, "
        f"{tp['batches']:.0f} commit batches"
    )
    print(
        f"replay fold: {rp['events']:,} events in {rp['seconds']:.2f} s = "
        f"{rp['rate']:,.0f} events/s (read + decode + Tally fold)"
    )
    print(
        f"latency put → committed → delivered to a subscribing agent, one at a time, "
        f"{lt['samples']} samples: p50 {lt['p50_ms']:.2f} ms, p99 {lt['p99_ms']:.2f} ms, "
        f"max {lt['max_ms']:.2f} ms"
    )
    if tp["lost"] or tp["duplicated"] or not tp["gapless"]:
        raise SystemExit("FAILED: events lost, duplicated or seq not gapless")


if __name__ == "__main__":
    asyncio.run(main())
