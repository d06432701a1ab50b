"""Helpers for integration tests: wait on conditions, run archivists, count the log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from agents.archivist import Archivist
from kf import bus
from kf.agent import AgentContext
from kf.events import decode_event, make_envelope
from kf.log import EventLog
from kf.runtime import fetch_range
from tests.llm_server import ScriptedServer
from tests.tally import Pinged, Tally

ROOT = Path(__file__).resolve().parent.parent
#: the tiny fusion task relu(x * 2 + b) on a 64 x 256 input, its seed in seeds/ beside it
SCALE_RELU = ROOT / "tests/fixtures/search/scale_relu.py"


def seedless_scale_relu(folder: Path, rows: int = 64, cols: int = 256) -> Path:
    """SCALE_RELU written into ``folder`` with no seeds/ beside it (an LLM writes the first
    kernels), its input ``rows`` x ``cols``: the file's path."""
    source = SCALE_RELU.read_text()
    for old, new in (("randn(64, 256)", f"randn({rows}, {cols})"), ("[256]", f"[{cols}]")):
        assert old in source, f"{SCALE_RELU} no longer has {old!r}"
        source = source.replace(old, new)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SCALE_RELU.name
    path.write_text(source)
    return path


def run_kf(
    *args: str, timeout: float = 300, eval_threads: str | None = "1"
) -> subprocess.CompletedProcess[str]:
    """``python -m kf.app.cli ARGS`` from the repository root, quiet logs, no LLM API keys in
    its environment (the tests' models are scripted), one evaluation thread unless
    ``eval_threads`` is None; output captured as text."""
    env = dict(os.environ, KF_LOG_LEVEL="WARNING")
    if eval_threads is not None:
        env["KF_EVAL_THREADS"] = eval_threads
    env.pop("KF_LLM_API_KEY", None)
    env.pop("OPENAI_API_KEY", None)
    return kf_cli(*args, env=env, timeout=timeout)


def kf_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m kf.app.cli ARGS`` run by :func:`ran`."""
    return ran([sys.executable, "-m", "kf.app.cli", *args], env=env, cwd=cwd, timeout=timeout)


def ran(
    argv: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``argv`` run to its end in ``cwd`` under ``env`` (None: this process's), its output
    captured as text; its exit status is the caller's to check."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def kf_proc(
    *args: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """``python -m kf.app.cli ARGS`` started from the repository root (after ``prefix``, a
    command it runs under) under ``env`` (None: this process's), its output piped."""
    return piped([*prefix, sys.executable, "-m", "kf.app.cli", *args], env=env)


def piped(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``argv`` started from the repository root under ``env`` (None: this process's),
    its output piped as text."""
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@contextlib.contextmanager
def killed_at_exit(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``proc``, killed and reaped if it is still running when the block ends."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def scripted_llm_run(
    responder: Callable[[dict[str, Any]], dict[str, Any]],
    task: Path,
    db: Path,
    *args: str,
    timeout: float = 300,
    eval_threads: str | None = "1",
) -> tuple[dict[str, Any], str]:
    """``kf run TASK --llm-url URL --model scripted --db DB --json ARGS`` against a scripted
    server (tests/llm_server.py) that ``responder`` answers: the run's report and the
    server's URL; the server is stopped when this returns, and a failed run fails the test
    with kf's stderr."""
    with ScriptedServer(responder=responder) as server:
        url = server.url
        proc = run_kf(
            "run", str(task), "--llm-url", url, "--model", "scripted", "--db", str(db),
            "--json", *args, timeout=timeout, eval_threads=eval_threads,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    return report, url


def replay_check(db: Path) -> dict[str, Any]:
    """``kf replay DB --check --json``'s output, the test failed unless it exited 0 with
    the check passed."""
    proc = run_kf("replay", str(db), "--check", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    assert out["check"]["ok"] is True, out["check"]
    return out


def logged(db: Path, tag: str) -> list[Any]:
    """The events of type ``tag`` in the log at ``db``, decoded, in log order."""
    with EventLog(db, readonly=True) as elog:
        return [decode_event(e) for e in elog.read(types=[tag])]


async def wait_for(
    cond: Callable[[], Any] | Callable[[], Awaitable[Any]], timeout_s: float = 30.0, what: str = ""
) -> Any:
    """Poll ``cond`` until truthy; fail with ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or cond}")
        await asyncio.sleep(0.02)


async def log_head(nc: Any, run_id: str) -> int:
    """The committed head as the archivist reports it (0 when it does not answer)."""
    try:
        head, _ = await fetch_range(nc, run_id, 1, limit=0, timeout_s=0.5)
        return head
    except Exception:
        return -1


@contextlib.asynccontextmanager
async def archivist(
    url: str,
    run_id: str,
    db: Path,
    hosted: tuple[type, ...] = (Tally,),
    options: bus.BusOptions | None = None,
) -> AsyncIterator[Archivist]:
    """An in-process archivist, ready on entry, drained on exit (connected with
    ``options``, e.g. a run's archivist credentials; None: plainly to ``url``)."""
    nc = await bus.connect(options or bus.BusOptions(url))
    stop, ready = asyncio.Event(), asyncio.Event()
    arch = Archivist(
        AgentContext(run_id=run_id, agent_id="archivist@test"), db=db, hosted=hosted, nc=nc
    )
    task = asyncio.create_task(arch.run(stop, ready))
    await asyncio.wait({task, asyncio.create_task(ready.wait())}, return_when="FIRST_COMPLETED")
    if task.done():
        task.result()
    try:
        yield arch
    finally:
        stop.set()
        await task
        await bus.close(nc)


def archivist_process(url: str, run_id: str, db: Path) -> subprocess.Popen[bytes]:
    """The archivist (hosting Tally) as a separate process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.archivist_proc", url, run_id, str(db)], cwd=ROOT, env=env
    )


def pings(producer: str, count: int, run_id: str, start: int = 0) -> list[Any]:
    """Envelopes of ``count`` pings with ids fixed by producer and index."""
    return [
        make_envelope(
            Pinged(producer=producer, n=i),
            run_id=run_id,
            source=f"{producer}@test",
            event_id=f"{producer}-{i}",
        )
        for i in range(start, start + count)
    ]
