"""bench/host_cpu.py: a host's CPU-seconds by kind of process, read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from host_cpu import HostCpu, kind_of

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc")


def test_kinds_by_command_line() -> None:
    """The processes of a GPU run are told apart by their command lines."""
    assert kind_of("/usr/local/cuda/bin/nvcc\0-c\0cuda.cu") == "nvcc"
    assert kind_of("/usr/local/cuda/nvvm/bin/cicc\0--arch") == "nvcc"
    assert kind_of("/usr/lib/gcc/x86_64-linux-gnu/13/cc1plus\0-quiet\0main.cpp") == "c++ compiler"
    assert kind_of("c++\0-MMD\0main.cpp") == "c++ compiler"
    assert kind_of("/usr/bin/python3\0-P\0-m\0kf.evaluation.runner\0014\0000") == "boxed runners"
    assert kind_of("python\0-m\0torch._inductor.compile_worker\0--pickler") == (
        "inductor compile workers"
    )
    assert kind_of("/usr/bin/python3\0-m\0kf.app.cli\0run\0tasks") == "kf grader and agents"
    assert kind_of("nats-server\0-p\0004222") == "nats-server"
    assert kind_of("/work/.venv/bin/python\0/work/.venv/bin/kf\0run\0t.py") == (
        "kf grader and agents"
    )
    assert kind_of("/usr/bin/sleep\0001") == "other"


def test_a_busy_child_is_counted_under_its_kind() -> None:
    """A process that spins for a CPU-second shows most of it under its kind, and the
    host's busy time is at least what the processes were seen to use."""
    # a CPU-second of its own, however loaded the machine is
    spin = "import time\nwhile time.process_time() < 1.0: pass\n"
    with HostCpu(interval_s=0.1) as cpu, HostCpu(interval_s=0.1, root=os.getpid()) as mine:
        subprocess.run([sys.executable, "-c", spin, "kf.evaluation.runner"], check=True)
    # counted from this test's process down: the child is below it
    assert mine.summary()["by_kind"].get("boxed runners", 0.0) >= 0.6, mine.summary()
    summary = cpu.summary()
    assert summary["by_kind"].get("boxed runners", 0.0) >= 0.6, summary
    assert summary["host_busy_s"] + 0.2 >= sum(summary["by_kind"].values()), summary
    assert summary["span_s"] >= 0.9
    assert summary["processes_by_kind"]["boxed runners"] >= 1
