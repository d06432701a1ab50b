"""Behavioural descriptors: small C++, CUDA and Triton snippets land in the expected levels."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kf.kernels.behaviour import (
    COMPUTE_LEVELS,
    MEMORY_LEVELS,
    PARALLEL_LEVELS,
    Behaviour,
    describe,
)


def _cpp(body: str) -> str:
    """A candidate module embedding ``body`` as C++ for kf.native."""
    return f'from kf.native import build\n\nSRC = r"""\n{body}\n"""\n'


def _cuda(body: str) -> str:
    """A candidate module embedding ``body`` as CUDA for load_inline."""
    return (
        "from torch.utils.cpp_extension import load_inline\n\n"
        f'cuda_src = """\n{body}\n"""\n'
        'mod = load_inline(name="k", cpp_sources="", cuda_sources=cuda_src)\n'
    )


CPU_SERIAL = _cpp(
    """
extern "C" void relu(const float* x, float* y, long n) {
    for (long i = 0; i < n; ++i) y[i] = x[i] > 0 ? x[i] : 0;
}"""
)
CPU_OMP = _cpp(
    """
extern "C" void relu(const float* x, float* y, long n) {
    #pragma omp parallel for
    for (long i = 0; i < n; ++i) y[i] = x[i] > 0 ? x[i] : 0;
}"""
)
CPU_TWO_PASS = _cpp(
    """
extern "C" void softmax(const float* x, float* y, float* m, long rows, long cols) {
    #pragma omp parallel for
    for (long r = 0; r < rows; ++r) for (long c = 0; c < cols; ++c) m[r] = fmaxf(m[r], x[c]);
    #pragma omp parallel for
    for (long r = 0; r < rows; ++r) for (long c = 0; c < cols; ++c) y[c] = expf(x[c] - m[r]);
}"""
)
CPU_TWO_FUNCTIONS = _cpp(
    """
extern "C" {
void scale(float* y, long n) { for (long i = 0; i < n; ++i) y[i] *= 2; }
void shift(float* y, long n) { for (long i = 0; i < n; ++i) y[i] += 1; }
}"""
)
CPU_AVX = _cpp(
    """
#include <immintrin.h>
extern "C" void add(const float* a, const float* b, float* c, long n) {
    for (long i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(c + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
}"""
)
CPU_TILED_HIERARCHY = _cpp(
    """
#define TILE 64
extern "C" void mm(const float* A, const float* B, float* C, int n) {
    #pragma omp parallel for
    for (int ii = 0; ii < n; ii += TILE)
      for (int kk = 0; kk < n; kk += TILE)
        for (int i = ii; i < ii + TILE; ++i)
          for (int k = kk; k < kk + TILE; ++k) {
            #pragma omp simd
            for (int j = 0; j < n; ++j) C[i*n+j] += A[i*n+k] * B[k*n+j];
          }
}"""
)
CPU_REGISTER_BLOCKED = _cpp(
    """
extern "C" void mm(const float* A, const float* B, float* C, int n) {
    for (int i = 0; i < n; i += 4)
      for (int j = 0; j < n; j += 4) {
        float acc[4][4] = {};
        for (int k = 0; k < n; ++k)
          for (int a = 0; a < 4; ++a) for (int b = 0; b < 4; ++b) acc[a][b] += A[0] * B[0];
      }
}"""
)
CPU_WELFORD = _cpp(
    """
extern "C" void var(const float* x, float* out, long n) {
    float mean = 0, m2 = 0;
    for (long i = 0; i < n; ++i) {
        float delta = x[i] - mean; mean += delta / (i + 1); m2 += delta * (x[i] - mean);
    }
    out[0] = m2 / n;
}"""
)
CPU_AMX = _cpp(
    """
#include <immintrin.h>
extern "C" void mm(const void* a, const void* b, float* c) {
    _tile_loadd(0, a, 64); _tile_loadd(1, b, 64); _tile_dpbf16ps(2, 0, 1);
}"""
)
CPU_NESTED = _cpp(
    """
extern "C" void f(float* x, long n) {
    omp_set_max_active_levels(2);
    #pragma omp parallel for
    for (long i = 0; i < n; ++i) x[i] *= 2;
}"""
)

CUDA_NAIVE = _cuda(
    """
__global__ void relu(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaxf(x[i], 0.f);
}"""
)
CUDA_FLOAT4 = _cuda(
    """
__global__ void copy4(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n / 4) reinterpret_cast<float4*>(y)[i] = reinterpret_cast<const float4*>(x)[i];
}"""
)
CUDA_TWO_KERNELS = _cuda(
    """
__global__ void scale(float* y, int n) { y[threadIdx.x] *= 2; }
__global__ void shift(float* y, int n) { y[threadIdx.x] += 1; }"""
)
CUDA_SHARED_TILE = _cuda(
    """
#define TILE 16
__global__ void mm(const float* A, const float* B, float* C, int n) {
    __shared__ float As[TILE][TILE];
    for (int t = 0; t < n; t += TILE) { As[threadIdx.y][threadIdx.x] = A[t]; __syncthreads(); }
}"""
)
CUDA_WARP = _cuda(
    """
__global__ void rowsum(const float* x, float* y, int n) {
    float v = x[blockIdx.x * 32 + threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    if (threadIdx.x == 0) y[blockIdx.x] = v;
}"""
)
CUDA_ONLINE_BLOCK_WARP = _cuda(
    """
__global__ void softmax(const float* x, float* y, int n) {
    __shared__ float red[32];
    float m_old = -INFINITY, m_new = m_old, l = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        m_new = fmaxf(m_old, x[i]); l = l * expf(m_old - m_new) + expf(x[i] - m_new); m_old = m_new;
    }
    m_new = __shfl_xor_sync(0xffffffff, m_new, 16);
    red[threadIdx.x % 32] = m_new;
    __syncthreads();
}"""
)
CUDA_ASYNC_WMMA = _cuda(
    """
#include <mma.h>
using namespace nvcuda;
__global__ void gemm(const half* A, const half* B, float* C) {
    __shared__ half As[64 * 64];
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    __pipeline_memcpy_async(&As[threadIdx.x], &A[threadIdx.x], 16);
    __pipeline_commit();
    wmma::mma_sync(acc, a, b, acc);
    __syncthreads();
}"""
)

TRITON_ADD = """
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + tl.load(y_ptr + offs, mask=mask), mask=mask)
"""
TRITON_SOFTMAX = """
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * n + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + cols, e / tl.sum(e, axis=0))
"""
TRITON_MATMUL = """
import triton
import triton.language as tl


@triton.jit
def mm(a_ptr, c_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    a = tl.make_block_ptr(a_ptr, (M, K), (K, 1), (0, 0), (BLOCK_M, BLOCK_K), (1, 0))
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        acc += tl.dot(tl.load(a), tl.trans(tl.load(a)))
        a = tl.advance(a, (0, BLOCK_K))
"""

TORCH_ONLY = '''
import torch


class ModelNew(torch.nn.Module):
    """Uses __shared__ memory tiling, __shfl_down_sync and wmma, with #pragma omp simd."""

    def forward(self, x):
        return torch.relu(x)  # a __global__ kernel would go here
'''


@pytest.mark.parametrize(
    ("source", "level"),
    [
        (CPU_SERIAL, 0),
        (CUDA_NAIVE, 0),
        (CPU_AVX, 1),
        (CUDA_FLOAT4, 1),
        (TRITON_ADD, 1),
        (CPU_TILED_HIERARCHY, 2),
        (CUDA_SHARED_TILE, 2),
        (CPU_REGISTER_BLOCKED, 3),
        (CPU_AMX, 3),
        (CUDA_ASYNC_WMMA, 3),
        (TRITON_MATMUL, 3),
    ],
)
def test_describe_memory_levels(source: str, level: int) -> None:
    """Scalar, vectorised, tiled and register-blocked/async kernels get memory 0, 1, 2, 3."""
    assert describe(source).memory == level


@pytest.mark.parametrize(
    ("source", "level"),
    [
        (CPU_TWO_PASS, 0),
        (CPU_TWO_FUNCTIONS, 0),
        (CUDA_TWO_KERNELS, 0),
        (CPU_SERIAL, 1),
        (CUDA_NAIVE, 1),
        (TRITON_SOFTMAX, 1),
        (CPU_WELFORD, 2),
        (CUDA_ONLINE_BLOCK_WARP, 2),
        (CPU_AMX, 3),
        (CUDA_ASYNC_WMMA, 3),
        (TRITON_MATMUL, 3),
    ],
)
def test_describe_compute_levels(source: str, level: int) -> None:
    """Multi-pass, fused, online and tensor-core kernels get compute 0, 1, 2, 3."""
    assert describe(source).compute == level


@pytest.mark.parametrize(
    ("source", "level"),
    [
        (CPU_SERIAL, 0),
        (CUDA_NAIVE, 0),
        (CPU_OMP, 1),
        (CUDA_SHARED_TILE, 1),
        (TRITON_ADD, 1),
        (CPU_AVX, 2),
        (CUDA_WARP, 2),
        (TRITON_SOFTMAX, 2),
        (CPU_TILED_HIERARCHY, 3),
        (CPU_NESTED, 3),
        (CUDA_ONLINE_BLOCK_WARP, 3),
    ],
)
def test_describe_parallel_levels(source: str, level: int) -> None:
    """Serial, block/thread, warp/SIMD and hierarchical kernels get parallel 0, 1, 2, 3."""
    assert describe(source).parallel == level


def test_describe_without_kernel_is_all_zeros() -> None:
    """A module using only torch ops is (0, 0, 0), whatever its comments and docstrings say."""
    assert describe(TORCH_ONLY) == Behaviour(0, 0, 0)
    assert describe("") == Behaviour(0, 0, 0)


def test_describe_ignores_comments_inside_kernel_source() -> None:
    """C++ comments naming techniques do not raise levels; the same code uncommented does."""
    commented = CPU_SERIAL.replace(
        "for (long i", "// __m256 acc[4][4]; #pragma omp parallel for\n    for (long i"
    )
    assert describe(commented) == describe(CPU_SERIAL)
    assert describe(commented.replace("// __m256", "__m256")).memory == 3


def test_describe_reads_raw_cpp_text() -> None:
    """Text that is not Python is read as C++, keeping its pragmas."""
    raw = (
        'extern "C" void f(float* x, int n) {\n'
        "  #pragma omp parallel for simd\n"
        "  for (int i = 0; i < n; ++i) x[i] *= 2;\n"
        "}\n"
    )
    assert describe(raw).cell() == (1, 1, 2)


def test_describe_config_raises_levels() -> None:
    """CONFIG values > 1 for VEC, THREADS and TILE raise memory and parallelism; 1s do not."""
    block = (
        "\n# --- kf:params ---\n"
        'SPACE = {"VEC": [1, 8], "THREADS": [1, 4], "TILE": [1, 64]}\n'
        "CONFIG = {config}\n"
        "# --- kf:end ---\n"
    )
    on = CPU_SERIAL + block.replace("{config}", '{"VEC": 8, "THREADS": 4, "TILE": 64}')
    off = CPU_SERIAL + block.replace("{config}", '{"VEC": 1, "THREADS": 1, "TILE": 1}')
    assert describe(off) == describe(CPU_SERIAL)
    assert describe(on).memory == 2
    assert describe(on).parallel == 3
    threads_only = off.replace('{"VEC": 1, "THREADS": 1', '{"VEC": 1, "THREADS": 4')
    assert describe(threads_only).parallel == 1


def test_behaviour_cell_is_memory_compute_parallel() -> None:
    """cell() returns the three levels in the order memory, compute, parallel."""
    assert Behaviour(memory=3, compute=1, parallel=2).cell() == (3, 1, 2)


def test_level_names_have_four_entries_each() -> None:
    """Each dimension names exactly four levels."""
    assert len(MEMORY_LEVELS) == len(COMPUTE_LEVELS) == len(PARALLEL_LEVELS) == 4


_fragments = st.sampled_from(
    [
        "__global__",
        "__shared__ float t[TILE][TILE];",
        "__shfl_down_sync(",
        "#pragma omp parallel for\n",
        "#pragma omp simd\n",
        '"""',
        "'",
        "# --- kf:params ---\n",
        "# --- kf:end ---\n",
        'SPACE = {"VEC": [1, 4]}\n',
        'CONFIG = {"VEC": 4}\n',
        'extern "C" {',
        "}",
        "/*",
        "//",
        "@triton.jit\n",
        "tl.dot(",
        "float acc[4][4];",
        "\x00",
        "\r",
    ]
)
_texts = st.one_of(st.text(), st.lists(st.one_of(_fragments, st.text(max_size=5))).map("".join))


@settings(max_examples=300, deadline=None)
@given(_texts)
def test_describe_never_raises_and_stays_in_range(source: str) -> None:
    """Any text gives levels in 0..3, and the same text always gives the same behaviour."""
    behaviour = describe(source)
    assert all(0 <= level <= 3 for level in behaviour.cell())
    describe.cache_clear()
    assert describe(source) == behaviour
