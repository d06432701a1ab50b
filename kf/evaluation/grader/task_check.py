"""The task check: a task file loads, runs and gives outputs, in a reference runner."""

from __future__ import annotations

from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.sandbox import Limits, RunnerPool
from kf.evaluation.grader.session import GradingSession, Stage
from kf.evaluation.wire.protocol import MakeInputs
from kf.kernels.tasks import Task, TaskInfo


def run_task_check(
    task: Task,
    *,
    device: str = "cpu",
    timeout_s: float = 120.0,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
    conditions: Conditions | None = None,
) -> TaskInfo:
    """Run the task's reference once in a sandboxed process and describe its outputs,
    under the run's measuring ``conditions`` (None: the process's settings).

    Raises :class:`TaskError` naming the file and the cause (an exception with its
    type and message, a missing name, a crash or a timeout).
    """
    session = GradingSession(
        task,
        device=device,
        pool=pool,
        limits=limits or Limits(),
        timeout_s=timeout_s,
        conditions=conditions,
    )
    stage = Stage(session)
    with session.runners.lease() as ref:
        stage.use(ref=ref)
        stage.setup_reference()
        stage.load_task(seed=0)
        info = stage.reference(MakeInputs(seed=0))
    return TaskInfo(
        name=task.name,
        input_shapes=info.input_shapes,
        input_dtypes=info.input_dtypes,
        output_shapes=info.output_shapes,
        output_dtypes=info.output_dtypes,
        eager_ms=info.eager_ms,
        device=session.device,
    )
