"""Seed for softmax: row softmax in C++/OpenMP, rows split across threads.

``ALGO``: ``"store_exp"`` (pass 1 row max; pass 2 writes exp(x - max) to the output and
sums it; pass 3 scales the output), ``"recompute"`` (pass 2 only sums, pass 3 recomputes
the exp) or ``"online"`` (one pass keeps a running max and rescaled sum per vector lane,
then one output pass; two exps per element but one fewer read). exp is a branch-free
polynomial that vectorises under ``#pragma omp simd``.
"""

import ctypes

import torch
from torch import nn

import kf.native

# --- kf:params ---
SPACE = {
    "ALGO": ["store_exp", "recompute", "online"],
    "VEC_WIDTH": [256, 512],
    "THREADS": [1, 2],
    "ROWS_PER_CHUNK": [1, 8, 64],
    "FLUSH_DENORMALS": [True, False],
}
CONFIG = {
    "ALGO": "recompute",
    "VEC_WIDTH": 256,
    "THREADS": 2,
    "ROWS_PER_CHUNK": 1,
    "FLUSH_DENORMALS": False,
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

static inline float row_max(const float* __restrict xr, long n) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (long j = 0; j < n; ++j) m = xr[j] > m ? xr[j] : m;
    return m;
}

static void softmax_row(const float* __restrict xr, float* __restrict orow, long n) {
#if ALGO == 2  // online: per-lane running max and sum
    constexpr int L = 16;
    float lm[L], ls[L];
    for (int l = 0; l < L; ++l) { lm[l] = -INFINITY; ls[l] = 0.0f; }
    long j = 0;
    for (; j + L <= n; j += L) {
#pragma omp simd
        for (int l = 0; l < L; ++l) {
            float v = xr[j + l];
            float nm = std::max(lm[l], v);
            ls[l] = ls[l] * poly_exp(lm[l] - nm) + poly_exp(v - nm);
            lm[l] = nm;
        }
    }
    float m = -INFINITY;
    for (int l = 0; l < L; ++l) m = std::max(m, lm[l]);
    for (long t = j; t < n; ++t) m = std::max(m, xr[t]);
    float s = 0.0f;
    for (int l = 0; l < L; ++l) s += ls[l] * poly_exp(lm[l] - m);
    for (long t = j; t < n; ++t) s += poly_exp(xr[t] - m);
    const float inv = 1.0f / s;
#pragma omp simd
    for (long t = 0; t < n; ++t) orow[t] = poly_exp(xr[t] - m) * inv;
#else
    const float m = row_max(xr, n);
    float s = 0.0f;
#if ALGO == 0  // store exp, then scale
#pragma omp simd reduction(+ : s)
    for (long j = 0; j < n; ++j) {
        float e = poly_exp(xr[j] - m);
        orow[j] = e;
        s += e;
    }
    const float inv = 1.0f / s;
#pragma omp simd
    for (long j = 0; j < n; ++j) orow[j] *= inv;
#else  // recompute exp in the output pass
#pragma omp simd reduction(+ : s)
    for (long j = 0; j < n; ++j) s += poly_exp(xr[j] - m);
    const float inv = 1.0f / s;
#pragma omp simd
    for (long j = 0; j < n; ++j) orow[j] = poly_exp(xr[j] - m) * inv;
#endif
#endif
}

extern "C" void softmax(const float* __restrict x, float* __restrict out, long rows, long cols) {
#pragma omp parallel num_threads(THREADS)
    {
#if FLUSH_DENORMALS && defined(__SSE__)
        const unsigned int saved_csr = _mm_getcsr();
        _mm_setcsr(saved_csr | 0x8040);
#endif
#pragma omp for schedule(static, ROWS_PER_CHUNK)
        for (long i = 0; i < rows; ++i) softmax_row(x + i * cols, out + i * cols, cols);
#if FLUSH_DENORMALS && defined(__SSE__)
        _mm_setcsr(saved_csr);
#endif
    }
}
"""

_ALGOS = {"store_exp": 0, "recompute": 1, "online": 2}


def _build(config: dict) -> ctypes.CDLL:
    lib = kf.native.build(
        SOURCE,
        defines={
            "ALGO": _ALGOS[config["ALGO"]],
            "THREADS": config["THREADS"],
            "ROWS_PER_CHUNK": config["ROWS_PER_CHUNK"],
            "FLUSH_DENORMALS": int(config["FLUSH_DENORMALS"]),
        },
        flags=("-fno-trapping-math", f"-mprefer-vector-width={config['VEC_WIDTH']}"),
    )
    lib.softmax.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
    lib.softmax.restype = None
    return lib


class ModelNew(nn.Module):
    """softmax(x, dim=-1) in one C++/OpenMP kernel."""

    def __init__(self) -> None:
        super().__init__()
        self._lib = _build(CONFIG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        cols = x.shape[-1]
        self._lib.softmax(x.data_ptr(), out.data_ptr(), x.numel() // cols, cols)
        return out
