"""Trial inputs made on the GPU (``KF_DEVICE_INPUTS``, on by default): at KernelBench's
sizes the task's ``get_inputs()`` on the host (a 6.4 GB ``torch.rand``) took longer than
the rest of a trial, and a task audit of 7 input sets ran 107 s on the H200.

On a CPU: the grader asks for it on a CUDA device only, and not when turned off. On a
GPU: the inputs are made on the device, identical in two runners (the candidate runner
that makes its own inputs must make the reference's), and a task whose ``get_inputs()``
cannot run so gets an error that says how to make them on the host."""

from __future__ import annotations

import time

import pytest
import torch

from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.grading import Deadline, setup_request
from kf.evaluation.grader.spawn import Limits
from kf.evaluation.runner.common import RequestFailure
from kf.evaluation.runner.loop import Runner
from kf.evaluation.wire.protocol import LoadTask, Setup
from kf.settings import Settings

TASK = """
import torch
from torch import nn

class Model(nn.Module):
    def forward(self, x, y):
        return x + y

def get_inputs():
    return [torch.rand(256, 1024), torch.randn(256, 1024)]

def get_init_inputs():
    return []
"""


class _Handle:
    threads, warm, sandbox = 1, None, "bwrap"


@pytest.mark.parametrize(
    ("device", "env", "asked"),
    [("cuda:0", None, True), ("cuda:0", "0", False), ("cpu", None, False)],
)
def test_the_grader_asks_for_device_inputs_on_a_gpu_only(
    device: str, env: str | None, asked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's conditions say where inputs are made (from ``$KF_DEVICE_INPUTS`` when the
    run starts); the set-up asks for it on a GPU only, whatever the environment says now."""
    settings = Settings.from_env({} if env is None else {"KF_DEVICE_INPUTS": env})
    conditions = Conditions.from_settings(settings)
    monkeypatch.setenv("KF_DEVICE_INPUTS", "1" if env == "0" else "0")  # the contrary: ignored
    setup = setup_request(
        _Handle(),  # type: ignore[arg-type]
        device,
        Limits(),
        Deadline(10),
        conditions,
        settings,
        reference=True,
    )
    assert setup.device_inputs is asked


def _runner(source: str, device_inputs: bool) -> Runner:
    runner = Runner(time.perf_counter_ns)
    runner.op_setup(Setup(device="cuda:0", threads=1, device_inputs=device_inputs))
    runner.op_load_task(LoadTask(source=source, name="task_add", seed=3))
    return runner


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inputs_are_made_on_the_gpu_and_the_same_in_two_runners() -> None:
    a, b = _runner(TASK, True), _runner(TASK, True)
    made_a, made_b = a._get_inputs(11), b._get_inputs(11)
    assert all(t.device.type == "cuda" for t in made_a)
    assert all(torch.equal(x, y) for x, y in zip(made_a, made_b, strict=True))
    assert not torch.equal(made_a[0], a._get_inputs(12)[0])
    host = _runner(TASK, False)._get_inputs(11)
    assert all(t.device.type == "cpu" for t in host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_task_that_needs_host_inputs_is_told_how() -> None:
    source = TASK.replace(
        "return [torch.rand(256, 1024), torch.randn(256, 1024)]",
        "x = torch.rand(8, 8); return [torch.from_numpy(x.numpy()), x]",
    )
    runner = _runner(source, True)
    with pytest.raises(RequestFailure) as err:
        runner._get_inputs(1)
    assert err.value.kind == "task_error" and "KF_DEVICE_INPUTS=0" in err.value.error
    assert len(_runner(source, False)._get_inputs(1)) == 2
