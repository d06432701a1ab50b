"""Stop means stop (issue 34): ``kf run`` stopped mid-build, with real processes.

One task whose seed's ``kf.native`` build includes, while the test wants it slow, a
header of the test's (``kf_slow.h`` in the build cache, which every build box sees)
that makes the compiler evaluate constant expressions for minutes: a real g++ in the
grader's build box, busy until it is killed. Then, on the same ``--db``:

1. SIGINT mid-build: exit 130 within the bound, the compiler's ``agent.stopped`` names
   the candidate it cut short, no candidate is failed, no process of the run is left;
2. resumed, SIGTERM mid-build: exit 143 within the bound, nothing left, the embedded
   nats-server's folder removed;
3. SIGKILL of ``kf run`` itself mid-build: its nats-server, runners and build box go
   with it (parent-death signals, bwrap's ``--die-with-parent``);
4. the header removed, the run resumed: it finishes, the seed is built, verified and
   timed once, and ``kf replay --check`` passes.

The bound is the requirement's 5 s plus 5 s for a loaded 2-core machine. A second
signal, and a clean-up that hangs, are tested on :func:`kf.shutdown.run` itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from kf import bus
from kf.bus import EmbeddedServer
from kf.events import decode_event
from kf.shutdown import descendants
from tests.harness import killed_at_exit, piped, replay_check
from tests.test_faults import ENV, ROOT, events, kf_proc, wait_until

STOP_BOUND_S = 10.0  # 5 s asked for, plus a margin for the 2-core CI machine
SEED = ROOT / "tests/fixtures/search/seeds/scale_relu.py"
TASK = ROOT / "tests/fixtures/search/scale_relu.py"

#: constant evaluation that keeps cc1plus busy for minutes (each KfSpin<K> is its own
#: evaluation, under g++'s per-expression operation limit)
SLOW_HEADER = textwrap.dedent(
    """
    #include <cstdint>
    #include <utility>
    constexpr uint64_t kf_spin(uint64_t k) {
        uint64_t s = k;
        for (uint64_t j = 0; j < 200000; ++j) s = s * 6364136223846793005ULL + j;
        return s;
    }
    template <uint64_t K> struct KfSpin { static constexpr uint64_t value = kf_spin(K); };
    template <uint64_t... K> constexpr uint64_t kf_spun(std::integer_sequence<uint64_t, K...>) {
        return (KfSpin<K>::value ^ ... ^ 0);
    }
    static_assert(kf_spun(std::make_integer_sequence<uint64_t, 400>{}) != 1, "slow on purpose");
    """
)


def include_slow(header: Path) -> str:
    """C++ that includes ``header`` while it exists."""
    return f'#if __has_include("{header}")\n#include "{header}"\n#endif\n'


def native_seed(header: Path) -> str:
    """The CPU search fixture's seed, its kf.native source including the slow header."""
    seed = SEED.read_text()
    return seed.replace("#include <cstdint>\n", "#include <cstdint>\n" + include_slow(header), 1)


def inline_seed(header: Path) -> str:
    """A load_inline seed (GPU) whose C++ source includes the slow header."""
    seed = (ROOT / "tests/fixtures/honest/load_inline_attr.py").read_text()
    return seed.replace(
        "\nmodule = load_inline(",
        f"\ncpp_source = {include_slow(header)!r} + cpp_source\n\nmodule = load_inline(",
        1,
    )


def slow_task(
    tmp_path: Path, task: Path = TASK, seed_for: Any = native_seed
) -> tuple[Path, Path, dict[str, str]]:
    """The task, its seed including the slow header when it exists, the header, the env."""
    cache = tmp_path / "cache"
    cache.mkdir()
    header = cache / "kf_slow.h"
    header.write_text(SLOW_HEADER)
    folder = tmp_path / "tasks"
    (folder / "seeds").mkdir(parents=True)
    (folder / task.name).write_text(task.read_text())
    seed = seed_for(header)
    assert str(header) in seed
    (folder / "seeds" / task.name).write_text(seed)
    env = {**ENV, "KF_CACHE_DIR": str(cache)}
    return folder / task.name, header, env


def kf_run(task: Path, db: Path, env: dict[str, str], device: str) -> subprocess.Popen[str]:
    return kf_proc(
        "run", str(task), "--db", str(db), "--budget", "1", "--islands", "1",
        "--tune-budget", "0", "--device", device,
        # a resumed run's device re-announces after its probe, which on a loaded
        # machine outlasted the default 30 s: the archivist then declared it lost
        # and re-dispatched the candidate its compiler was redoing (built twice)
        "--heartbeat-timeout", "300", "--json", env=env,
    )  # fmt: skip


def started(pid: int) -> str | None:
    """The process's start time (to tell it from a later one with the same pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else fields[19]


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def mid_build(proc: subprocess.Popen[str], db: Path) -> dict[int, tuple[str | None, str]]:
    """Wait until the seed, assigned, is being compiled below ``proc``; return every
    process below it then (pid → (start time, command line))."""

    def compiling() -> bool:
        if not of(db, "search.candidate_assigned"):
            return False  # not some other build (a GPU's precompiled header)
        return any("cc1plus" in command(p) for p in descendants(proc.pid))

    wait_until(lambda: compiling() or proc.poll() is not None, 300, "the seed's build")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    time.sleep(1.0)  # well inside the build (minutes long)
    return {p: (started(p), command(p)) for p in descendants(proc.pid)}


def left(before: dict[int, tuple[str | None, str]]) -> list[str]:
    """Which of ``before`` still run (the same processes, not reused pids)."""
    return [cmd[:120] for p, (t, cmd) in before.items() if t is not None and started(p) == t]


def gone(before: dict[int, tuple[str | None, str]], within_s: float = 5.0) -> None:
    """Every process of ``before`` has ended (a killed box's namespace is emptied by the
    kernel a moment after its bwrap dies; a GPU runner's teardown takes longer)."""
    deadline = time.monotonic() + within_s
    while left(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left(before) == []


def server_folder(cmd: str) -> Path:
    """The embedded nats-server's temporary folder, from its command line."""
    argv = cmd.split()
    return Path(argv[argv.index("-c") + 1]).parent


def stop_and_time(proc: subprocess.Popen[str], sig: int) -> tuple[float, int, str]:
    """Send ``sig``; the seconds until the process has exited, its code and stderr."""
    began = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"still running 120 s after signal {sig}: {err[-3000:]}") from None
    return time.monotonic() - began, proc.returncode, err


def of(db: Path, tag: str) -> list[Any]:
    return [decode_event(e) for e in events(db) if e.type == tag]


def kinds(before: dict[int, tuple[str | None, str]]) -> set[str]:
    names = {"nats-server": "nats-server", "kf.evaluation.runner": "runner", "cc1plus": "cc1plus"}
    return {
        name for cmd in (c for _, c in before.values()) for k, name in names.items() if k in cmd
    }


def test_stop_kf_run_mid_build_on_signals_and_sigkill_then_resume(tmp_path: Path) -> None:
    """See the module doc: SIGINT, SIGTERM, SIGKILL mid-build, then a resume."""
    stop_mid_build(*slow_task(tmp_path), tmp_path / "run.db", "cpu")


def _no_gpu() -> str | None:
    if shutil.which("nvcc") is None:
        return "needs nvcc for load_inline"
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA GPU"


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_stop_kf_run_mid_load_inline_build_on_the_gpu(tmp_path: Path) -> None:
    """The same on a GPU, with a load_inline build (ninja, g++ and nvcc in the build
    box) in flight; skipped without a GPU."""
    why = _no_gpu()
    if why is not None:
        pytest.skip(why)
    task = ROOT / "tests/fixtures/eval/task_gelu.py"
    stop_mid_build(*slow_task(tmp_path, task, inline_seed), tmp_path / "run.db", "cuda")


def stop_mid_build(task: Path, header: Path, env: dict[str, str], db: Path, device: str) -> None:
    """Steps 1-4 of the module doc on ``device``."""
    procs: list[subprocess.Popen[str]] = []
    try:
        # 1. SIGINT mid-build
        procs.append(main := kf_run(task, db, env, device))
        before = mid_build(main, db)
        assert kinds(before) == {"nats-server", "runner", "cc1plus"}, before
        took, code, err = stop_and_time(main, signal.SIGINT)
        assert code == 130, err[-3000:]
        assert took <= STOP_BOUND_S, f"SIGINT took {took:.1f} s"
        assert "kf run: interrupted; evaluations in flight were cut short" in err
        gone(before)
        (proposed,) = of(db, "kernel.candidate_proposed")
        compiler = [s for s in of(db, "agent.stopped") if s.kind == "compiler"]
        assert [s.reason for s in compiler] == [
            "interrupted: cut short, redone on resume: search.candidate_assigned "
            f"#{next(e.seq for e in events(db) if e.type == 'search.candidate_assigned')} "
            f"({proposed.candidate_id})"
        ]
        assert of(db, "kernel.candidate_compiled") == []  # cut short, not failed

        # 2. resumed, SIGTERM mid-build
        procs.append(main := kf_run(task, db, env, device))
        before = mid_build(main, db)
        (folder,) = [server_folder(c) for _, c in before.values() if "nats-server" in c]
        took, code, err = stop_and_time(main, signal.SIGTERM)
        assert code == 143, err[-3000:]
        assert "kf run: terminated by SIGTERM; evaluations in flight were cut short" in err
        assert took <= STOP_BOUND_S, f"SIGTERM took {took:.1f} s"
        gone(before)
        assert not folder.exists()

        # 3. SIGKILL of kf run itself: everything it started goes with it
        procs.append(main := kf_run(task, db, env, device))
        before = mid_build(main, db)
        main.send_signal(signal.SIGKILL)
        main.wait()
        gone(before, STOP_BOUND_S)
        assert of(db, "kernel.candidate_compiled") == []

        # 4. resumed with a fast build: it finishes and replays
        header.unlink()
        procs.append(main := kf_run(task, db, env, device))
        out, err = main.communicate(timeout=600)
        assert main.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    (done,) = json.loads(out)["tasks"]
    assert (done["candidates"], done["compiled"], done["profiled"]) == (1, 1, 1), done
    assert [c.report.ok for c in of(db, "kernel.candidate_compiled")] == [True]
    replay_check(db)


#: a command whose clean-up hangs, with a child process, under kf.shutdown.run
HANGING = """
import asyncio, subprocess, sys
from kf import shutdown

async def main():
    child = subprocess.Popen(["sleep", "600"])
    print(child.pid, flush=True)
    try:
        await asyncio.sleep(600)
    finally:
        await asyncio.sleep(600)  # a clean-up that never ends

try:
    shutdown.run(main())
except KeyboardInterrupt:
    sys.exit(130)
except shutdown.Terminated as exc:
    sys.exit(exc.exit_code)
"""


def hanging() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HANGING],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_stop_second_signal_stops_at_once_and_kills_the_children() -> None:
    """A clean-up that hangs: a second signal (Ctrl-C) ends the process at once, with
    130, its children killed."""
    proc, child = hanging()
    child_started = started(child)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the first signal's clean-up is under way (and hangs)
    took, code, err = stop_and_time(proc, signal.SIGINT)
    assert code == 130, err
    assert "kf: a second signal (SIGINT); stopping at once" in err
    assert took <= 2.0 + shutdown_margin()
    assert started(child) != child_started


def test_stop_clean_up_that_hangs_is_cut_off_after_the_grace() -> None:
    """One SIGTERM and a clean-up that hangs: after kf.shutdown.GRACE_S what is left is
    killed and the process exits 143."""
    from kf.shutdown import GRACE_S

    proc, child = hanging()
    child_started = started(child)
    took, code, err = stop_and_time(proc, signal.SIGTERM)
    assert code == 143, err
    assert f"kf: still stopping {GRACE_S:g} s after the signal; stopping at once" in err
    assert GRACE_S - 0.5 <= took <= GRACE_S + shutdown_margin()
    assert started(child) != child_started


def shutdown_margin() -> float:
    """Slack for a loaded 2-core machine."""
    return 3.0


def test_stop_worker_gives_up_on_a_bus_that_stays_gone() -> None:
    """A ``kf worker`` whose nats-server is gone for good exits 3 with one line once
    ``--bus-timeout`` has passed, instead of reconnecting for ever."""
    server = EmbeddedServer().start()
    argv = ["worker", "--nats", server.url, "--run", "lost", "--name", "w", "--bus-timeout", "3"]
    worker = kf_proc(*argv)
    try:
        asyncio.run(announced(server.url, "lost"))  # the worker is up: its device announced
        server.stop()
        began = time.monotonic()
        _, err = worker.communicate(timeout=120)
        took = time.monotonic() - began
    finally:
        server.stop()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 3, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("kf worker: lost the NATS server at nats://127.0.0.1:"), last
    assert last.endswith("for 3 s (--bus-timeout); giving up"), last
    assert 3.0 <= took <= 3.0 + STOP_BOUND_S, f"gave up after {took:.1f} s"


async def announced(url: str, run: str, timeout_s: float = 120.0) -> None:
    """Wait until a worker of ``run`` sends its device's announcement on the bus."""
    nc = await bus.connect(bus.BusOptions(url))
    seen = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        if b"device.announced" in msg.data:
            seen.set()

    try:
        await nc.subscribe(f"kf.{run}.in.>", cb=on_msg)
        await asyncio.wait_for(seen.wait(), timeout_s)
    finally:
        await bus.close(nc)


#: a candidate that says so in its runner's log, then never returns from forward
HANGING_CANDIDATE = (
    (ROOT / "tests/fixtures/eval/hang.py")
    .read_text()
    .replace(
        "        while True:",
        '        print("kf-test: in forward", flush=True)\n        while True:',
    )
)


def in_forward() -> int | None:
    """The bwrap (this process's child) of the box whose candidate is in its forward."""
    for pid in descendants():
        if parent(pid) != os.getpid() or "kf.evaluation.runner" not in command(pid):
            continue
        try:  # the runner's output goes to runner.log in its scratch folder, its cwd
            said = (Path(f"/proc/{pid}/cwd") / "runner.log").read_text(errors="replace")
        except OSError:
            continue
        if "kf-test: in forward" in said:
            return pid
    return None


def test_stop_a_box_killed_mid_stage_is_a_crash_with_its_signal_not_a_hang() -> None:
    """SIGKILL of a candidate's box (its bwrap) while the candidate runs: the stage ends
    within the bound with a crash that names the signal, not at its 600 s timeout."""
    from concurrent.futures import ThreadPoolExecutor

    from kf.evaluation import RunnerPool, verify_candidate
    from kf.kernels.tasks import load_task

    task = load_task(ROOT / "tests/fixtures/eval/task_gelu.py")
    assert "kf-test: in forward" in HANGING_CANDIDATE
    pool = RunnerPool(size=0, threads=1)
    try:
        with ThreadPoolExecutor(1) as threads:
            report = threads.submit(
                verify_candidate, task, HANGING_CANDIDATE, pool=pool, timeout_s=600
            )
            box = wait_until(in_forward, 180, "the candidate in its forward")
            os.kill(box, signal.SIGKILL)
            began = time.monotonic()
            result = report.result(timeout=120)
            took = time.monotonic() - began
    finally:
        pool.close()
    assert not result.correct
    assert result.failure_kind == "crash", result
    assert "SIGKILL" in (result.error or ""), result.error
    assert took <= STOP_BOUND_S, f"the stage took {took:.1f} s to notice"


def parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[1])


#: compiles a candidate (argv[1]) for the search task, prints how it ended
COMPILING = """
import json, sys
from kf.evaluation import RunnerPool, compile_candidate
from kf.kernels.tasks import load_task

report = compile_candidate(
    load_task(sys.argv[1]), open(sys.argv[2]).read(), pool=RunnerPool(size=0, threads=1)
)
print(json.dumps({"ok": report.ok, "kind": report.failure_kind, "error": report.error}))
"""


def test_stop_a_box_killed_while_the_grader_builds_for_it_ends_the_build(
    tmp_path: Path,
) -> None:
    """SIGKILL of a runner's box while the grader builds its kf.native library (a build
    of minutes): the build is killed with it and the stage ends within the bound, a
    crash naming SIGKILL, instead of waiting for the build."""
    task, _, env = slow_task(tmp_path)
    seed = tmp_path / "tasks/seeds" / task.name
    argv = [sys.executable, "-c", COMPILING, str(task), str(seed)]
    with killed_at_exit(piped(argv, env=env)) as proc:

        def building() -> int | None:
            below = descendants(proc.pid)
            if not any("cc1plus" in command(p) for p in below):
                return None
            return next((p for p in below if parent(p) == proc.pid and runner(p)), None)

        box = wait_until(lambda: building() or proc.poll() is not None, 180, "the build")
        assert proc.poll() is None, proc.communicate()
        before = {p: (started(p), command(p)) for p in descendants(proc.pid)}
        os.kill(box, signal.SIGKILL)
        began = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - began
    report = json.loads(out.strip().splitlines()[-1])
    assert (report["ok"], report["kind"]) == (False, "crash"), (report, err[-2000:])
    assert "SIGKILL" in report["error"], report
    assert took <= STOP_BOUND_S, f"the stage took {took:.1f} s to notice"
    gone(before)  # the build box and its compiler too


def runner(pid: int) -> bool:
    return "kf.evaluation.runner" in command(pid)
