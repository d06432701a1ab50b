"""The agents a worker hosts next to each device it serves, by device kind.

Every device gets its hardware agent (:mod:`hardware_agents`: it only describes the
device), a compiler, a verifier, a profiler and a tuner. A GPU gets the CUDA variants of
the first two and a counter collector besides: :class:`CudaCompiler` builds on the host's
cores, not on the GPU, so compiles neither wait for nor block the device gate that keeps
timing alone on the GPU (:mod:`kf.devices.gate`), and several run at once;
:class:`CudaVerifier` verifies two candidates at once.
"""

from __future__ import annotations

import os
from typing import Any

from agents.compiler import Compiler
from agents.counters import CounterCollector
from agents.profiler import Profiler
from agents.tuner import Tuner
from agents.verifier import Verifier
from hardware_agents.cpu_agent import CpuHardwareAgent
from hardware_agents.cuda_agent import CudaHardwareAgent
from kf.agent import Agent
from kf.evaluation import CompileReport
from kf.evaluation.grader.baseline_settings import Conditions
from kf.kernels.tasks import Task
from kf.settings import Settings, current

__all__ = [
    "CudaCompiler",
    "CudaProfiler",
    "CudaVerifier",
    "compile_concurrency",
    "device_agents",
    "profile_concurrency",
    "verify_concurrency",
]


def compile_concurrency(settings: Settings | None = None) -> int:
    """Compiles at once on a CUDA worker: ``$KF_CUDA_COMPILE_JOBS``, else all cores but one.

    A ``load_inline`` build is one nvcc process for the candidate's ``.cu`` (the shared
    ``main.cpp`` comes from kf's object cache after the first build) and NVRTC builds
    are single-threaded, so one build per core keeps the host's cores busy; one core is
    left for the grader, the agents and the runner on the GPU.
    """
    jobs = (settings or current()).cuda_compile_jobs
    if jobs is not None:
        return jobs
    return max(2, len(os.sched_getaffinity(0)) - 1)


class CudaCompiler(Compiler):
    """Builds candidates for a GPU on the host's cores, many at once, beside the timing."""

    concurrency = compile_concurrency()

    async def build(
        self, task: Task, source: str, conditions: Conditions, key: str | None = None
    ) -> CompileReport:
        """Compile without the device gate: the GPU is not what a build uses."""
        return await self.build_now(task, source, conditions, key)


def verify_concurrency(settings: Settings | None = None) -> int:
    """Verifications at once on a GPU: ``$KF_CUDA_VERIFY_JOBS``, default 4."""
    jobs = (settings or current()).cuda_verify_jobs
    return 4 if jobs is None else jobs


def profile_concurrency(settings: Settings | None = None) -> int:
    """Profiles at once on a GPU (one per task): ``$KF_CUDA_PROFILE_JOBS``, default 12.

    A profile's stage took 8.4 s on the H200 (its turn 0.7 s of it; the rest loading,
    checking, waiting for its turn and for its task's baselined reference runner), so
    four at once (the verifications' number, until 2026-12-04) timed at most 28 a
    minute, with the device's turn idle a third of the time.
    """
    jobs = (settings or current()).cuda_profile_jobs
    return 12 if jobs is None else jobs


class CudaVerifier(Verifier):
    """Several verifications at once on a GPU (``$KF_CUDA_VERIFY_JOBS``, 4): each is
    mostly host work (runners, set-up, comparisons launched from Python), verification
    only shares the device, and the GPU otherwise waits on one candidate's host side at
    a time. Timing stays exclusive (the device gate); big tasks verify one at a time
    (:mod:`kf.evaluation.grader.admission`)."""

    concurrency = verify_concurrency()


class CudaProfiler(Profiler):
    """Several profiles at once on a GPU (``$KF_CUDA_PROFILE_JOBS``, 12), one per task:
    each loads, checks and compiles its baseline sharing the device and times with the
    device to itself (:meth:`EvaluatorAgent.timing_gate`), so the timings follow each
    other instead of each waiting behind the next one's set-up."""

    concurrency = profile_concurrency()


def device_agents(device: str) -> list[type[Agent[Any]]]:
    """The agent types a worker hosts next to ``device`` (``cpu`` or ``cuda:N``)."""
    if device.startswith("cuda"):
        cuda: list[type[Agent[Any]]] = [CudaHardwareAgent, CudaCompiler, CudaVerifier]
        return [*cuda, CudaProfiler, CounterCollector, Tuner]
    return [CpuHardwareAgent, Compiler, Verifier, Profiler, Tuner]
