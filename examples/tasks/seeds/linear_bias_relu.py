"""Seed for linear_bias_relu: y = relu(x @ W.T + b) as one blocked C++/OpenMP kernel.

The weight is packed transposed (K x N) once per call, so a tile of ``MR`` rows by ``NR``
output columns is accumulated in registers as rank-1 updates over k, starting from the
bias; ReLU is applied as the tile is stored (no second pass over the output).
``ALGO="dot"`` (one dot product per output element) is the naive alternative; it is left
out of SPACE because it is several times slower and would crowd the space.
``LOOP`` orders the tile loops within a thread's block of rows (which operand stays in L1).
"""

import ctypes

import torch
from torch import nn

import kf.native

# --- kf:params ---
SPACE = {
    "ALGO": ["tiled"],
    "MR": [2, 4, 6, 8],
    "NR": [32, 64],
    "LOOP": ["rows_outer", "cols_outer"],
    "THREADS": [1, 2],
    "VEC_WIDTH": [256, 512],
}
CONFIG = {
    "ALGO": "tiled",
    "MR": 2,
    "NR": 32,
    "LOOP": "rows_outer",
    "THREADS": 2,
    "VEC_WIDTH": 256,
}
# --- kf:end ---

SOURCE = r"""
#include <algorithm>
#include <cstdlib>
#include <vector>

// A full MR x NR tile: acc starts at the bias, rank-1 updates over k, ReLU on store.
static inline void full_tile(const float* __restrict x, const float* __restrict wt,
                             const float* __restrict bias, float* __restrict out,
                             long i0, long j0, long K, long N) {
    float acc[MR][NR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma omp simd
        for (int c = 0; c < NR; ++c) acc[r][c] = bias[j0 + c];
    }
    for (long k = 0; k < K; ++k) {
        const float* __restrict wk = wt + k * N + j0;
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const float a = x[(i0 + r) * K + k];
#pragma omp simd
            for (int c = 0; c < NR; ++c) acc[r][c] += a * wk[c];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        float* __restrict o = out + (i0 + r) * N + j0;
#pragma omp simd
        for (int c = 0; c < NR; ++c) o[c] = acc[r][c] > 0.0f ? acc[r][c] : 0.0f;
    }
}

// Edge tile (mr <= MR rows, nr <= NR columns), plain loops.
static void edge_tile(const float* __restrict x, const float* __restrict wt,
                      const float* __restrict bias, float* __restrict out,
                      long i0, long j0, long mr, long nr, long K, long N) {
    for (long r = 0; r < mr; ++r) {
        for (long c = 0; c < nr; ++c) {
            float s = bias[j0 + c];
            for (long k = 0; k < K; ++k) s += x[(i0 + r) * K + k] * wt[k * N + j0 + c];
            out[(i0 + r) * N + j0 + c] = s > 0.0f ? s : 0.0f;
        }
    }
}

static inline void do_tile(const float* x, const float* wt, const float* bias, float* out,
                           long i0, long j0, long M, long K, long N) {
    if (i0 + MR <= M && j0 + NR <= N) {
        full_tile(x, wt, bias, out, i0, j0, K, N);
    } else {
        edge_tile(x, wt, bias, out, i0, j0, std::min<long>(MR, M - i0),
                  std::min<long>(NR, N - j0), K, N);
    }
}

extern "C" void linear_bias_relu(const float* __restrict x, const float* __restrict w,
                                 const float* __restrict bias, float* __restrict out,
                                 long M, long K, long N) {
#if ALGO_DOT
#pragma omp parallel for schedule(static) num_threads(THREADS)
    for (long i = 0; i < M; ++i) {
        for (long j = 0; j < N; ++j) {
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (long k = 0; k < K; ++k) s += x[i * K + k] * w[j * K + k];
            s += bias[j];
            out[i * N + j] = s > 0.0f ? s : 0.0f;
        }
    }
#else
    std::vector<float> packed((size_t)K * (size_t)N);
    float* wt = packed.data();
    for (long j = 0; j < N; ++j)
        for (long k = 0; k < K; ++k) wt[k * N + j] = w[j * K + k];
    // Each thread takes blocks of about 64 rows (a multiple of MR).
    const long rb = ((64 + MR - 1) / MR) * MR;
    const long nblocks = (M + rb - 1) / rb;
#pragma omp parallel for schedule(static) num_threads(THREADS)
    for (long b = 0; b < nblocks; ++b) {
        const long i_begin = b * rb;
        const long i_end = std::min(M, i_begin + rb);
#if LOOP_COLS_OUTER
        for (long j0 = 0; j0 < N; j0 += NR)
            for (long i0 = i_begin; i0 < i_end; i0 += MR)
                do_tile(x, wt, bias, out, i0, j0, i_end, K, N);
#else
        for (long i0 = i_begin; i0 < i_end; i0 += MR)
            for (long j0 = 0; j0 < N; j0 += NR)
                do_tile(x, wt, bias, out, i0, j0, i_end, K, N);
#endif
    }
#endif
}
"""


def _build(config: dict) -> ctypes.CDLL:
    lib = kf.native.build(
        SOURCE,
        defines={
            "ALGO_DOT": int(config["ALGO"] == "dot"),
            "MR": config["MR"],
            "NR": config["NR"],
            "LOOP_COLS_OUTER": int(config["LOOP"] == "cols_outer"),
            "THREADS": config["THREADS"],
        },
        flags=("-fno-trapping-math", f"-mprefer-vector-width={config['VEC_WIDTH']}"),
    )
    lib.linear_bias_relu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    lib.linear_bias_relu.restype = None
    return lib


class ModelNew(nn.Module):
    """relu(Linear(in_features, out_features)(x)) in one blocked C++ kernel."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self._lib = _build(CONFIG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.linear.in_features
        n = self.linear.out_features
        x2 = x.reshape(-1, k).contiguous()
        w = self.linear.weight.detach().contiguous()
        b = self.linear.bias.detach().contiguous()
        out = torch.empty(x2.shape[0], n, dtype=x.dtype)
        self._lib.linear_bias_relu(
            x2.data_ptr(), w.data_ptr(), b.data_ptr(), out.data_ptr(), x2.shape[0], k, n
        )
        return out.reshape(*x.shape[:-1], n)
