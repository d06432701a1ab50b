"""Reduction task: sum each row of a (batch, n) matrix."""

import torch
from torch import nn

BATCH = 512
N = 8192


class Model(nn.Module):
    """y = x.sum(dim=1)."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, N)]


def get_init_inputs() -> list[int]:
    return []
