"""Who may say what: subjects, per-role permissions on a real nats-server, entitlements."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from kf import bus
from kf.auth import Entitlements, RunBus, deployment_config, password_env
from kf.bus import EmbeddedServer
from kf.events import Envelope, Event, decode_event, device_event_id, make_envelope
from kf.facts import DeviceHeartbeat, DeviceLost, ReactionFailed, RunFinished
from kf.llm_facts import ConfigTuned
from kf.reports import CountersReport, ProfileReport, TaskAudit
from kf.search_facts import (
    CandidateAssigned,
    CandidateProfiled,
    CandidateProposed,
    CountersMeasured,
    TaskAudited,
    TuningRequested,
)
from tests.harness import archivist, kf_cli, wait_for

ROOT = Path(__file__).resolve().parent.parent


def test_auth_device_tokens_are_one_to_one() -> None:
    """A device id maps to one subject token and back; tokens kf would never write name
    no device."""
    for device in ("wA", "host/cuda:0", "h.local/cpu", "gpu 0", "ü-1", "~41"):
        token = bus.device_token(device)
        assert "." not in token and " " not in token and "*" not in token
        assert bus.device_of_token(token) == device
    assert bus.device_token("host/cuda:0") == "host~2fcuda~3a0"
    assert bus.device_of_token("~41") is None  # "A" is written "A"
    assert bus.device_of_token("a~zz") is None
    assert bus.intake_device("r", "kf.r.in.dev.w~2f1") == (True, "w/1")
    assert bus.intake_device("r", "kf.r.in") == (True, None)
    assert bus.intake_device("r", "kf.r.in.dev.~41") == (False, None)


async def _hello(url: str, **creds: str) -> str:
    """What the server answers a client that connects with ``creds`` (the NATS protocol
    spoken directly: nats-py leaves tasks behind after a refused connect)."""
    host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    await reader.readline()  # INFO
    options = {"verbose": False, "pedantic": False, **creds}
    writer.write(b"CONNECT " + json.dumps(options).encode() + b"\r\nPING\r\n")
    await writer.drain()
    answer = (await reader.readline()).decode()
    writer.close()
    await writer.wait_closed()
    return answer


class _Msgs:
    """Messages received on one subscription."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []

    async def on_msg(self, msg: Any) -> None:
        self.got.append((msg.subject, msg.data))


async def test_auth_embedded_run_server_separates_roles() -> None:
    """kf run's embedded server refuses anonymous clients and lets only the archivist
    publish committed events; a worker publishes only on its own device's intake."""
    rb = await RunBus.open("r1", url=None, device_id="host/cpu")
    try:
        assert rb.archivist is not None and rb.worker is not None
        assert len({id(rb.archivist), id(rb.proposer), id(rb.worker)}) == 3
        assert "Authorization Violation" in await _hello(rb.url)
        log, intake = _Msgs(), _Msgs()
        await rb.proposer.subscribe(bus.log_subject("r1"), cb=log.on_msg)
        for subject in bus.intake_subjects("r1"):
            await rb.archivist.subscribe(subject, cb=intake.on_msg)
        await rb.proposer.flush()
        await rb.archivist.flush()
        await rb.worker.publish(bus.log_subject("r1"), b"forged by a worker")
        await rb.proposer.publish(bus.log_subject("r1"), b"forged by a proposer")
        await rb.worker.publish(bus.device_inbound_subject("r1", "other/cpu"), b"not mine")
        await rb.worker.publish(bus.inbound_subject("r1"), b"not a proposer")
        await rb.worker.publish(bus.device_inbound_subject("r1", "host/cpu"), b"mine")
        await rb.proposer.publish(bus.inbound_subject("r1"), b"proposal")
        for c in (rb.worker, rb.proposer):
            await c.flush()  # the server has handled (and dropped) the forgeries
        await rb.archivist.publish(bus.log_subject("r1"), b"committed")
        await rb.archivist.flush()
        await wait_for(lambda: log.got and len(intake.got) >= 2, 10, "the allowed messages")
        assert log.got == [(bus.log_subject("r1"), b"committed")]
        assert sorted(intake.got) == [
            (bus.inbound_subject("r1"), b"proposal"),
            (bus.device_inbound_subject("r1", "host/cpu"), b"mine"),
        ]
    finally:
        folder = rb.server.folder if rb.server else None
        await rb.close()
    assert folder is not None and not folder.exists()


async def test_auth_token_server_shares_one_connection_for_every_role() -> None:
    """On a token-only server (backwards compatible, not role-separated) every role uses
    the same options, so kf run opens one connection."""
    with EmbeddedServer(token="tok-" + os.urandom(4).hex()) as srv:
        rb = await RunBus.open("r2", url=srv.url, device_id="host/cpu")
        try:
            assert rb.archivist is rb.proposer is rb.worker
            assert rb.server is None
        finally:
            await rb.close()


def _committed(ev: Event, seq: int, event_id: str) -> Envelope:
    return make_envelope(ev, run_id="r", source="archive@x", event_id=event_id, seq=seq)


def _check(ent: Entitlements, device: str | None, ev: Event, caused_by: str | None = None) -> Any:
    event_id = device_event_id(device) if device is not None else None
    env = make_envelope(ev, run_id="r", source="someone@x", caused_by=caused_by, event_id=event_id)
    return ent.check(device, env, decode_event(env))


def test_auth_entitlements_accept_only_the_assigned_device() -> None:
    """A stage result is accepted only from the device its attempt was assigned to, on
    that device's intake, an audit or a tuning answer only from a device given that work;
    decisions, device.lost, other kinds' facts and failures of proposals are refused."""
    ent = Entitlements()
    ent.fold(
        _committed(
            CandidateAssigned(candidate_id="c1", task="t", device_id="wA", attempt=1), 5, "assign-1"
        )
    )
    ok = ProfileReport(ok=True, speedup=77.0)

    def profiled(device: str, attempt: int = 1) -> CandidateProfiled:
        return CandidateProfiled(
            candidate_id="c1", task="t", device_id=device, report=ok, attempt=attempt
        )

    assert _check(ent, "wA", profiled("wA")) is None
    assert "claims device 'wA' but came on the intake of 'evil'" in _check(
        ent, "evil", profiled("wA")
    )
    assert "attempt 1 was assigned to 'wA', not to 'evil'" in _check(ent, "evil", profiled("evil"))
    assert "attempt 2 was never assigned" in _check(ent, "wA", profiled("wA", 2))
    assert "only on that device's intake" in _check(ent, None, profiled("wA"))
    assert "is a decision" in _check(ent, None, RunFinished(reason="forged"))
    assert "only by the archivist" in _check(ent, "wA", DeviceLost(device_id="wA", silent_s=1))
    proposal = CandidateProposed(
        candidate_id="c2", task="t", source="", operator="seed", mutator="m"
    )
    assert _check(ent, None, proposal) is None
    assert "not a device's observation" in _check(ent, "wA", proposal)
    assert _check(ent, "wA", DeviceHeartbeat(device_id="wA")) is None
    assert "claims device 'wB'" in _check(ent, "wA", DeviceHeartbeat(device_id="wB"))
    counters = CountersMeasured(
        candidate_id="c1", task="t", device_id="evil", report=CountersReport(ok=False)
    )
    assert "never assigned to 'evil'" in _check(ent, "evil", counters)
    tuned = ConfigTuned(
        task="t",
        candidate_id="c1",
        device_id="evil",
        family="f",
        shape_index=0,
        shape="[]",
        baseline_config={},
    )
    assert "never asked to tune task 't'" in _check(ent, "evil", tuned)
    asked = TuningRequested(task="t", candidate_id="c1", device_id="evil", budget=4)
    ent.fold(_committed(asked, 6, "tune-1"))
    assert _check(ent, "evil", tuned) is None  # asked: it may time any elite on itself
    audit = TaskAudited(task="t", device_id="evil", audit=TaskAudit(degenerate=True))
    assert "never assigned a candidate of task 't'" in _check(ent, "evil", audit)
    honest = TaskAudited(task="t", device_id="wA", audit=TaskAudit(degenerate=True))
    assert _check(ent, "wA", honest) is None
    failed = ReactionFailed(kind="compiler", agent_id="compiler@x", event_type="x", error="e")
    assert _check(ent, "wA", failed, caused_by="assign-1") is None
    assert "work of device 'wA'" in _check(ent, None, failed, caused_by="assign-1")
    assert "work of device 'wA'" in _check(ent, "evil", failed, caused_by="assign-1")
    ent.fold(_committed(proposal, 7, "propose-2"))
    assert "proposal propose-2" in _check(ent, "wA", failed, caused_by="propose-2")


async def test_auth_archivist_never_answers_onto_a_kf_subject(
    nats_server: EmbeddedServer, db_path: Path
) -> None:
    """A request whose reply subject is the committed log is not answered (the answer
    would go out with the archivist's rights)."""
    nc = await bus.connect(bus.BusOptions(nats_server.url))
    async with archivist(nats_server.url, "r3", db_path):
        log = _Msgs()
        await nc.subscribe(bus.log_subject("r3"), cb=log.on_msg)
        request = msgspec.msgpack.encode({"from": 1, "limit": 10})

        async def served() -> bool:
            try:
                reply = await nc.request(bus.fetch_subject("r3"), request, timeout=2)
            except (NoRespondersError, NatsTimeout):
                return False
            return "head" in msgspec.msgpack.decode(reply.data)

        # the archivist answers fetches (once, on a loaded 2-core CI machine, the very
        # first request found no responder yet)
        await wait_for(served, 20, "the archivist answering a fetch")
        await nc.publish(bus.fetch_subject("r3"), request, reply=bus.log_subject("r3"))
        assert await served()  # still serving after the refused request
        await nc.flush()
    assert log.got == []
    await bus.close(nc)


def test_auth_deployment_config_takes_passwords_from_the_environment(tmp_path: Path) -> None:
    """``python -m kf.auth nats-config`` writes a configuration with no secret in it; a
    real nats-server given the passwords in its environment enforces the roles."""
    conf = tmp_path / "nats.conf"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kf.auth",
            "nats-config",
            "--run",
            "demo",
            "--worker",
            "cpu-0",
            "-o",
            str(conf),
        ],
        cwd=ROOT,
        check=True,
    )
    text = conf.read_text()
    assert text == deployment_config("demo", ["cpu-0"])
    secrets = {password_env(r): os.urandom(8).hex() for r in ("archivist", "proposer")}
    secrets[password_env("worker", "cpu-0")] = os.urandom(8).hex()
    assert not any(s in text for s in secrets.values())
    env = {**os.environ, **secrets}
    server = subprocess.Popen(
        [bus.nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", "-1"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        port = None
        for line in server.stderr:
            if "Listening for client connections on" in line:
                port = int(line.rsplit(":", 1)[1])
                break
        assert port is not None
        url = f"nats://127.0.0.1:{port}"

        async def probe() -> list[tuple[str, bytes]]:
            worker = await nats.connect(
                url, user="worker-cpu-0", password=secrets[password_env("worker", "cpu-0")]
            )
            arch = await nats.connect(
                url, user="archivist", password=secrets[password_env("archivist")]
            )
            got = _Msgs()
            await worker.subscribe(bus.log_subject("demo"), cb=got.on_msg)
            await arch.subscribe(bus.intake_subjects("demo")[1], cb=got.on_msg)
            await worker.flush()
            await arch.flush()
            await worker.publish(bus.log_subject("demo"), b"forged")
            await worker.publish(bus.device_inbound_subject("demo", "cpu-0"), b"mine")
            await worker.flush()
            await arch.publish(bus.log_subject("demo"), b"committed")
            await arch.flush()
            await wait_for(lambda: len(got.got) >= 2, 10, "the allowed messages")
            wrong = {"user": "archivist", "pass": "wrong"}
            assert "Authorization Violation" in await _hello(url, **wrong)
            await worker.close()
            await arch.close()
            return got.got

        got = asyncio.run(probe())
        assert sorted(got) == [
            (bus.device_inbound_subject("demo", "cpu-0"), b"mine"),
            (bus.log_subject("demo"), b"committed"),
        ]
    finally:
        server.terminate()
        server.wait(10)
        if server.stderr is not None:
            server.stderr.close()


def test_auth_shared_login_is_refused_unless_allowed(tmp_path: Path) -> None:
    """kf run, kf worker and kf agent on a server without per-role users (a token, or no
    credentials) refuse to start with one line, before connecting; --allow-shared-token
    starts them after one warning line (a wrong token then fails on its own line)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KF_ALLOW_SHARED_TOKEN",)}
    env.update(PYTHONPATH=str(ROOT), KF_LOG_LEVEL="WARNING")
    task = str(ROOT / "tests/fixtures/search/scale_relu.py")

    def kf(*argv: str) -> subprocess.CompletedProcess[str]:
        return kf_cli(*argv, env=env, cwd=tmp_path, timeout=120)

    with EmbeddedServer(token="kf-shared-secret") as srv:
        bare = srv.url.replace("kf-shared-secret@", "")
        for argv in (
            ["run", task, "--nats", srv.url, "--db", str(tmp_path / "a.db")],
            ["run", task, "--nats", bare, "--token", "kf-shared-secret", "--budget", "1"],
            ["worker", "--nats", srv.url, "--run", "r", "--name", "w"],
            ["agent", "archivist", "--nats", bare, "--run", "r"],
        ):
            done = kf(*argv)
            assert done.returncode == 2, (argv, done.stderr)
            assert len(done.stderr.strip().splitlines()) == 1, (argv, done.stderr)
            assert "refusing to start" in done.stderr and "--allow-shared-token" in done.stderr
            assert "kf-shared-secret" not in done.stderr + done.stdout
        assert not (tmp_path / "a.db").exists()  # nothing was started
        wrong = srv.url.replace("kf-shared-secret@", "wrong@")
        done = kf("worker", "--nats", wrong, "--run", "r", "--name", "w", "--allow-shared-token")
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 2, done.stderr
        assert lines[0].startswith("kf worker: WARNING: NATS at nats://***@")
        assert "refused the credentials" in lines[1]
        # a per-role login is not refused for this (the server then judges it)
        done = kf("worker", "--nats", bare, "--run", "r", "--user", "u", "--password", "p")
        assert done.returncode == 1 and "refusing to start" not in done.stderr
