"""Per-GPU runner pools: each GPU of a multi-GPU worker keeps its own warm runners, sized
to what fits beside the tasks' tensors in its free memory; with one device the stages use
the process's default pool (:func:`kf.evaluation.grader.sandbox.default_pool`).
"""

from __future__ import annotations

import atexit
import math
import threading
from collections.abc import Sequence

import structlog

from kf.devices.smi import free_device_memory
from kf.evaluation.grader.sandbox import RunnerPool
from kf.settings import current

__all__ = [
    "configure_runner_pools",
    "gpu_pool_size",
    "kept_runners",
    "runner_pool",
    "runners_that_fit",
]

_pools: dict[str, RunnerPool] = {}
_pools_lock = threading.Lock()


def runners_that_fit(requested: int, free_bytes: int | None, context_bytes: int) -> int:
    """How many of ``requested`` warm runners a GPU with ``free_bytes`` free gets: their
    CUDA contexts (``context_bytes`` each) take at most a quarter of its free memory,
    the rest being the tasks' tensors; at least 2 (a reference and a candidate)."""
    if free_bytes is None or context_bytes <= 0:
        return requested
    return max(2, min(requested, free_bytes // 4 // context_bytes))


def gpu_pool_size(device: str, requested: int) -> int:
    """``requested`` warm runners for GPU ``device``, fewer where they would not fit in
    its free memory (:func:`runners_that_fit`), said in the log when they do not."""
    free = free_device_memory(device)
    size = runners_that_fit(requested, free, current().runner_context_bytes)
    if size < requested and free is not None:
        structlog.get_logger("kf.devices").info(
            "runner_pool_sized", device=device, runners=size, asked=requested,
            free_gb=round(free / 1e9, 1),
        )  # fmt: skip
    return size


def configure_runner_pools(devices: Sequence[str], build_slots: int) -> None:
    """Give each GPU of a multi-GPU worker its own pool of runners warmed for it.

    The pools together keep ``build_slots`` runners for builds (spread over the GPUs)
    plus four per GPU for its verifications and timings; ``$KF_EVAL_POOL`` sets the
    size of each instead. With one device nothing changes: stages use the process's
    default pool.
    """
    gpus = list(dict.fromkeys(d for d in devices if d.startswith("cuda")))
    if len(gpus) < 2:
        return
    asked = current().eval_pool
    sizes = {
        d: asked if asked is not None else gpu_pool_size(d, math.ceil(build_slots / len(gpus)) + 4)
        for d in gpus
    }
    references = current().reference_runners
    with _pools_lock:
        for d in gpus:
            size = sizes[d]
            # a reference runner per task keeps its compiled baseline
            refs = references or min(16, max(4, size))
            old = _pools.get(d)
            if old is not None and not old._closed:
                old.configure(size=size, warm=d, references=refs, kept=kept_runners(size))
                continue
            pool = _pools[d] = RunnerPool(
                size=size, warm=d, references=refs, kept=kept_runners(size)
            )
            atexit.register(pool.close)


def kept_runners(pool_size: int) -> int:
    """The candidate runners a GPU's pool keeps between a candidate's stages:
    ``$KF_KEPT_RUNNERS`` where set, else as many as its idle runners (at least 8): a
    kept runner is one of the runners that fit beside the tasks' tensors, and with
    fewer than the candidates in flight a candidate whose runner was not kept pays a
    runner's start again (on the H200, a cap of 8 at 24 in flight left 23 of 69
    verifications a fresh runner)."""
    settings = current()
    return settings.kept_runners if settings.kept_runners_set else max(8, pool_size)


def runner_pool(device: str) -> RunnerPool | None:
    """The runner pool of ``device`` (None: the process's default pool serves it)."""
    with _pools_lock:
        pool = _pools.get(device)
    return pool if pool is not None and not pool._closed else None
