"""Stopping a command promptly and completely on SIGINT or SIGTERM.

``kf run``, ``kf worker`` and ``kf agent`` run their coroutine through :func:`run`:

- the first SIGINT or SIGTERM cancels the coroutine (its ``finally`` blocks run: agents
  stop and record what they cut short, connections close, the embedded nats-server
  stops, temporary folders go) and sets :func:`stopping`;
- once the coroutine has ended, every process this one started (runners in their
  boxes, build boxes and the compilers in them, profilers) is killed, again and again
  until the process exits: the threads that waited on them (``asyncio.to_thread``)
  then return at once, where they used to hold the exit until their build or stage
  had finished (60-80 s, docs/decisions.md "Stop means stop");
- if the process has not exited :data:`GRACE_S` seconds after the signal, or on a
  second signal, what is left is killed and the process exits at once
  (``os._exit``) with the signal's code (130 for SIGINT, 143 for SIGTERM).

The exit code is the shell's for death by that signal; :class:`Terminated` (SIGTERM)
and :class:`KeyboardInterrupt` (SIGINT) reach the caller once the clean-up is done.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

__all__ = [
    "BUS_LOST_S",
    "GRACE_S",
    "Terminated",
    "abandoned",
    "descendants",
    "dies_with_parent",
    "exit_process",
    "kill_descendants",
    "run",
    "stopping",
]

T = TypeVar("T")

#: seconds from the first signal until whatever is left is killed and the process exits
GRACE_S = 4.0
#: seconds without a connection to a NATS server kf did not start before a command gives
#: up (``--bus-timeout``, :func:`kf.app.orchestra.watch_bus`); an embedded one is restarted
BUS_LOST_S = 120.0

_stopping = threading.Event()
_abandoned = threading.Event()


class Terminated(Exception):
    """The command was stopped by a signal (SIGTERM) after cleaning up."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell's code for death by that signal (143 for SIGTERM)."""
        return 128 + self.signum


def stopping() -> bool:
    """Whether this process is stopping on a signal (no new work should start)."""
    return _stopping.is_set()


def dies_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that the kernel SIGKILLs it when the thread that started it ends
    (kf killed outright included): through util-linux's ``setpriv --pdeathsig KILL``,
    which execs it (same pid); unchanged where ``setpriv`` is missing. Start such a
    child from a thread that lives as long as the process (the main thread)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else list(argv)


def _parents() -> dict[int, list[int]]:
    """parent pid → its children's pids, of every live (not zombie) process in /proc."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def descendants(pid: int | None = None) -> list[int]:
    """The live processes below ``pid`` (this process by default), parents first."""
    tree = _parents()
    out: list[int] = []
    todo = [os.getpid() if pid is None else pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_descendants(rounds: int = 5) -> int:
    """SIGKILL every process below this one (a box's bwrap first: the kernel then ends
    its whole PID namespace); repeated while new ones appear. Returns how many."""
    killed = 0
    for _ in range(rounds):
        pids = descendants()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.02)
    return killed


def _say(message: str) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{message}\n")
        sys.stderr.flush()


def _exit_now(signum: int, why: str) -> None:
    """Kill what is left and leave at once with the signal's code."""
    _say(f"kf: {why}; stopping at once")
    kill_descendants()
    os._exit(128 + signum)


def _reap_until_exit() -> None:
    """Kill this process's children now and every 0.1 s until it exits (a stage's
    thread may start one more runner or build before it sees that it was cancelled)."""

    def loop() -> None:
        while True:
            kill_descendants(rounds=1)
            time.sleep(0.1)

    kill_descendants()
    threading.Thread(target=loop, name="kf-reaper", daemon=True).start()


def exit_process(code: int) -> None:
    """End a command stopped by a signal, now: stdio flushed, ``atexit`` handlers run
    (runner pools remove their scratch folders), then ``os._exit``. A normal exit
    would wait for the threads still busy with work the stop made moot (a hardware
    probe importing torch and timing a matmul: seconds) and collect every object a run
    made (1-3 s on a loaded 2-core machine)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    os._exit(code)


def abandoned() -> bool:
    """Whether :func:`run` left threads busy with work its stop made moot: the command
    must then end with :func:`exit_process` (a normal exit would wait for them)."""
    return _abandoned.is_set()


def _run_loop(main: Coroutine[Any, Any, T], failed: list[bool]) -> T:
    """``asyncio.run(main)``, except that once ``main`` has failed (a signal's stop
    included) it does not wait for the default executor's threads."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            if failed:
                _abandoned.set()
            else:
                loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _stopped(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def run(main: Coroutine[Any, Any, T], *, reap: bool = True) -> T:
    """``asyncio.run(main)``; SIGINT and SIGTERM cancel ``main`` (see the module doc).

    With ``reap`` (a command's own process) its child processes are killed once
    ``main`` has ended on a signal or an error (a part that died: its stages' builds
    and runners must not hold the exit either; see :func:`abandoned`). Raises
    :class:`KeyboardInterrupt` (SIGINT) or :class:`Terminated` (SIGTERM) after a stop
    on a signal."""
    got: list[int] = []
    failed: list[bool] = []
    where: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if got:
            _exit_now(signum, f"a second signal ({signal.Signals(signum).name})")
        got.append(signum)
        _stopping.set()
        timer = threading.Timer(
            GRACE_S, _exit_now, (signum, f"still stopping {GRACE_S:g} s after the signal")
        )
        timer.daemon = True
        timer.start()
        if where:
            loop, task = where[0]
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(task.cancel)

    async def guarded() -> T:
        task = asyncio.current_task()
        assert task is not None
        where.append((asyncio.get_running_loop(), task))
        try:
            if got:  # a signal before the loop ran
                main.close()
                raise asyncio.CancelledError
            return await main
        except BaseException:
            failed.append(True)
            if reap:
                _reap_until_exit()
            raise

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = _run_loop(guarded(), failed)
    except (asyncio.CancelledError, KeyboardInterrupt):
        if got:
            raise _stopped(got[0]) from None
        raise
    finally:
        if not got:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if got:
        raise _stopped(got[0])
    return result
