"""KernelBench-style answers in the layout models write: everything in ``cuda_sources``
under ``#include <torch/extension.h>``, the ``torch::Tensor`` host function launching the
kernels with ``<<<...>>>``. Each is a ``load_inline`` call's arguments (``name``,
``cpp_sources``, ``cuda_sources``, ``functions``, ``extra_cuda_cflags``) and whether
:mod:`kf.cuda.torchsplit` splits it (``SPLIT``) or refuses it (``REFUSED``, and why)."""

from __future__ import annotations

from typing import Any

ELEMENTWISE = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

#define CHECK_CUDA(x) TORCH_CHECK(x.is_cuda(), #x " must be a CUDA tensor")
#define CHECK_CONTIGUOUS(x) TORCH_CHECK(x.is_contiguous(), #x " must be contiguous")
#define CHECK_INPUT(x) CHECK_CUDA(x); CHECK_CONTIGUOUS(x)

__global__ void swish_kernel(const float* __restrict__ x, float* __restrict__ y, int size) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < size) {
        float v = x[idx];
        y[idx] = v / (1.0f + expf(-v));  // x * sigmoid(x)
    }
}

torch::Tensor swish_cuda(torch::Tensor x) {
    CHECK_INPUT(x);
    auto y = torch::empty_like(x);
    int size = x.numel();
    const int block_size = 256;
    const int num_blocks = (size + block_size - 1) / block_size;
    swish_kernel<<<num_blocks, block_size>>>(x.data_ptr<float>(), y.data_ptr<float>(), size);
    return y;
}
"""

REDUCTION = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda.h>
#include <cuda_runtime.h>

#define BLOCK 256
constexpr float kEps = 1e-5f;

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_down_sync(0xffffffff, v, offset);
    return v;
}

// one block per row: mean and variance in shared memory, then normalise
__global__ void row_norm_kernel(const float* __restrict__ x, float* __restrict__ y,
                                int rows, int cols) {
    __shared__ float partial[BLOCK / 32];
    int row = blockIdx.x;
    const float* xr = x + (long long)row * cols;
    float sum = 0.0f, sq = 0.0f;
    for (int c = threadIdx.x; c < cols; c += BLOCK) {
        float v = xr[c];
        sum += v;
        sq += v * v;
    }
    sum = warp_sum(sum);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = threadIdx.x < BLOCK / 32 ? partial[threadIdx.x] : 0.0f;
        s = warp_sum(s);
        if (threadIdx.x == 0) partial[0] = s;
    }
    __syncthreads();
    float mean = partial[0] / cols;
    __syncthreads();
    sq = warp_sum(sq);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sq;
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = threadIdx.x < BLOCK / 32 ? partial[threadIdx.x] : 0.0f;
        s = warp_sum(s);
        if (threadIdx.x == 0) partial[0] = s;
    }
    __syncthreads();
    float var = partial[0] / cols - mean * mean;
    float inv = rsqrtf(var + kEps);
    for (int c = threadIdx.x; c < cols; c += BLOCK)
        y[(long long)row * cols + c] = (xr[c] - mean) * inv;
}

torch::Tensor row_norm(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2, "x must be 2-D");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    int rows = xc.size(0), cols = xc.size(1);
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    row_norm_kernel<<<rows, BLOCK, 0, stream>>>(xc.data_ptr<float>(), y.data_ptr<float>(),
                                                rows, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""

TEMPLATE_HELPER = r"""
#include <torch/extension.h>

template <typename T>
__device__ T relu(T v) { return v > T(0) ? v : T(0); }

__global__ void relu_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = relu(x[i]);
}

torch::Tensor relu_cuda(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    relu_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

DISPATCH = r"""
#include <torch/extension.h>

template <typename scalar_t>
__global__ void scale_kernel(const scalar_t* x, scalar_t* y, scalar_t s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s;
}

torch::Tensor scale_cuda(torch::Tensor x, double s) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scale_cuda", [&] {
        scale_kernel<scalar_t><<<(n + 255) / 256, 256>>>(
            x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), (scalar_t)s, n);
    });
    return y;
}
"""

MULTI_KERNEL = r"""
#include <torch/extension.h>
#include <cuda_fp16.h>

__constant__ float c_bias[4];

struct Pair {
    float a, b;
};

__device__ Pair mix(float v) { return {v * 0.5f, v + 1.0f}; }

__global__ void to_half_kernel(const float* x, __half* h, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) h[i] = __float2half(x[i] + c_bias[i & 3]);
}

__global__ __launch_bounds__(512) void combine_kernel(const __half* h, float* y, long long n,
                                                      float alpha) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) {
        Pair p = mix(__half2float(h[i]));
        y[i] = alpha * p.a + p.b;
    }
}

static int blocks_for(long long n, int threads) { return (int)((n + threads - 1) / threads); }

torch::Tensor two_pass(torch::Tensor x, double alpha) {
    auto h = torch::empty(x.sizes(), x.options().dtype(torch::kHalf));
    auto y = torch::empty_like(x);
    long long n = x.numel();
    int threads = 512;
    to_half_kernel<<<blocks_for(n, threads), threads>>>(
        x.data_ptr<float>(), reinterpret_cast<__half*>(h.data_ptr<at::Half>()), n);
    combine_kernel<<<blocks_for(n, threads), threads>>>(
        reinterpret_cast<const __half*>(h.data_ptr<at::Half>()), y.data_ptr<float>(), n,
        static_cast<float>(alpha));
    return y;
}
"""

STREAM = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

__global__ void add_kernel(const float* a, const float* b, float* out, int n) {
    extern __shared__ float tile[];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = i < n ? a[i] : 0.0f;
    __syncthreads();
    if (i < n) out[i] = tile[threadIdx.x] + b[i];
}

torch::Tensor add_cuda(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.sizes() == b.sizes(), "shapes differ");
    auto out = torch::empty_like(a);
    int n = a.numel();
    int threads = 128;
    auto stream = c10::cuda::getCurrentCUDAStream();
    add_kernel<<<(n + threads - 1) / threads, threads, threads * sizeof(float), stream>>>(
        a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

SYMBOL = r"""
#include <torch/extension.h>

__constant__ float c_scale;

__global__ void scale_kernel(float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= c_scale;
}

torch::Tensor scale_inplace(torch::Tensor y, double s) {
    float v = (float)s;
    cudaMemcpyToSymbol(c_scale, &v, sizeof(float));
    int n = y.numel();
    scale_kernel<<<(n + 255) / 256, 256>>>(y.data_ptr<float>(), n);
    return y;
}
"""

HOST_MIN = r"""
#include <torch/extension.h>

__global__ void copy_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}

torch::Tensor copy_cuda(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    int blocks = min((n + 255) / 256, 65535);
    copy_kernel<<<blocks, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""


def _call(name: str, source: str, function: str, declaration: str) -> dict[str, Any]:
    return {
        "name": name,
        "cpp_sources": declaration,
        "cuda_sources": source,
        "functions": [function],
        "extra_cuda_cflags": ["-O3"],
    }


#: name -> the call
ANSWERS: dict[str, dict[str, Any]] = {
    "elementwise": _call(
        "swish", ELEMENTWISE, "swish_cuda", "torch::Tensor swish_cuda(torch::Tensor x);"
    ),
    "reduction": _call(
        "row_norm", REDUCTION, "row_norm", "torch::Tensor row_norm(torch::Tensor x);"
    ),
    "multi_kernel": _call(
        "two_pass",
        MULTI_KERNEL,
        "two_pass",
        "torch::Tensor two_pass(torch::Tensor x, double alpha);",
    ),
    "stream": _call(
        "add", STREAM, "add_cuda", "torch::Tensor add_cuda(torch::Tensor a, torch::Tensor b);"
    ),
    "template_helper": _call(
        "relu_t", TEMPLATE_HELPER, "relu_cuda", "torch::Tensor relu_cuda(torch::Tensor x);"
    ),
    "dispatch": _call(
        "scale_d", DISPATCH, "scale_cuda", "torch::Tensor scale_cuda(torch::Tensor x, double s);"
    ),
    "symbol": _call(
        "scale_s",
        SYMBOL,
        "scale_inplace",
        "torch::Tensor scale_inplace(torch::Tensor y, double s);",
    ),
    "host_min": _call("copy_m", HOST_MIN, "copy_cuda", "torch::Tensor copy_cuda(torch::Tensor x);"),
}

#: the answers split
SPLIT = ("elementwise", "reduction", "multi_kernel", "stream")
#: the answers refused, and a word of why
REFUSED = {
    "template_helper": "template",
    "dispatch": "template",
    "symbol": "c_scale",
    "host_min": "min",
}
