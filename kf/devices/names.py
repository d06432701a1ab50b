"""Device names: ``cpu`` and ``cuda:N`` checked against what this machine has
(:func:`parse_device`). The grader, ``kf run``'s and ``kf worker``'s device lists
(:mod:`kf.devices`) and a runner's timing backend all read a device's name through it,
so it imports nothing of kf.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["DeviceError", "cuda_device_count", "parse_device"]


class DeviceError(ValueError):
    """The requested device is malformed, unknown or not available here."""


_CUDA = re.compile(r"^cuda(:\d+)?$")


def parse_device(device: str, count: Callable[[], int] | None = None) -> str:
    """Return the canonical device name or raise :class:`DeviceError` saying what works;
    ``count`` replaces :func:`cuda_device_count` (tests)."""
    name = device.strip().lower()
    if name == "cpu":
        return "cpu"
    if _CUDA.match(name):
        index = int(name.partition(":")[2] or 0)
        available = (count or cuda_device_count)()
        if index >= available:
            raise DeviceError(f"device {device!r} is not available: {_what_works(available)}")
        return f"cuda:{index}"
    raise DeviceError(f"unknown device {device!r}: expected 'cpu' or 'cuda:N'")


def _what_works(available: int) -> str:
    if available:
        return (
            f"this machine has {available} CUDA device(s) that PyTorch can use; use one of "
            "them or --device cpu, or run on a machine with that GPU"
        )
    return (
        "this machine has no CUDA devices that PyTorch can use, so only 'cpu' is "
        "implemented here; use --device cpu, or run on a machine with an NVIDIA GPU and a "
        "CUDA build of PyTorch"
    )


def cuda_device_count() -> int:
    """CUDA devices PyTorch can use here (0 without a CUDA build or a driver)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
