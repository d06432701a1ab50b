"""Row softmax over the last dimension of a (batch, n) matrix."""

import torch
from torch import nn

BATCH = 256
N = 4096


class Model(nn.Module):
    """y = softmax(x, dim=-1)."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(BATCH, N)]


def get_init_inputs() -> list[int]:
    return []
