"""A candidate's box made quiet while something else is timed: every process in it
stopped (``SIGSTOP``), and a process the candidate started that holds a GPU killed.

A candidate's runner lives from its build to its profile (one box,
:attr:`~kf.evaluation.grader.session.GradingSession.candidate_key`), and a process it
forks at import would otherwise load the machine while eager and ``torch.compile`` are
timed, making the candidate's speed-ups larger (issue 43, NK2: 3.76× for a seed whose
honest figure is 2.34–2.57×). Stopping the box's processes is the kernel's own freeze:
a stopped process runs no code, cannot fork and cannot continue another; the box's
processes are found from its root (bwrap, whose PID namespace holds every process the
candidate starts, orphans included: they are reparented to the box's init). A stopped
process's kernels already queued on a GPU still run, so a process the candidate started
(not one of the box's own at start-up) that has a GPU device open is killed instead.

A process that is not stopped within :data:`STOP_LIMIT_S` (a box forking faster than it
is stopped) is :class:`StopFailed`: the caller kills the box.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

__all__ = ["STOP_LIMIT_S", "StopFailed", "Stopped", "box_processes", "resume", "stop"]

#: seconds a box's processes have to be stopped in
STOP_LIMIT_S = 2.0
#: a thread's states (/proc/<pid>/task/<tid>/stat) in which it runs no code: stopped,
#: stopped by a tracer, a zombie, dead
_STOPPED = frozenset("TtZXx")
#: uninterruptible sleep: in the kernel, it stops on its way back (accepted at the limit)
_IN_KERNEL = "D"


class StopFailed(Exception):
    """A box's processes could not all be stopped in time."""


class Stopped(NamedTuple):
    """What :func:`stop` found of the processes the candidate started: those killed (a
    GPU open), and those that were running when told to stop."""

    killed: list[int]
    busy: list[int]


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (a child is listed under the thread that
    made it)."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        with contextlib.suppress(OSError, ValueError):
            kids += [int(k) for k in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return kids


def box_processes(root: int) -> list[int]:
    """``root`` and every process below it."""
    out: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo += _children(pid)
    return out


def _states(pid: int) -> list[str]:
    """The state of each thread of ``pid`` (none: it is gone)."""
    states: list[str] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return states
    for tid in tids:
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


def _holds_gpu(pid: int) -> bool:
    """Whether ``pid`` has a GPU device node open (True where its descriptors cannot be
    read: a process that hides them is taken to hold one)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    except OSError:
        return True
    for fd in fds:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(("/dev/nvidia", "/dev/dri/")):
                return True
    return False


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def stop(root: int, own: Collection[int] | None = None) -> Stopped:
    """Stop every process of the box under ``root`` (bwrap, kf's own: left running, so
    that it still ends at once when the box is killed); with ``own`` (the box's processes
    before any candidate code ran), first kill each other process that has a GPU open.
    Raises :class:`StopFailed` when some still run after :data:`STOP_LIMIT_S`."""
    found = Stopped([], [])
    signalled: set[int] = set()
    deadline = time.monotonic() + STOP_LIMIT_S
    while True:
        pids = box_processes(root)[1:]
        for pid in pids:
            if pid in signalled:
                continue
            signalled.add(pid)
            if own is None or pid in own:
                _signal(pid, signal.SIGSTOP)
                continue
            if "R" in _states(pid):
                found.busy.append(pid)
            if _holds_gpu(pid):
                _signal(pid, signal.SIGKILL)
                found.killed.append(pid)
            else:
                _signal(pid, signal.SIGSTOP)
        running = {p: s for p in pids for s in _states(p) if s not in _STOPPED}
        if not running and set(box_processes(root)[1:]) == set(pids):
            return found
        if time.monotonic() > deadline:
            if all(s == _IN_KERNEL for s in running.values()):
                return found
            raise StopFailed(
                f"{len(running)} of its {len(pids)} processes still ran "
                f"{STOP_LIMIT_S:g} s after they were told to stop"
            )
        time.sleep(0.0005)  # a stop takes effect when the process is next scheduled


def resume(root: int) -> None:
    """Let every process of the box under ``root`` run again."""
    for pid in box_processes(root):
        _signal(pid, signal.SIGCONT)
