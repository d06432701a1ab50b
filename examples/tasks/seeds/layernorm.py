"""Seed for layernorm: one C++/OpenMP kernel, rows split across threads.

``ALGO`` picks how each row's mean and variance are found: ``"two_pass"`` (mean, then the
sum of squared deviations, row held in cache), ``"one_pass"`` (sum and sum of squares
together; fewer reads, slightly less stable) or ``"welford"`` (running update, a division
per element, does not vectorise). ``REDUCE`` chooses a plain loop or an OpenMP simd
reduction for the sums.
"""

import ctypes

import torch
from torch import nn

import kf.native

# --- kf:params ---
SPACE = {
    "ALGO": ["two_pass", "one_pass", "welford"],
    "REDUCE": ["scalar", "simd"],
    "VEC_WIDTH": [256, 512],
    "THREADS": [1, 2],
    "ROWS_PER_CHUNK": [1, 16, 128],
}
CONFIG = {
    "ALGO": "two_pass",
    "REDUCE": "scalar",
    "VEC_WIDTH": 256,
    "THREADS": 2,
    "ROWS_PER_CHUNK": 16,
}
# --- kf:end ---

SOURCE = r"""
#include <cmath>

#define PRAGMA(text) _Pragma(#text)
#if REDUCE_SIMD
#define SIMD_SUM(var) PRAGMA(omp simd reduction(+ : var))
#define SIMD_SUM2(a, b) PRAGMA(omp simd reduction(+ : a, b))
#else
#define SIMD_SUM(var)
#define SIMD_SUM2(a, b)
#endif

extern "C" void layernorm(const float* __restrict x, const float* __restrict gamma,
                          const float* __restrict beta, float* __restrict out,
                          long rows, long cols, float eps) {
#pragma omp parallel for schedule(static, ROWS_PER_CHUNK) num_threads(THREADS)
    for (long i = 0; i < rows; ++i) {
        const float* xr = x + i * cols;
        float* orow = out + i * cols;
        const float n = (float)cols;
        float mean, var;
#if ALGO == 0  // two-pass
        float s = 0.0f;
        SIMD_SUM(s)
        for (long j = 0; j < cols; ++j) s += xr[j];
        mean = s / n;
        float sq = 0.0f;
        SIMD_SUM(sq)
        for (long j = 0; j < cols; ++j) {
            float d = xr[j] - mean;
            sq += d * d;
        }
        var = sq / n;
#elif ALGO == 1  // one-pass: E[x^2] - E[x]^2
        float s = 0.0f, sq = 0.0f;
        SIMD_SUM2(s, sq)
        for (long j = 0; j < cols; ++j) {
            s += xr[j];
            sq += xr[j] * xr[j];
        }
        mean = s / n;
        var = sq / n - mean * mean;
        var = var > 0.0f ? var : 0.0f;
#else  // Welford
        float m = 0.0f, m2 = 0.0f;
        for (long j = 0; j < cols; ++j) {
            float d = xr[j] - m;
            m += d / (float)(j + 1);
            m2 += d * (xr[j] - m);
        }
        mean = m;
        var = m2 / n;
#endif
        const float inv = 1.0f / std::sqrt(var + eps);
#pragma omp simd
        for (long j = 0; j < cols; ++j) orow[j] = (xr[j] - mean) * inv * gamma[j] + beta[j];
    }
}
"""

_ALGOS = {"two_pass": 0, "one_pass": 1, "welford": 2}


def _build(config: dict) -> ctypes.CDLL:
    lib = kf.native.build(
        SOURCE,
        defines={
            "ALGO": _ALGOS[config["ALGO"]],
            "REDUCE_SIMD": int(config["REDUCE"] == "simd"),
            "THREADS": config["THREADS"],
            "ROWS_PER_CHUNK": config["ROWS_PER_CHUNK"],
        },
        flags=(f"-mprefer-vector-width={config['VEC_WIDTH']}",),
    )
    lib.layernorm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_float]
    lib.layernorm.restype = None
    return lib


class ModelNew(nn.Module):
    """LayerNorm over the last dimension (elementwise affine) in one C++ kernel."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        with torch.no_grad():  # same parameter initialisation as the task's Model
            self.norm.weight.add_(0.1 * torch.randn(dim))
            self.norm.bias.add_(0.1 * torch.randn(dim))
        self._lib = _build(CONFIG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        gamma = self.norm.weight.detach().contiguous()
        beta = self.norm.bias.detach().contiguous()
        out = torch.empty_like(x)
        cols = x.shape[-1]
        self._lib.layernorm(
            x.data_ptr(),
            gamma.data_ptr(),
            beta.data_ptr(),
            out.data_ptr(),
            x.numel() // cols,
            cols,
            self.norm.eps,
        )
        return out
