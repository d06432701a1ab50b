"""The text of a task ``kf extract`` writes: a KernelBench-format file that imports only
``torch`` (and ``operator``, for exported graphs), so a remote worker runs it from the log.

Inputs are drawn at the real inputs' statistics: a floating-point input as a normal
sample at the real one's mean and standard deviation, an integer input uniformly between
the real one's smallest and largest values, a boolean input at the real share of True.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["PRELUDE", "InputRecipe", "task_text"]

#: what every extracted task starts with (the region's code uses ``_fill`` and ``_DEVICE``)
PRELUDE = '''\
import operator  # noqa: F401  (getitem, in exported graphs)

import torch
from torch import nn


def _fill(tensor, mean, std):
    """Draw a parameter at the real one's mean and standard deviation."""
    with torch.no_grad():
        tensor.copy_(torch.randn(tensor.shape, dtype=torch.float32) * std + mean)


def _input(shape, dtype, mean=0.0, std=1.0, low=0, high=1):
    """An input of the real one's shape and dtype, drawn at its statistics."""
    if dtype.is_floating_point:
        return (torch.randn(shape, dtype=torch.float32) * std + mean).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape) < mean
    return torch.randint(low, high + 1, shape, dtype=dtype)


'''


class InputRecipe(msgspec.Struct, frozen=True, kw_only=True):
    """How to draw one input: the real one's shape, dtype and statistics."""

    shape: list[int]
    dtype: str
    mean: float = 0.0
    std: float = 1.0
    low: int = 0
    high: int = 1

    def call(self) -> str:
        """The ``_input(...)`` expression that draws it."""
        if self.dtype.startswith(("float", "bfloat")):
            stats = f"{self.mean:.6g}, {self.std:.6g}"
        elif self.dtype == "bool":
            stats = f"{self.mean:.6g}"
        else:
            stats = f"low={self.low}, high={self.high}"
        return f"_input({self.shape}, torch.{self.dtype}, {stats})"


def _inputs_list(recipes: Sequence[InputRecipe], indent: str) -> str:
    inner = ",\n".join(f"{indent}    {r.call()}" for r in recipes)
    return f"[\n{inner},\n{indent}]" if recipes else "[]"


def task_text(header: str, model_code: str, shape_sets: Sequence[Sequence[InputRecipe]]) -> str:
    """A whole task file: ``header`` as its docstring, the prelude, the region's
    ``Model``, ``get_init_inputs`` (none: the shapes are in the code), ``get_inputs`` (the
    first shape set) and, with more than one, ``get_tuning_inputs`` (the others)."""
    parts = [
        f'"""{header}"""\n\n',
        PRELUDE,
        model_code.rstrip() + "\n\n\n",
        "def get_init_inputs():\n    return []\n\n\n",
        f"def get_inputs():\n    return {_inputs_list(shape_sets[0], '    ')}\n",
    ]
    if len(shape_sets) > 1:
        sets = ",\n".join(f"        {_inputs_list(s, '        ')}" for s in shape_sets[1:])
        parts.append(f"\n\ndef get_tuning_inputs():\n    return [\n{sets},\n    ]\n")
    return "".join(parts)
