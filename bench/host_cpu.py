"""Where a host's CPU-seconds go, by kind of process, while something runs.

A thread reads ``/proc`` every ``interval_s`` (0.25 s): each process's user + system
time (``/proc/PID/stat``, fields 14 and 15) and what it is (its command line), and adds
the time each used since the last read to its kind (:func:`kind_of`: nvcc's parts, the
C++ compiler, the linker, kf's boxed runners, the grader, inductor's compile workers,
nats-server, the rest). With ``root``, only that process and its descendants count (a
box's processes descend from their grader). Against that, the whole host's busy time
from ``/proc/stat``: what the processes' sum misses (processes that lived less than one
interval, the time a process used after its last read, and with ``root`` every other
process) is reported as ``unseen``.

    with HostCpu() as cpu:
        ...
    cpu.summary()  # {"span_s", "host_busy_s", "cores", "by_kind": {kind: CPU-seconds}, "unseen_s"}

Linux only (``/proc``). Used by bench/throughput_gpu.py; alone:

    python bench/host_cpu.py -- COMMAND ARGS...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["HostCpu", "kind_of"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: kind → the program names (argv[0]'s last part) that make a process that kind
PROGRAMS: dict[str, tuple[str, ...]] = {
    "nvcc": ("nvcc", "cicc", "ptxas", "fatbinary", "nvlink", "cudafe++", "bin2c"),
    "c++ compiler": ("cc1plus", "cc1", "g++", "gcc", "c++", "cc", "as"),
    "linker": ("ld", "ld.gold", "ld.bfd", "collect2"),
    "bubblewrap": ("bwrap", "setpriv", "prlimit"),
    "nats-server": ("nats-server",),
    "ninja": ("ninja",),
}
#: kind → what in a Python process's arguments makes it that kind, first match wins
MODULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("boxed runners", ("kf.evaluation.runner",)),
    ("build writer", ("kf.evaluation.grader.inline_writer",)),
    ("object cache launchers", ("kf.cuda.objcache",)),
    ("build box Python", ("inline.load_inline(**json.loads",)),
    ("inductor compile workers", ("compile_worker", "torch._inductor", "triton")),
    ("kf grader and agents", ("kf.app.cli", "kf.evaluation.grader")),
)


def kind_of(cmdline: str) -> str:
    """The kind of a process by its command line (NUL-separated, as ``/proc`` gives it)."""
    argv = [a for a in cmdline.split("\0") if a]
    if not argv:
        return "other"
    program = os.path.basename(argv[0])
    for kind, names in PROGRAMS.items():
        if program in names or program.endswith(tuple("-" + n for n in names)):
            return kind
    for kind, marks in MODULES:
        if any(m in arg for arg in argv[1:] for m in marks):
            return kind
    if program == "kf" or any(os.path.basename(arg) == "kf" for arg in argv[1:2]):
        return "kf grader and agents"  # the `kf` script, or `python .../bin/kf`
    return "other"


def _busy_ticks() -> tuple[int, int]:
    """(busy ticks, all ticks) of the whole host from ``/proc/stat``'s first line."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _processes(root: int | None = None) -> dict[int, tuple[int, str]]:
    """pid → (user + system ticks, command line) of every process readable now; with
    ``root``, only that process and its descendants."""
    out: dict[int, tuple[int, str]] = {}
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmd = Path(entry.path, "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        # the command name may hold spaces and parentheses: fields start after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        out[int(entry.name)] = (ticks, cmd or f"[{name}]")
        parents[int(entry.name)] = int(fields[1])  # ppid (field 4)
    if root is None:
        return out
    mine = {root}
    for pid in out:
        chain, at = [], pid
        while at not in mine and at in parents and len(chain) < 64:
            chain.append(at)
            at = parents[at]
        if at in mine:
            mine.update(chain)
    return {pid: v for pid, v in out.items() if pid in mine}


class HostCpu:
    """The sampler (a context manager); :meth:`summary` after it ends."""

    def __init__(self, interval_s: float = 0.25, root: int | None = None) -> None:
        """``root``: count only this process and its descendants (None: every process)."""
        self.interval_s = interval_s
        self.root = root
        self.by_kind: dict[str, float] = {}
        self.pids: dict[str, set[tuple[int, str]]] = {}  # kind → the processes seen using CPU
        self._seen: dict[int, tuple[int, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-cpu", daemon=True)
        self._start = (0.0, 0, 0)
        self._end = (0.0, 0, 0)

    def __enter__(self) -> HostCpu:
        self._seen = _processes(self.root)  # what ran before counts from now on
        self._start = (time.monotonic(), *_busy_ticks())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()
        self._end = (time.monotonic(), *_busy_ticks())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._read()

    def _read(self) -> None:
        now = _processes(self.root)
        for pid, (ticks, cmd) in now.items():
            before = self._seen.get(pid)
            # an exec keeps the pid and its time (bwrap, setpriv, prlimit, then python):
            # the time since the last read goes to what runs now; fewer ticks than
            # before is a new process under a reused pid
            used = ticks - before[0] if before is not None and ticks >= before[0] else ticks
            if used > 0:
                kind = kind_of(cmd)
                self.by_kind[kind] = self.by_kind.get(kind, 0.0) + used / _TICK
                self.pids.setdefault(kind, set()).add((pid, cmd))
        self._seen = now

    def summary(self) -> dict[str, Any]:
        """CPU-seconds by kind over the span, the host's busy CPU-seconds and the rest."""
        span = self._end[0] - self._start[0]
        busy = (self._end[1] - self._start[1]) / _TICK
        counted = sum(self.by_kind.values())
        return {
            "span_s": round(span, 1),
            "cores": os.cpu_count(),
            "host_busy_s": round(busy, 1),
            "by_kind": {
                k: round(v, 1) for k, v in sorted(self.by_kind.items(), key=lambda kv: -kv[1])
            },
            # time the counted processes used after their last read, processes shorter
            # than a read's interval, and (with a root) every other process on the host
            "processes_by_kind": {k: len(v) for k, v in self.pids.items()},
            "unseen_s": round(max(0.0, busy - counted), 1),
            "counted": "every process" if self.root is None else f"pid {self.root} and below",
        }


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python bench/host_cpu.py -- COMMAND ARGS...", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1 :]
    with HostCpu(root=os.getpid()) as cpu:
        rc = subprocess.call(command)
    print(json.dumps(cpu.summary(), indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
