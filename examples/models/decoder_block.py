"""A small decoder block to try ``kf extract`` on: RMSNorm, causal self-attention (its core
a module of its own that calls ``scaled_dot_product_attention``), and a SwiGLU MLP.

``build(device)`` is the entry point ``kf extract`` calls::

    kf extract examples/models/decoder_block.py:build -o tasks/block --device cpu
    kf extract examples/models/decoder_block.py:build -o tasks/block --device cuda:0

It returns the block and two example inputs, at two sequence lengths. Sizes by device
(``DECODER_BLOCK_SIZE`` = ``tiny`` | ``small`` | ``full`` overrides):

- ``full`` (the default on a GPU): bf16, hidden 4096, 32 heads, MLP 11008 (LLaMA-7B's
  layer), batch 1, sequences 2048 and 1024;
- ``tiny`` (the default on the CPU): fp32, hidden 64, 4 heads, MLP 176, batch 2,
  sequences 16 and 8;
- ``small``: fp32, hidden 256, 4 heads, MLP 688, batch 1, sequences 128 and 64.

``DECODER_BLOCK_DTYPE`` (``bfloat16``, ``float16``, ``float32``) overrides the dtype.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    # hidden, heads, mlp, batch, sequences, dtype
    "tiny": (64, 4, 176, 2, (16, 8), torch.float32),
    "small": (256, 4, 688, 1, (128, 64), torch.float32),
    "full": (4096, 32, 11008, 1, (2048, 1024), torch.bfloat16),
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


class AttentionCore(nn.Module):
    """Causal scaled dot-product attention over (batch, heads, seq, head_dim)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Multi-head self-attention: q/k/v projections, the core, the output projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        out = self.core(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h))


class SiluMul(nn.Module):
    """SwiGLU's gate: silu(gate) * up."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act = SiluMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class DecoderBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)): a pre-norm transformer decoder layer."""

    def __init__(self, hidden: int, heads: int, inner: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def build(device: str = "cpu") -> tuple[nn.Module, list[tuple[torch.Tensor]]]:
    """The block and its example inputs (two sequence lengths), sized for ``device``."""
    size = os.environ.get("DECODER_BLOCK_SIZE") or ("full" if device.startswith("cuda") else "tiny")
    if size not in SIZES:
        raise ValueError(f"DECODER_BLOCK_SIZE={size!r}: expected one of {sorted(SIZES)}")
    hidden, heads, inner, batch, seqs, dtype = SIZES[size]
    dtype = (
        getattr(torch, os.environ.get("DECODER_BLOCK_DTYPE", ""))
        if os.environ.get("DECODER_BLOCK_DTYPE")
        else dtype
    )
    torch.manual_seed(0)
    model = DecoderBlock(hidden, heads, inner).to(device=device, dtype=dtype).eval()
    inputs = [(torch.randn(batch, s, hidden, device=device, dtype=dtype),) for s in seqs]
    return model, inputs
