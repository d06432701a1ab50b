"""Seed for gelu_residual: one fused NVRTC kernel, 16-byte loads, several float4s per thread.

Each thread handles ``ITEMS`` float4 groups spaced a grid-stride apart, so the loads of
one thread are independent and in flight together. ``MATH="exp"`` computes
GELU_tanh(v) = v * sigmoid(2u) with one ``__expf``; ``MATH="tanh"`` calls ``tanhf``.
"""

import torch
from torch import nn

import kf.cuda

# --- kf:params ---
SPACE = {
    "BLOCK": [128, 256, 512, 1024],
    "ITEMS": [1, 2, 4, 8],
    "MATH": ["exp", "tanh"],
}
CONFIG = {"BLOCK": 256, "ITEMS": 4, "MATH": "exp"}
# --- kf:end ---

SOURCE = r"""
__device__ __forceinline__ float gelu_tanh(float v) {
    const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
#if MATH_EXP
    return v / (1.0f + __expf(-2.0f * u));
#else
    return 0.5f * v * (1.0f + tanhf(u));
#endif
}

extern "C" __global__ void __launch_bounds__(BLOCK)
gelu_residual(const float4* __restrict__ x, const float4* __restrict__ res,
              const float4* __restrict__ scale, const float4* __restrict__ bias,
              float4* __restrict__ out, long long n4, long long cols4) {
    const long long base = (long long)blockIdx.x * BLOCK * ITEMS + threadIdx.x;
    float4 xv[ITEMS], rv[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const long long i = base + (long long)k * BLOCK;
        if (i < n4) { xv[k] = x[i]; rv[k] = res[i]; }
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const long long i = base + (long long)k * BLOCK;
        if (i < n4) {
            const long long c = i % cols4;
            const float4 s = scale[c], b = bias[c];
            float4 o;
            o.x = gelu_tanh(xv[k].x * s.x + b.x) + rv[k].x;
            o.y = gelu_tanh(xv[k].y * s.y + b.y) + rv[k].y;
            o.z = gelu_tanh(xv[k].z * s.z + b.z) + rv[k].z;
            o.w = gelu_tanh(xv[k].w * s.w + b.w) + rv[k].w;
            out[i] = o;
        }
    }
}
"""


class ModelNew(nn.Module):
    """Fused GELU_tanh(x * scale + bias) + residual in one pass, compiled by NVRTC."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.bias = nn.Parameter(0.1 * torch.randn(hidden))
        if hidden % 4:
            raise ValueError("this kernel needs a hidden size divisible by 4 (float4 loads)")
        self.kernel = kf.cuda.compile(
            SOURCE,
            defines={
                "BLOCK": CONFIG["BLOCK"],
                "ITEMS": CONFIG["ITEMS"],
                "MATH_EXP": int(CONFIG["MATH"] == "exp"),
            },
        ).function("gelu_residual")

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        residual = residual.expand_as(x).contiguous()
        out = torch.empty_like(x)
        n4 = x.numel() // 4
        per_block = CONFIG["BLOCK"] * CONFIG["ITEMS"]
        grid = (n4 + per_block - 1) // per_block
        self.kernel.launch(
            grid,
            CONFIG["BLOCK"],
            [x, residual, self.scale, self.bias, out, n4, x.shape[-1] // 4],
        )
        return out
