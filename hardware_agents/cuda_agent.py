"""The CUDA hardware agent, and the compiler a CUDA worker uses.

The hardware agent announces one GPU (probed in a child process), heartbeats while it
serves and announces when it leaves, as the CPU one does. :class:`CudaCompiler` differs
from the CPU compiler in one way: building CUDA code (NVRTC, nvcc, Triton) happens on
the host's cores, not on the GPU, so compiles neither wait for nor block the device
gate that keeps timing alone on the GPU, and several run at once.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgspec

from agents.compiler import Compiler
from agents.verifier import Verifier
from hardware_agents.base import HardwareAgent
from hardware_agents.cuda import probe_in_subprocess, take_early_probe
from kf.devices import runner_pool
from kf.evaluation import CompileReport, compile_candidate
from kf.tasks import Task

__all__ = ["CudaCompiler", "CudaHardwareAgent", "CudaVerifier", "compile_concurrency"]


def compile_concurrency() -> int:
    """Compiles at once on a CUDA worker: ``$KF_CUDA_COMPILE_JOBS``, else all cores but one.

    A ``load_inline`` build is one nvcc process for the candidate's ``.cu`` (the shared
    ``main.cpp`` comes from kf's object cache after the first build) and NVRTC builds
    are single-threaded, so one build per core keeps the host's cores busy; one core is
    left for the grader, the agents and the runner on the GPU.
    """
    env = os.environ.get("KF_CUDA_COMPILE_JOBS")
    if env:
        return max(1, int(env))
    return max(2, len(os.sched_getaffinity(0)) - 1)


class CudaHardwareAgent(HardwareAgent):
    """One GPU, probed in a child process (the worker's own process keeps no CUDA context).

    It announces the GPU before measuring its copy bandwidth and matmul throughput, so
    builds for it start at once (they use the host's cores, not the GPU); the measured
    figures follow in a second announcement. ``kf run`` starts the first description
    while it checks its tasks (:func:`hardware_agents.cuda.probe_early`).
    """

    device_kind = "cuda"
    default_device = "cuda:0"
    announce_before_measuring = True

    def probe(self, measure: bool) -> dict[str, Any]:
        early = None if measure else take_early_probe(self.device)
        caps: dict[str, Any] = msgspec.to_builtins(
            early or probe_in_subprocess(self.device, measure=measure)
        )
        return caps


class CudaCompiler(Compiler):
    """Builds candidates for a GPU on the host's cores, many at once, beside the timing."""

    concurrency = compile_concurrency()

    async def build(self, task: Task, source: str) -> CompileReport:
        """Compile without the device gate: the GPU is not what a build uses."""
        return await asyncio.to_thread(
            compile_candidate,
            task,
            source,
            device=self.device,
            timeout_s=self.build_timeout_s,
            pool=runner_pool(self.device),
        )


class CudaVerifier(Verifier):
    """Two verifications at once on a GPU: each is mostly host work (runners, set-up,
    comparisons launched from Python), verification only shares the device, and the
    GPU otherwise waits on one candidate's host side at a time."""

    concurrency = 2
