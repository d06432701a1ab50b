"""Layer normalisation over the last dimension, with a learned affine transform."""

import torch
from torch import nn

BATCH = 1024
DIM = 1024


class Model(nn.Module):
    """y = LayerNorm(dim)(x) (eps 1e-5, elementwise affine)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        with torch.no_grad():  # non-trivial affine so a kernel that ignores it fails
            self.norm.weight.add_(0.1 * torch.randn(dim))
            self.norm.bias.add_(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, DIM)]


def get_init_inputs() -> list[int]:
    return [DIM]
