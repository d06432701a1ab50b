"""Seed for gelu_bias: one fused pass computing GELU_tanh(x * scale + bias) + residual.

GELU_tanh(v) = 0.5 v (1 + tanh(u)) = v * sigmoid(2u) with u = sqrt(2/pi) (v + 0.044715 v^3),
so the kernel needs one exp per element. ``MATH="poly"`` uses a branch-free polynomial exp
that the compiler vectorises under ``#pragma omp simd``; ``MATH="libm"`` calls std::tanh
(scalar). Rows are split across OpenMP threads.
"""

import ctypes

import torch
from torch import nn

import kf.native

# --- kf:params ---
SPACE = {
    "MATH": ["libm", "poly"],
    "VEC_WIDTH": [256, 512],
    "THREADS": [1, 2],
    "SCHEDULE": ["static", "dynamic"],
    "ROWS_PER_CHUNK": [1, 8, 64],
    "COL_BLOCK": [512, 4096],
    "FLUSH_DENORMALS": [True, False],
}
CONFIG = {
    "MATH": "poly",
    "VEC_WIDTH": 256,
    "THREADS": 1,
    "SCHEDULE": "dynamic",
    "ROWS_PER_CHUNK": 1,
    "COL_BLOCK": 512,
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

// exp(x) for x in [-87, 88], relative error < 1e-7: Cody-Waite range reduction and a
// degree-6 polynomial (Cephes expf). Branch-free, so `#pragma omp simd` vectorises it
// (needs -fno-trapping-math so the clamps become min/max instructions).
static inline float poly_exp(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    int32_t ki = (int32_t)(x * 1.44269504088896341f + 128.5f) - 128;  // round(x / ln 2)
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

static inline float gelu_tanh(float v) {
    const float c = 0.7978845608028654f;
    float u = c * (v + 0.044715f * v * v * v);
#if MATH_POLY
    return v / (1.0f + poly_exp(-2.0f * u));
#else
    return 0.5f * v * (1.0f + std::tanh(u));
#endif
}

extern "C" void gelu_bias(const float* __restrict x, const float* __restrict res,
                          const float* __restrict scale, const float* __restrict bias,
                          float* __restrict out, long rows, long cols) {
#pragma omp parallel num_threads(THREADS)
    {
#if FLUSH_DENORMALS && defined(__SSE__)
        // Subnormal intermediates cost a microcode assist each; flush them in this
        // thread for the duration of the kernel and restore the caller's mode after.
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
            const float* rr = res + i * cols;
            float* orow = out + i * cols;
            for (long j0 = 0; j0 < cols; j0 += COL_BLOCK) {
                long j1 = j0 + COL_BLOCK < cols ? j0 + COL_BLOCK : cols;
#if MATH_POLY
#pragma omp simd
#endif
                for (long j = j0; j < j1; ++j) {
                    orow[j] = gelu_tanh(xr[j] * scale[j] + bias[j]) + rr[j];
                }
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
            "MATH_POLY": int(config["MATH"] == "poly"),
            "THREADS": config["THREADS"],
            "SCHED_DYNAMIC": int(config["SCHEDULE"] == "dynamic"),
            "ROWS_PER_CHUNK": config["ROWS_PER_CHUNK"],
            "COL_BLOCK": config["COL_BLOCK"],
            "FLUSH_DENORMALS": int(config["FLUSH_DENORMALS"]),
        },
        flags=("-fno-trapping-math", f"-mprefer-vector-width={config['VEC_WIDTH']}"),
    )
    lib.gelu_bias.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 2
    lib.gelu_bias.restype = None
    return lib


class ModelNew(nn.Module):
    """Fused GELU_tanh(x * scale + bias) + residual in one C++/OpenMP pass."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.bias = nn.Parameter(0.1 * torch.randn(hidden))
        self._lib = _build(CONFIG)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        residual = residual.expand_as(x).contiguous()
        scale = self.scale.detach().contiguous()
        bias = self.bias.detach().contiguous()
        out = torch.empty_like(x)
        cols = x.shape[-1]
        self._lib.gelu_bias(
            x.data_ptr(),
            residual.data_ptr(),
            scale.data_ptr(),
            bias.data_ptr(),
            out.data_ptr(),
            x.numel() // cols,
            cols,
        )
        return out
