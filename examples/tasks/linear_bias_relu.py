"""Fusion task: a narrow linear layer (matmul + bias) followed by ReLU.

The contraction is short (K = 16) and the output wide, so eager PyTorch spends much of
its time outside the GEMM: it broadcasts the bias into the output, runs the GEMM, then
makes a separate ReLU pass over 16 MiB. A blocked kernel applies bias and ReLU while the
tile is still in registers.
"""

import torch
from torch import nn

BATCH = 2048
IN_FEATURES = 16
OUT_FEATURES = 512


class Model(nn.Module):
    """y = relu(x @ W.T + b)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, IN_FEATURES)]


def get_tuning_inputs() -> list[list[torch.Tensor]]:
    """Other batch sizes the same layer sees (kf tunes template parameters per shape)."""
    return [[torch.randn(b, IN_FEATURES)] for b in (32, 16384)]


def get_init_inputs() -> list[int]:
    return [IN_FEATURES, OUT_FEATURES]
