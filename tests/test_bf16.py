"""bf16 as a first-class dtype on the CPU: a real C++/OpenMP kernel on bf16 tensors that
accumulates in float32 passes, one that accumulates in bf16 and one that returns float32
are rejected; ``kf extract`` keeps a bf16 model's dtypes, and the LLM prompt states them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kf.evaluation import RunnerPool, verify_candidate
from kf.kernels.tasks import Task
from kf.llm.prompts import dtype_line, init_messages
from tests.harness import ROOT

KF_EXTRACT = (
    sys.executable,
    "-m",
    "kf.app.cli",
    "extract",
    "examples/models/decoder_block.py:build",
)
ROWSUM = Task.from_source(
    "bf16_rowsum",
    """import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x):
        return x.sum(dim=-1)


def get_inputs():
    return [torch.randn(64, 4096, dtype=torch.bfloat16)]


def get_init_inputs():
    return []
""",
)

KERNEL = r'''
import ctypes

import torch
from torch import nn

import kf.native

SOURCE = r"""
#include <cstdint>
#include <cstring>
static inline float bf2f(uint16_t b) {
    uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
static inline uint16_t f2bf(float f) {  // round to nearest even
    uint32_t u; std::memcpy(&u, &f, 4); u += 0x7FFFu + ((u >> 16) & 1u); return uint16_t(u >> 16);
}
extern "C" void rowsum(const uint16_t* x, uint16_t* y, int64_t rows, int64_t cols) {
    #pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r) {
        float acc = 0.0f;
        uint16_t acc16 = 0;
        for (int64_t c = 0; c < cols; ++c) {
            if (BF16_ACCUMULATE) acc16 = f2bf(bf2f(acc16) + bf2f(x[r * cols + c]));
            else acc += bf2f(x[r * cols + c]);
        }
        y[r] = BF16_ACCUMULATE ? acc16 : f2bf(acc);
    }
}
"""


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lib = kf.native.build(SOURCE, defines={"BF16_ACCUMULATE": @ACC@})
        self.lib.rowsum.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape[0], dtype=torch.bfloat16)
        self.lib.rowsum(x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1])
        return y@CAST@
'''


def _kernel(bf16_accumulate: bool = False, cast: str = "") -> str:
    return KERNEL.replace("@ACC@", str(int(bf16_accumulate))).replace("@CAST@", cast)


def test_bf16_kernel_accumulating_in_float_passes(pool: RunnerPool) -> None:
    """A C++ bf16 row sum that accumulates in float32 and rounds once passes."""
    report = verify_candidate(ROWSUM, _kernel(), pool=pool, generalise=False)
    assert report.correct, report.error


def test_bf16_kernel_accumulating_in_bf16_is_rejected(pool: RunnerPool) -> None:
    """The same kernel accumulating in bf16 (rounding at each add) fails by its values."""
    report = verify_candidate(ROWSUM, _kernel(bf16_accumulate=True), pool=pool, generalise=False)
    assert not report.correct and report.failure_kind == "mismatch", report.error


def test_bf16_kernel_returning_float32_is_rejected(pool: RunnerPool) -> None:
    """A right sum returned as float32 where the reference returns bf16 is a dtype mismatch."""
    report = verify_candidate(ROWSUM, _kernel(cast=".float()"), pool=pool, generalise=False)
    assert not report.correct and report.failure_kind == "dtype_mismatch", report.error
    assert report.error is not None and "bfloat16" in report.error


def test_bf16_extract_keeps_dtypes_and_the_prompt_states_them(tmp_path: Path) -> None:
    """The block extracted in bf16 gives bf16 signatures and tasks, and a first-kernel
    prompt for one of them says bf16 outputs stay bf16."""
    from kf.app.manifest import read_manifest

    out = tmp_path / "tasks"
    env = dict(os.environ, DECODER_BLOCK_DTYPE="bfloat16", KF_LOG_LEVEL="WARNING")
    proc = subprocess.run(
        [*KF_EXTRACT, "-o", str(out), "--min-share", "0", "--top", "10"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = read_manifest(out / "manifest.json")
    assert m.tasks and {s.dtype for t in m.tasks for s in t.signatures[0].inputs} == {"bfloat16"}
    text = (out / m.tasks[0].file).read_text()
    assert "torch.bfloat16" in text
    prompt = init_messages(m.tasks[0].name, text, "cpp", {}, {})
    assert "bfloat16 output stays bfloat16" in str(prompt)
    assert "float32 unless" in dtype_line(ROWSUM.source.replace("bfloat16", "float32"))


@pytest.mark.parametrize("name", ["float16"])
def test_fp16_prompt_states_half(name: str) -> None:
    """A reference naming torch.float16 gets the half-type line in its prompt."""
    assert f"{name} output stays {name}" in dtype_line(ROWSUM.source.replace("bfloat16", name))
