"""The float64 rule on a GPU (kf.evaluation.runner.float64): the reference's float64 run is
made on the device. KernelBench's level-1 task 4 at its first release's size with randn
inputs (tests/test_numerics.py), and the long matmul: a candidate that accumulates in
double is accepted (it fails plain allclose against cuBLAS' fp32 result on some trial),
one that computes in fp16 is rejected. The candidates call PyTorch (flag
``torch_compute``): what is judged here is the verdict, not the kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kf.evaluation import verify_candidate
from kf.kernels.tasks import Task, load_task

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FIXTURES = Path(__file__).parent / "fixtures" / "numerics"

CANDIDATE = """
import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A.to(torch.DTYPE), B.to(torch.DTYPE)).float()
"""


def _tasks() -> list[Task]:
    """The long matmul, and KernelBench's mat-vec where its task files are here."""
    from tests.test_numerics import MATVEC, matvec_v0

    matmul = load_task(FIXTURES / "task_matmul_long.py")
    return [matvec_v0(), matmul] if MATVEC.exists() else [matmul]


def test_gpu_double_accumulation_is_accepted_and_fp16_rejected() -> None:
    for task in _tasks():
        good = verify_candidate(
            task,
            CANDIDATE.replace("DTYPE", "float64"),
            device="cuda:0",
        )
        assert good.correct, good.error
        assert "float64" in good.rule
        bad = verify_candidate(
            task,
            CANDIDATE.replace("DTYPE", "float16"),
            device="cuda:0",
            generalise=False,
        )
        assert not bad.correct and bad.failure_kind == "mismatch", bad.error
        assert bad.error is not None and "against a float64 run" in bad.error
