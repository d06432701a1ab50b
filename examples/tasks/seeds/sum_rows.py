"""Seed for sum_rows: y[i] = sum_j x[i, j], rows split across OpenMP threads.

Each float partial sum takes ``FOLD_EVERY`` values and is then folded into a double total
(float sums over a whole 8192-long row drift past the 1e-4 tolerance). A plain loop is a serial dependency chain that GCC will not reorder (no
-ffast-math), so ``ACCUMULATORS`` independent partial sums, each a vector of ``LANES``
values, break the chain; ``LANES=1`` with ``ACCUMULATORS=1`` is the naive loop.
"""

import ctypes

import torch
from torch import nn

import kf.native

# --- kf:params ---
SPACE = {
    "LANES": [1, 8, 16],
    "ACCUMULATORS": [1, 2, 4],
    "VEC_WIDTH": [256, 512],
    "THREADS": [1, 2],
    "ROWS_PER_CHUNK": [1, 16, 128],
    "FOLD_EVERY": [16, 128],
}
CONFIG = {
    "LANES": 8,
    "ACCUMULATORS": 1,
    "VEC_WIDTH": 256,
    "THREADS": 1,
    "ROWS_PER_CHUNK": 16,
    "FOLD_EVERY": 16,
}
# --- kf:end ---

SOURCE = r"""
extern "C" void sum_rows(const float* __restrict x, float* __restrict out, long rows, long cols) {
    constexpr long W = (long)LANES * ACCUMULATORS;  // floats consumed per step
#pragma omp parallel for schedule(static, ROWS_PER_CHUNK) num_threads(THREADS)
    for (long i = 0; i < rows; ++i) {
        const float* xr = x + i * cols;
        double total[W];
        for (long l = 0; l < W; ++l) total[l] = 0.0;
        long j = 0;
        while (j + W <= cols) {
            float acc[W];
            for (long l = 0; l < W; ++l) acc[l] = 0.0f;
            for (long step = 0; step < FOLD_EVERY && j + W <= cols; ++step, j += W) {
#pragma omp simd
                for (long l = 0; l < W; ++l) acc[l] += xr[j + l];
            }
            for (long l = 0; l < W; ++l) total[l] += acc[l];
        }
        double s = 0.0;
        for (long l = 0; l < W; ++l) s += total[l];
        for (; j < cols; ++j) s += xr[j];  // tail
        out[i] = (float)s;
    }
}
"""


def _build(config: dict) -> ctypes.CDLL:
    lib = kf.native.build(
        SOURCE,
        defines={
            "LANES": config["LANES"],
            "ACCUMULATORS": config["ACCUMULATORS"],
            "THREADS": config["THREADS"],
            "ROWS_PER_CHUNK": config["ROWS_PER_CHUNK"],
            "FOLD_EVERY": config["FOLD_EVERY"],
        },
        flags=(f"-mprefer-vector-width={config['VEC_WIDTH']}",),
    )
    lib.sum_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
    lib.sum_rows.restype = None
    return lib


class ModelNew(nn.Module):
    """x.sum(dim=1) for a 2-D x in one C++/OpenMP kernel."""

    def __init__(self) -> None:
        super().__init__()
        self._lib = _build(CONFIG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows, cols = x.shape[0], x.shape[1]
        inner = x.numel() // (rows * cols) if rows * cols else 1
        if inner != 1:  # sum over dim 1 of an N-d tensor: move dim 1 last
            x = x.movedim(1, -1).contiguous()
            out = torch.empty(x.shape[:-1], dtype=x.dtype)
            self._lib.sum_rows(x.data_ptr(), out.data_ptr(), out.numel(), cols)
            return out
        out = torch.empty(rows, dtype=x.dtype)
        self._lib.sum_rows(x.data_ptr(), out.data_ptr(), rows, cols)
        return out
