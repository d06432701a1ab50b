"""Seed for rmsnorm_silu: per row, one reduction pass (sum of squares) and one output pass
computing SiLU(x * inv_rms * weight), with the row still in cache.

SiLU(y) = y / (1 + exp(-y)) uses a branch-free polynomial exp that vectorises under
``#pragma omp simd``. ``REDUCE="scalar"`` leaves the sum of squares as a plain loop (which
GCC will not vectorise without -ffast-math); ``"simd"`` uses an OpenMP simd reduction.
"""

import ctypes

import torch
from torch import nn

import kf.native

# --- kf:params ---
SPACE = {
    "REDUCE": ["scalar", "simd"],
    "VEC_WIDTH": [256, 512],
    "THREADS": [1, 2],
    "SCHEDULE": ["static", "dynamic"],
    "ROWS_PER_CHUNK": [1, 16, 64],
    "FLUSH_DENORMALS": [True, False],
}
CONFIG = {
    "REDUCE": "scalar",
    "VEC_WIDTH": 256,
    "THREADS": 2,
    "SCHEDULE": "dynamic",
    "ROWS_PER_CHUNK": 1,
    "FLUSH_DENORMALS": True,
}
# --- kf:end ---

SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

// exp(x) for x in [-87, 88], relative error < 1e-7 (Cephes expf); branch-free so that
// `#pragma omp simd` vectorises it (with -fno-trapping-math).
static inline float poly_exp(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    int32_t ki = (int32_t)(x * 1.44269504088896341f + 128.5f) - 128;
    float k = (float)ki;
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * __builtin_bit_cast(float, (ki + 127) << 23);
}

extern "C" void rmsnorm_silu(const float* __restrict x, const float* __restrict w,
                             float* __restrict out, long rows, long cols, float eps) {
#pragma omp parallel num_threads(THREADS)
    {
#if FLUSH_DENORMALS && defined(__SSE__)
        const unsigned int saved_csr = _mm_getcsr();
        _mm_setcsr(saved_csr | 0x8040);
#endif
#if SCHED_DYNAMIC
#pragma omp for schedule(dynamic, ROWS_PER_CHUNK)
#else
#pragma omp for schedule(static, ROWS_PER_CHUNK)
#endif
        for (long i = 0; i < rows; ++i) {
            const float* xr = x + i * cols;
            float* orow = out + i * cols;
            float ss = 0.0f;
#if REDUCE_SIMD
#pragma omp simd reduction(+ : ss)
#endif
            for (long j = 0; j < cols; ++j) ss += xr[j] * xr[j];
            const float inv = 1.0f / std::sqrt(ss / (float)cols + eps);
#pragma omp simd
            for (long j = 0; j < cols; ++j) {
                float y = xr[j] * inv * w[j];
                orow[j] = y / (1.0f + poly_exp(-y));
            }
        }
#if FLUSH_DENORMALS && defined(__SSE__)
        _mm_setcsr(saved_csr);
#endif
    }
}
"""


def _build(config: dict) -> ctypes.CDLL:
    lib = kf.native.build(
        SOURCE,
        defines={
            "REDUCE_SIMD": int(config["REDUCE"] == "simd"),
            "THREADS": config["THREADS"],
            "SCHED_DYNAMIC": int(config["SCHEDULE"] == "dynamic"),
            "ROWS_PER_CHUNK": config["ROWS_PER_CHUNK"],
            "FLUSH_DENORMALS": int(config["FLUSH_DENORMALS"]),
        },
        flags=("-fno-trapping-math", f"-mprefer-vector-width={config['VEC_WIDTH']}"),
    )
    lib.rmsnorm_silu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float]
    lib.rmsnorm_silu.restype = None
    return lib


class ModelNew(nn.Module):
    """Fused RMSNorm (learned gain) + SiLU over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self._lib = _build(CONFIG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        weight = self.weight.detach().contiguous()
        out = torch.empty_like(x)
        cols = x.shape[-1]
        self._lib.rmsnorm_silu(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // cols, cols, self.eps
        )
        return out
