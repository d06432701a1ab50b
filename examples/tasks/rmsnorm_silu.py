"""Fusion task: RMS normalisation over the last dimension with a learned gain, then SiLU.

Written the way a model file would write it, eager PyTorch runs about seven kernels
(pow, mean, add, rsqrt, two muls, silu); a fused kernel needs one read and one write.
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 1024
DIM = 1024


class Model(nn.Module):
    """y = SiLU(x / sqrt(mean(x², -1) + eps) * weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return F.silu(x * inv_rms * self.weight)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, DIM)]


def get_tuning_inputs() -> list[list[torch.Tensor]]:
    """Other batch sizes the same layer sees (kf tunes template parameters per shape)."""
    return [[torch.randn(b, DIM)] for b in (8, 8192)]


def get_init_inputs() -> list[float]:
    return [DIM, 1e-6]
