"""The task check: a task file loads, runs and gives outputs, in a reference runner."""

from __future__ import annotations

from kf.evaluation.device import parse_device
from kf.evaluation.grading import _Deadline, _reference, _setup_fields
from kf.evaluation.sandbox import Limits, RunnerPool, default_pool
from kf.tasks import Task, TaskInfo


def run_task_check(
    task: Task,
    *,
    device: str = "cpu",
    timeout_s: float = 120.0,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
) -> TaskInfo:
    """See :func:`kf.tasks.check_task`."""
    device = parse_device(device)
    limits = limits or Limits()
    pool = pool or default_pool()
    deadline = _Deadline(timeout_s)
    with pool.lease() as ref:
        _reference(
            task,
            ref,
            "setup",
            deadline,
            **_setup_fields(ref, device, limits, deadline, reference=True),
        )
        _reference(task, ref, "load_task", deadline, source=task.source, name=task.name, seed=0)
        info = _reference(task, ref, "make_inputs", deadline, seed=0)
    return TaskInfo(
        name=task.name,
        input_shapes=info["input_shapes"],
        input_dtypes=info["input_dtypes"],
        output_shapes=info["output_shapes"],
        output_dtypes=info["output_dtypes"],
        eager_ms=float(info["eager_ms"]),
        device=device,
    )
