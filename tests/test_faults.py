"""Across machines: remote workers, routing, and surviving faults, with real processes.

Every test runs a real nats-server, real `kf` processes (archivist, mutator, workers) and
a small real search over `tests/fixtures/search/scale_relu.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kf.bus import EmbeddedServer
from kf.events import Envelope, decode_event
from kf.log import EventLog, LogError
from tests import harness
from tests.harness import replay_check

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "tests/fixtures/search/scale_relu.py"
ENV = dict(os.environ, KF_LOG_LEVEL="WARNING", KF_EVAL_THREADS="1", PYTHONPATH=str(ROOT))


def kf_proc(
    *args: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """A `kf` command as its own process (under ``env``, default ENV), its output piped."""
    return harness.kf_proc(*args, prefix=prefix, env=ENV if env is None else env)


def events(db: Path) -> list[Envelope]:
    """Everything committed so far (empty while the log does not exist yet)."""
    try:
        with EventLog(db, readonly=True) as elog:
            return list(elog.read())
    except (LogError, Exception):
        return []


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``cond`` until truthy or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def of_type(db: Path, tag: str) -> list[Any]:
    return [decode_event(e) for e in events(db) if e.type == tag]


def finish(proc: subprocess.Popen[str], timeout_s: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


def stop(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def check_counted_once(db: Path, budget: int) -> dict[str, Any]:
    """Every candidate ends exactly once in the report, and replay --check passes."""
    rep = subprocess.run(
        [sys.executable, "-m", "kf.app.cli", "report", str(db), "--json"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(rep.stdout)
    task = report["tasks"][0]
    # the search's candidates; tuning, once the budget is spent, adds its own on top
    assert task["candidates"] - task["tuned_candidates"] == budget
    assert task["profiled"] + task["failed"] + task["duplicates"] == task["candidates"]
    replay_check(db)
    return report


def search_args(url: str, run: str, budget: int) -> list[str]:
    """``kf run`` of TASK in run ``run`` on ``url``: ``budget`` candidates on one island, with
    no tuning (these runs count the search's candidates; tuning would add its own)."""
    return [
        "run",
        str(TASK),
        "--nats",
        url,
        "--run",
        run,
        "--budget",
        str(budget),
        "--islands",
        "1",
        "--json",
        "--tune-budget",
        "0",
    ]


def run_args(url: str, db: Path, run: str, budget: int, *extra: str) -> list[str]:
    """search_args with its own log at ``db`` and quick heartbeats (a device silent for 3 s
    is lost)."""
    return [
        *search_args(url, run, budget),
        "--db",
        str(db),
        "--heartbeat",
        "0.5",
        "--heartbeat-timeout",
        "3",
        *extra,
    ]


def worker_args(url: str, run: str, name: str) -> list[str]:
    return ["worker", "--nats", url, "--run", run, "--name", name, "--heartbeat", "0.5"]


def test_faults_worker_killed_mid_evaluation_is_redispatched(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """SIGKILL of a worker mid-candidate: after the heartbeat timeout its work moves on."""
    db, run = tmp_path / "run.db", "kill-worker"
    main = kf_proc(*run_args(nats_server.url, db, run, 3, "--no-worker"))
    a = kf_proc(*worker_args(nats_server.url, run, "wA"))
    b: subprocess.Popen[str] | None = None
    try:
        first = wait_until(
            lambda: [x for x in of_type(db, "search.candidate_assigned") if x.device_id == "wA"],
            120,
            "a candidate assigned to worker A",
        )[0]
        a.send_signal(signal.SIGKILL)
        a.wait()
        b = kf_proc(*worker_args(nats_server.url, run, "wB"))
        code, _, err = finish(main)
        assert code == 0, err[-3000:]
    finally:
        stop(main, a, *([b] if b else []))
    lost = of_type(db, "device.lost")
    assert [x.device_id for x in lost] == ["wA"]
    again = [
        x for x in of_type(db, "search.candidate_assigned") if x.candidate_id == first.candidate_id
    ]
    assert [(x.device_id, x.attempt) for x in again] == [("wA", 1), ("wB", 2)]
    check_counted_once(db, 3)


@pytest.fixture(scope="module")
def joined_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run serving two tests: worker wA starts with the run, wB joins once work has
    been assigned, and a rogue client publishes five garbage messages on the run's inbound
    subject as soon as the log exists (one whole run fewer for the suite: issue 31 item 7).
    The log, kf run's exit status, output and stderr."""
    db, run = tmp_path_factory.mktemp("joined") / "run.db", "join-worker"
    with EmbeddedServer() as server:
        # enough work left when the second worker has started (its start-up, seconds on a
        # loaded 2-core machine, once outlasted a budget of 6: the first worker did them all)
        args = run_args(server.url, db, run, 10, "--no-worker", "--max-in-flight", "2")
        main = kf_proc(*args)
        a = kf_proc(*worker_args(server.url, run, "wA"))
        b: subprocess.Popen[str] | None = None
        try:
            wait_until(lambda: events(db), 60, "the log to exist")
            asyncio.run(_spam(server.url, run, 5))
            wait_until(lambda: of_type(db, "search.candidate_assigned"), 120, "a first assignment")
            b = kf_proc(*worker_args(server.url, run, "wB"))
            code, out, err = finish(main)
        finally:
            stop(main, a, *([b] if b else []))
    return {"db": db, "code": code, "out": out, "err": err}


async def _spam(url: str, run: str, count: int) -> None:
    """A rogue client's ``count`` garbage messages on the run's inbound subject."""
    import nats

    nc = await nats.connect(url)
    for i in range(count):
        await nc.publish(f"kf.{run}.in", b"\xff\x00 not an event %d" % i)
    await nc.flush()
    await nc.close()


def test_faults_worker_joining_mid_run_receives_work(joined_run: dict[str, Any]) -> None:
    """A worker that joins a running run announces itself and gets candidates routed to it."""
    db = joined_run["db"]
    assert joined_run["code"] == 0, joined_run["err"][-3000:]
    announced = {x.device_id: x.capabilities for x in of_type(db, "device.announced")}
    assert set(announced) == {"wA", "wB"}
    # KF_DEVICE_MEASURE=0 (tests/conftest.py): kf worker described its device, timed nothing
    assert [c["measured_copy_bandwidth_gbs"] for c in announced.values()] == [None, None]
    to_b = [x for x in of_type(db, "search.candidate_assigned") if x.device_id == "wB"]
    done_by_b = [x for x in of_type(db, "kernel.candidate_compiled") if x.device_id == "wB"]
    assert to_b and done_by_b
    check_counted_once(db, 10)


def test_faults_nats_server_restart_mid_run_loses_nothing(tmp_path: Path) -> None:
    """The nats-server killed and restarted mid-run: the run completes, nothing lost."""
    server = EmbeddedServer().start()
    port = server.port
    db, run = tmp_path / "run.db", "nats-restart"
    main = kf_proc(*run_args(server.url, db, run, 4, "--heartbeat-timeout", "30"))
    try:
        wait_until(lambda: of_type(db, "kernel.candidate_compiled"), 120, "first compile")
        server.stop()
        time.sleep(2.0)  # the outage itself, not a synchronisation
        server = EmbeddedServer(port=port).start()
        code, _, err = finish(main)
        assert code == 0, err[-3000:]
    finally:
        stop(main)
        server.stop()
    ids = [e.event_id for e in events(db)]
    assert len(ids) == len(set(ids))
    check_counted_once(db, 4)
    # KF_DEVICE_MEASURE=0 (tests/conftest.py): kf run's worker timed nothing either
    devices = of_type(db, "device.announced")
    assert devices and all(d.capabilities["measured_copy_bandwidth_gbs"] is None for d in devices)


def test_faults_archivist_killed_and_restarted_resumes(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """SIGKILL of the archivist mid-run: restarted on its log, the run resumes and replays."""
    db, run = tmp_path / "run.db", "kill-archivist"
    url = nats_server.url
    archivist_args = [
        "agent",
        "archivist",
        "--nats",
        url,
        "--run",
        run,
        "--db",
        str(db),
        "--host",
        "archive",
    ]
    arch = kf_proc(*archivist_args)
    mutator = kf_proc("agent", "mutator", "--nats", url, "--run", run)
    worker = kf_proc(*worker_args(url, run, "w"))
    starter = kf_proc(*search_args(url, run, 4), "--join")
    arch2: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: of_type(db, "kernel.candidate_profiled"), 120, "a first result")
        arch.send_signal(signal.SIGKILL)
        arch.wait()
        arch2 = kf_proc(*archivist_args)
        code, out, err = finish(starter)
        assert code == 0, err[-3000:]
        (done,) = json.loads(out)["tasks"]
        assert done["candidates"] - done["tuned_candidates"] == 4
    finally:
        stop(starter, mutator, worker, arch, *([arch2] if arch2 else []))
    check_counted_once(db, 4)


def test_faults_malformed_events_are_rejected_and_the_run_goes_on(
    joined_run: dict[str, Any],
) -> None:
    """A rogue client's garbage on the run's inbound subject is rejected and counted, and the
    run goes on to judge every candidate (its replay check: the test above)."""
    assert joined_run["code"] == 0, joined_run["err"][-3000:]
    with EventLog(joined_run["db"], readonly=True) as elog:
        assert elog.rejected_count() == 5
    (task,) = json.loads(joined_run["out"])["tasks"]
    assert task["candidates"] - task["tuned_candidates"] == 10
    assert task["profiled"] + task["failed"] + task["duplicates"] == task["candidates"]


def test_faults_client_without_token_is_refused(tmp_path: Path) -> None:
    """A server with a token refuses a worker that has none, or a wrong one, and the worker
    says why in one line, at once: no warning per retry (there were 45-50 JSON lines)."""
    with EmbeddedServer(token="s3cret-" + uuid.uuid4().hex[:8]) as srv:
        no_token = srv.url.replace(f"{srv.token}@", "")
        wrong = srv.url.replace(f"{srv.token}@", "wrong-token@")
        for url in (no_token, wrong):
            proc = kf_proc("worker", "--nats", url, "--run", "x", "--name", "w")
            code, _, err = finish(proc, 60)
            assert code == 1
            lines = err.strip().splitlines()  # the shared login's warning (tests allow it)
            assert len(lines) == 2 and lines[0].startswith("kf worker: WARNING"), err
            assert "refused the credentials" in lines[1] and "Authorization Violation" in err
            assert "wrong-token" not in err


def _can_use_netns() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (`ip`) to create network namespaces"
    probe = f"kfprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return f"this machine does not allow network namespaces: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


_NETNS_SKIP = _can_use_netns()


@pytest.mark.skipif(_NETNS_SKIP is not None, reason=_NETNS_SKIP or "")
def test_faults_two_hosts_worker_in_another_network_namespace(tmp_path: Path) -> None:
    """nats-server and the run in one network namespace, the worker in another, over veth."""
    tag = f"{os.getpid() % 10000}"
    ns_a, ns_b = f"kfA{tag}", f"kfB{tag}"
    va, vb = f"kfva{tag}", f"kfvb{tag}"
    addr_a, addr_b = "10.231.0.1", "10.231.0.2"
    token = "tok" + uuid.uuid4().hex[:8]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    procs: list[subprocess.Popen[str]] = []
    try:
        ip("netns", "add", ns_a)
        ip("netns", "add", ns_b)
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", ns_a)
        ip("link", "set", vb, "netns", ns_b)
        ip("-n", ns_a, "addr", "add", f"{addr_a}/24", "dev", va)
        ip("-n", ns_b, "addr", "add", f"{addr_b}/24", "dev", vb)
        for ns, dev in ((ns_a, va), (ns_b, vb)):
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        from kf.bus import nats_server_binary

        nats = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns_a,
                nats_server_binary(),
                "-a",
                addr_a,
                "-p",
                "4222",
                "--auth",
                token,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(nats)  # type: ignore[arg-type]
        url = f"nats://{token}@{addr_a}:4222"
        db, run = tmp_path / "run.db", "two-hosts"
        main = kf_proc(
            *run_args(url, db, run, 3, "--no-worker"), prefix=("ip", "netns", "exec", ns_a)
        )
        worker = kf_proc(*worker_args(url, run, "far-worker"), prefix=("ip", "netns", "exec", ns_b))
        procs += [main, worker]
        code, _, err = finish(main)
        assert code == 0, err[-3000:]
        assert {x.device_id for x in of_type(db, "device.announced")} == {"far-worker"}
        check_counted_once(db, 3)
    finally:
        stop(*procs)
        subprocess.run(["ip", "netns", "del", ns_a], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", ns_b], check=False, capture_output=True)
