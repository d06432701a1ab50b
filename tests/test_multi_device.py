"""Several devices in one worker (kf.devices, agents.build_pool): the device argument,
device ids, the host's shared build slots, and a device that fails mid-run.

The end-to-end test runs a real nats-server, a real `kf run --no-worker` and a real
`kf worker --device cpu,cpu` (two CPU pipelines on the same cores: the multi-GPU
composition without GPUs) whose second device is made to fail; its candidates must be
re-dispatched to the first and every candidate counted once.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from agents.build_pool import BuildPool
from kf.bus import EmbeddedServer
from kf.devices.health import looks_like_device_error, probe_health
from kf.devices.names import cuda_device_count
from kf.devices.slots import DeviceError, device_slots, parse_devices, primary_device
from kf.events import decode_event
from tests.harness import kf_cli
from tests.test_faults import (
    ENV,
    check_counted_once,
    events,
    finish,
    kf_proc,
    of_type,
    run_args,
    stop,
)

ROOT = Path(__file__).resolve().parent.parent


STAGES = ("kernel.candidate_compiled", "kernel.candidate_verified", "kernel.candidate_profiled")


def two() -> int:
    return 2


def none() -> int:
    return 0


# -- the device argument ------------------------------------------------------------------


def test_multi_device_lists_and_all_expand_in_order() -> None:
    assert parse_devices("cpu") == ["cpu"]
    assert parse_devices("cpu,cpu") == ["cpu", "cpu"]
    assert parse_devices("cuda:all", cuda_count=two) == ["cuda:0", "cuda:1"]
    assert parse_devices(" CUDA:1 , cuda ", cuda_count=two) == ["cuda:1", "cuda:0"]
    assert parse_devices("cuda", cuda_count=two) == ["cuda:0"]
    assert primary_device("cuda:all") == "cuda:0"
    assert primary_device("cuda:1,cuda:0") == "cuda:1"


@pytest.mark.parametrize(
    ("spec", "count", "says"),
    [
        ("cuda:all", none, "no CUDA devices"),
        ("cuda:0", none, "no CUDA devices"),
        ("cuda:2", two, "this machine has 2 CUDA device(s)"),
        ("cuda:0,cuda:0", two, "more than once"),
        ("cuda:all,cuda:1", two, "more than once"),
        ("cpu,cuda:0", two, "mixes CPU and GPU"),
        ("cpu,,cpu", two, "empty entry"),
        ("", two, "empty entry"),
        ("tpu:0", two, "unknown device 'tpu:0'"),
    ],
)
def test_multi_device_bad_lists_say_why(spec: str, count: object, says: str) -> None:
    with pytest.raises(DeviceError, match=None) as err:
        parse_devices(spec, cuda_count=count)  # type: ignore[arg-type]
    assert says in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(cuda_device_count() > 0, reason="this machine has GPUs")
def test_multi_device_cuda_all_without_gpus_is_refused_by_run_and_worker() -> None:
    env = dict(ENV)
    for argv in (
        ["run", str(ROOT / "tests/fixtures/search/scale_relu.py"), "--device", "cuda:all"],
        ["worker", "--device", "cuda:all", "--run", "r", "--nats", "nats://127.0.0.1:1"],
    ):
        proc = kf_cli(*argv, env=env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "no CUDA devices" in proc.stderr
    helps = subprocess.run(
        [sys.executable, "-m", "kf.app.cli", "worker", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    ).stdout
    assert "cuda:all" in helps and "cuda:0,cuda:1" in helps


def test_multi_device_ids_one_per_device() -> None:
    assert [s.device_id for s in device_slots(["cuda:0"], "h")] == ["h/cuda:0"]
    assert [s.device_id for s in device_slots(["cuda:0"], "h", "gpu-1")] == ["gpu-1"]
    slots = device_slots(["cuda:0", "cuda:1"], "h", "box")
    assert [(s.device, s.device_id) for s in slots] == [
        ("cuda:0", "box/cuda:0"),
        ("cuda:1", "box/cuda:1"),
    ]
    assert [s.device_id for s in device_slots(["cpu", "cpu", "cpu"], "h")] == [
        "h/cpu",
        "h/cpu#2",
        "h/cpu#3",
    ]


def test_multi_device_failure_suspects_and_cpu_health() -> None:
    assert looks_like_device_error("crash", "")
    assert looks_like_device_error("exception", "RuntimeError: CUDA error: unspecified launch")
    assert not looks_like_device_error("mismatch", "max abs diff 0.5")
    assert not looks_like_device_error("compile_error", "error: expected ';'")
    assert probe_health("cpu") is None


# -- the shared build slots ----------------------------------------------------------------


async def test_multi_device_build_slots_go_to_the_least_supplied_device() -> None:
    """Device A asks for five builds, then B for one: B's waits only for the first slot
    to free, not for A's queue; and a device holding built work yields to one without."""
    pool = BuildPool(2)
    gates: dict[str, asyncio.Event] = {}
    order: list[str] = []

    async def build(device: str, name: str) -> None:
        async with pool.slot(device):
            order.append(name)
            gates[name] = asyncio.Event()
            await gates[name].wait()

    a = [asyncio.create_task(build("A", f"a{i}")) for i in range(5)]
    await asyncio.sleep(0)
    b = asyncio.create_task(build("B", "b0"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == ["a0", "a1"] and pool.busy() == 2
    gates["a0"].set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == ["a0", "a1", "b0"]  # B came later but had nothing built or building
    # A has two built candidates waiting for its device, B only the one it builds: when
    # A's slot frees, B's later request goes first again
    pool.add_built("A", "a0")
    pool.add_built("A", "a1")
    c = asyncio.create_task(build("B", "b1"))
    for _ in range(5):
        await asyncio.sleep(0)
    gates["a1"].set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert order[-1] == "b1"
    # a slot is never left idle while anyone waits
    for name in list(gates):
        gates[name].set()
    for _ in range(20):
        for name in list(gates):
            gates[name].set()
        await asyncio.sleep(0)
    await asyncio.gather(*a, b, c)
    assert sorted(order) == ["a0", "a1", "a2", "a3", "a4", "b0", "b1"]
    assert pool.busy() == 0
    pool.consumed("a0")
    pool.consumed("a1")
    assert pool.backlog("A") == 0


async def test_multi_device_build_slot_cancelled_while_waiting_is_returned() -> None:
    pool = BuildPool(1)
    hold = asyncio.Event()

    async def build(device: str) -> None:
        async with pool.slot(device):
            await hold.wait()

    first = asyncio.create_task(build("A"))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(build("B"))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    hold.set()
    await first
    assert pool.busy() == 0
    async with pool.slot("C"):
        assert pool.busy() == 1


# -- a local run's bus: one connection per device --------------------------------------------


async def test_multi_device_run_bus_connects_each_device_with_its_own_user() -> None:
    from kf.auth import RunBus

    rb = await RunBus.open("mdrun", url=None, device_ids=["h/cpu", "h/cpu#2"])
    try:
        assert set(rb.workers) == {"h/cpu", "h/cpu#2"}
        assert rb.workers["h/cpu"] is not rb.workers["h/cpu#2"]
        assert rb.worker is rb.workers["h/cpu"]
    finally:
        await rb.close()


# -- end to end: a device fails mid-run ---------------------------------------------------------


def test_multi_device_worker_failed_device_is_recorded_and_its_work_redispatched(
    tmp_path: Path,
) -> None:
    """`kf worker --device cpu,cpu`: candidates go to both devices; the second fails at the
    end of its second stage (injected); it is recorded as left with the reason, its
    candidates are re-assigned to the first, and each candidate is counted once."""
    server = EmbeddedServer().start()
    db, run = tmp_path / "run.db", "multi-device"
    failing = "wA/cpu#2"
    # 7 candidates: the offline mutator repeats itself now and then, and a repeat is a
    # duplicate that no device builds, so 5 could leave the second device one stage short
    main = kf_proc(*run_args(server.url, db, run, 7, "--no-worker", "--max-in-flight", "4"))
    worker_log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "kf.app.cli", "worker", "--device", "cpu,cpu", "--nats", server.url,
         "--run", run, "--name", "wA", "--heartbeat", "0.5"],
        cwd=ROOT, env=dict(ENV, KF_DEVICE_FAULTS=f"{failing}@2"),
        stdout=subprocess.DEVNULL, stderr=worker_log, text=True,
    )  # fmt: skip
    try:
        code, _, err = finish(main)
        assert code == 0, err[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        stop(main, worker)
        worker_log.close()
        server.stop()
    announced = {x.device_id for x in of_type(db, "device.announced")}
    assert announced == {"wA/cpu", failing}
    left = [x for x in of_type(db, "device.left") if x.device_id == failing]
    assert len(left) == 1 and left[0].reason.startswith("device failed: fault injected")
    assigned = of_type(db, "search.candidate_assigned")
    on_failing = {x.candidate_id for x in assigned if x.device_id == failing}
    assert on_failing, "no candidate was sent to the second device"
    # what the failing device did before it failed is in the log, under its id
    assert [x for x in of_type(db, "kernel.candidate_compiled") if x.device_id == failing]
    moved = [x for x in assigned if x.candidate_id in on_failing and x.device_id == "wA/cpu"]
    assert moved and all(x.attempt >= 2 for x in moved)
    log = events(db)
    failed_at = next(e.seq for e in log if e.type == "device.left")
    late = [
        decode_event(e).device_id  # type: ignore[attr-defined]
        for e in log
        if e.seq is not None and failed_at is not None and e.seq > failed_at
        and e.type in STAGES
    ]  # fmt: skip
    assert late and failing not in late, "the failed device kept working"
    check_counted_once(db, 7)


# -- on GPUs (the lead's machine; skipped here) -------------------------------------------------

GPUS = cuda_device_count()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs an NVIDIA GPU and a CUDA build of PyTorch")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two NVIDIA GPUs on this host")
CUDA_TASK = ROOT / "examples" / "cuda_tasks" / "gelu_residual.py"


@pytest.mark.gpu
@needs_gpu
def test_multi_device_gpu_all_expands_and_a_working_gpu_is_healthy() -> None:
    assert parse_devices("cuda:all") == [f"cuda:{i}" for i in range(GPUS)]
    assert probe_health("cuda:0") is None


def _counted_once(db: Path) -> None:
    """Every candidate ended once (a GPU task's mutations may propose fewer than the
    budget), and replay --check passes."""
    from kf.app.report import build_report

    task = build_report(db)["tasks"][0]
    assert task["candidates"] > 0
    assert task["profiled"] + task["failed"] + task["duplicates"] == task["candidates"]
    chk = subprocess.run(
        [sys.executable, "-m", "kf.app.cli", "replay", str(db), "--check"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert chk.returncode == 0, chk.stdout + chk.stderr


def _gpu_run(tmp_path: Path, budget: int, **env: str) -> Path:
    db = tmp_path / "run.db"
    proc = subprocess.run(
        [sys.executable, "-m", "kf.app.cli", "run", str(CUDA_TASK), "--device", "cuda:0,cuda:1",
         "--budget", str(budget), "--islands", "1", "--db", str(db), "--json"],
        cwd=ROOT, env=dict(ENV, **env), capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return db


@pytest.mark.gpu
@needs_two_gpus
def test_multi_device_two_gpus_both_profile_candidates(tmp_path: Path) -> None:
    from hardware_agents.cpu import host_id

    db = _gpu_run(tmp_path, 8)
    ids = {f"{host_id()}/cuda:0", f"{host_id()}/cuda:1"}
    assert {x.device_id for x in of_type(db, "device.announced")} == ids
    assert {x.device_id for x in of_type(db, "kernel.candidate_profiled")} == ids
    _counted_once(db)


@pytest.mark.gpu
@needs_two_gpus
def test_multi_device_two_gpus_one_fails_and_the_other_finishes(tmp_path: Path) -> None:
    from hardware_agents.cpu import host_id

    failing = f"{host_id()}/cuda:1"
    db = _gpu_run(tmp_path, 6, KF_DEVICE_FAULTS=f"{failing}@2")
    left = [x for x in of_type(db, "device.left") if x.device_id == failing]
    assert len(left) == 1 and left[0].reason.startswith("device failed")
    _counted_once(db)
