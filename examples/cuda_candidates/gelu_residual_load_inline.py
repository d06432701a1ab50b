"""A KernelBench-style candidate for examples/cuda_tasks/gelu_residual.py: CUDA C++ built
with ``torch.utils.cpp_extension.load_inline``, exactly as KernelBench's generated kernels
are (``kf eval`` builds it through kf's content-addressed cache; the code is unchanged)."""

import torch
from torch import nn
from torch.utils.cpp_extension import load_inline

BLOCK = 256
ITEMS = 4

cuda_source = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

#define BLOCK __BLOCK__
#define ITEMS __ITEMS__

__device__ __forceinline__ float gelu_tanh(float v) {
    const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
    return v / (1.0f + __expf(-2.0f * u));
}

__global__ void gelu_residual_kernel(const float4* __restrict__ x, const float4* __restrict__ res,
                                     const float4* __restrict__ scale, const float4* __restrict__ bias,
                                     float4* __restrict__ out, long long n4, long long cols4) {
    const long long base = (long long)blockIdx.x * BLOCK * ITEMS + threadIdx.x;
    #pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const long long i = base + (long long)k * BLOCK;
        if (i < n4) {
            const float4 a = x[i], r = res[i];
            const long long c = i % cols4;
            const float4 s = scale[c], b = bias[c];
            float4 o;
            o.x = gelu_tanh(a.x * s.x + b.x) + r.x;
            o.y = gelu_tanh(a.y * s.y + b.y) + r.y;
            o.z = gelu_tanh(a.z * s.z + b.z) + r.z;
            o.w = gelu_tanh(a.w * s.w + b.w) + r.w;
            out[i] = o;
        }
    }
}

torch::Tensor gelu_residual_cuda(torch::Tensor x, torch::Tensor res, torch::Tensor scale, torch::Tensor bias) {
    auto out = torch::empty_like(x);
    const long long n4 = x.numel() / 4;
    const long long per_block = BLOCK * ITEMS;
    const int blocks = (int)((n4 + per_block - 1) / per_block);
    gelu_residual_kernel<<<blocks, BLOCK>>>(
        (const float4*)x.data_ptr<float>(), (const float4*)res.data_ptr<float>(),
        (const float4*)scale.data_ptr<float>(), (const float4*)bias.data_ptr<float>(),
        (float4*)out.data_ptr<float>(), n4, x.size(-1) / 4);
    return out;
}
""".replace("__BLOCK__", str(BLOCK)).replace("__ITEMS__", str(ITEMS))

cpp_source = "torch::Tensor gelu_residual_cuda(torch::Tensor x, torch::Tensor res, torch::Tensor scale, torch::Tensor bias);"

gelu_residual = load_inline(
    name="gelu_residual",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["gelu_residual_cuda"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.bias = nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return gelu_residual.gelu_residual_cuda(
            x.contiguous(), residual.contiguous(), self.scale, self.bias
        )
