"""``kf run`` with its embedded nats-server: a dead server and SIGTERM, with real processes.

The ``kf run`` tests start it (no ``--nats``: it starts its own nats-server with per-run
credentials) on ``tests/fixtures/search/scale_relu.py`` and act on it mid-run; the last
one cuts an in-process archivist off from a real nats-server. SIGINT, SIGTERM and SIGKILL
of ``kf run`` mid-build are tests/test_stop.py's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

from agents.archivist import Archivist
from kf import bus
from kf.agent import AgentContext
from kf.bus import EmbeddedServer
from kf.events import device_event_id, make_envelope
from kf.facts import DeviceAnnounced, DeviceHeartbeat
from kf.log import EventLog
from kf.runtime import Outbox
from tests.harness import wait_for as wait_async
from tests.test_faults import (
    ENV,
    TASK,
    check_counted_once,
    events,
    finish,
    kf_proc,
    of_type,
    wait_until,
)
from tests.test_faults import stop as stop_procs


def kf_run(db: Path, budget: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``kf run`` with its embedded server, as its own process."""
    return kf_proc(
        "run", str(TASK), "--db", str(db), "--budget", str(budget), "--islands", "1",
        "--heartbeat", "0.5", "--heartbeat-timeout", "5", "--json",
        "--tune-budget", "0",  # the server's restart is the point; tuning adds its own
        env={**ENV, **(env or {})},
    )  # fmt: skip


def nats_children(pid: int) -> list[tuple[int, list[str]]]:
    """``(pid, argv)`` of the live nats-server processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == pid and state != "Z" and argv and argv[0].endswith(b"nats-server"):
            out.append((int(entry.name), [a.decode() for a in argv if a]))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def server_folder(argv: list[str]) -> Path:
    """The embedded server's temporary folder (where its configuration file is)."""
    return Path(argv[argv.index("-c") + 1]).parent


def test_recovery_killed_embedded_nats_server_is_restarted(tmp_path: Path) -> None:
    """SIGKILL of the embedded nats-server mid-run: kf run restarts it on the same port
    with the same credentials and the run completes, with no device declared lost."""
    db = tmp_path / "run.db"
    main = kf_run(db, 4)
    try:
        wait_until(lambda: of_type(db, "kernel.candidate_compiled"), 120, "a first compile")
        ((pid, argv),) = nats_children(main.pid)
        folder = server_folder(argv)
        os.kill(pid, signal.SIGKILL)
        code, out, err = finish(main)
    finally:
        stop_procs(main)
    assert code == 0, err[-3000:]
    assert "kf run: the embedded nats-server died (signal 9); restarted on port" in err
    (done,) = json.loads(out)["tasks"]
    assert done["candidates"] - done["tuned_candidates"] == 4  # tuning adds its own
    assert of_type(db, "device.lost") == []
    assert not alive(pid) and nats_children(main.pid) == []
    assert not folder.exists()
    check_counted_once(db, 4)


def test_recovery_embedded_nats_server_that_stays_dead_ends_the_run_with_a_message(
    tmp_path: Path,
) -> None:
    """With no restart allowed (KF_NATS_RESTARTS=0), a killed embedded server makes kf run
    exit 3 (a part died) with the reason and the resume hint instead of hanging;
    nothing is left behind."""
    db = tmp_path / "run.db"
    main = kf_run(db, 4, {"KF_NATS_RESTARTS": "0"})
    try:
        wait_until(lambda: of_type(db, "kernel.candidate_compiled"), 120, "a first compile")
        ((pid, argv),) = nats_children(main.pid)
        folder = server_folder(argv)
        os.kill(pid, signal.SIGKILL)
        code, _, err = finish(main, 60)
    finally:
        stop_procs(main)
    assert code == 3, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("kf run: ")]  # not logs
    why, hint = said[-2:]
    assert why.startswith("kf run: the embedded nats-server (port "), why
    assert "died (signal 9)" in why
    assert hint.startswith("kf run: the log keeps what was committed"), hint
    assert of_type(db, "device.lost") == []
    assert not folder.exists()
    assert events(db)  # what was committed stays


async def test_recovery_archivist_cut_off_from_nats_declares_no_device_lost(
    tmp_path: Path,
) -> None:
    """A nats-server outage longer than the heartbeat timeout: the archivist, which heard
    no one meanwhile, does not declare the still-beating device lost once it is back."""

    run, db = "outage", tmp_path / "run.db"
    server = EmbeddedServer().start()
    port = server.port
    arch_nc = await bus.connect(bus.BusOptions(server.url))
    dev_nc = await bus.connect(bus.BusOptions(server.url))
    arch = Archivist(
        AgentContext(run_id=run, agent_id="archivist@t", options={"heartbeat_timeout_s": 1.0}),
        db=db,
        nc=arch_nc,
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    arch_task = asyncio.create_task(arch.run(stop, ready))
    outbox = Outbox(dev_nc, run, subject=bus.device_inbound_subject(run, "d1"), timeout_s=1.0)
    outbox_task = asyncio.create_task(outbox.run())

    def emit(ev: object) -> None:
        envelope = make_envelope(
            ev,  # type: ignore[arg-type]
            run_id=run,
            source="hardware@t",
            event_id=device_event_id("d1"),
        )
        outbox.put([envelope])

    async def beat() -> None:
        while True:
            emit(DeviceHeartbeat(device_id="d1"))
            await asyncio.sleep(0.2)  # the device's heartbeat period, not a synchronisation

    def beats() -> int:
        return arch.stats.committed

    try:
        await ready.wait()
        emit(DeviceAnnounced(device_id="d1", kind="cpu", agent_id="hardware@t"))
        beater = asyncio.create_task(beat())
        await wait_async(lambda: beats() >= 3, 30, "first heartbeats")
        server.stop()
        await asyncio.sleep(2.5)  # the outage itself (longer than the 1 s timeout)
        server = EmbeddedServer(port=port).start()
        after = beats()
        await wait_async(lambda: beats() >= after + 10, 60, "heartbeats after the outage")
        beater.cancel()
    finally:
        stop.set()
        await arch_task
        outbox_task.cancel()
        await bus.close(arch_nc)
        await bus.close(dev_nc)
        server.stop()
    with EventLog(db, readonly=True) as elog:
        types = [e.type for e in elog.read()]
    assert "device.lost" not in types
    assert types.count("device.heartbeat") >= 10
