"""Triton seed for gelu_residual: one fused pass, a block of elements per program."""

import torch
import triton
import triton.language as tl
from torch import nn

# --- kf:params ---
SPACE = {"BLOCK": [1024, 2048, 4096, 8192], "WARPS": [4, 8]}
CONFIG = {"BLOCK": 4096, "WARPS": 8}
# --- kf:end ---


@triton.jit
def _gelu_residual(x_ptr, r_ptr, s_ptr, b_ptr, o_ptr, n, cols, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = offs % cols
    v = tl.load(x_ptr + offs, mask=mask) * tl.load(s_ptr + c, mask=mask) + tl.load(
        b_ptr + c, mask=mask
    )
    u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
    g = v / (1.0 + tl.exp(-2.0 * u))
    tl.store(o_ptr + offs, g + tl.load(r_ptr + offs, mask=mask), mask=mask)


class ModelNew(nn.Module):
    """Fused GELU_tanh(x * scale + bias) + residual, in Triton."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.bias = nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        residual = residual.expand_as(x).contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        grid = (triton.cdiv(n, CONFIG["BLOCK"]),)
        _gelu_residual[grid](
            x,
            residual,
            self.scale,
            self.bias,
            out,
            n,
            x.shape[-1],
            BLOCK=CONFIG["BLOCK"],
            num_warps=CONFIG["WARPS"],
        )
        return out
