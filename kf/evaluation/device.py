"""Device backends: what differs between timing on a CPU and on a GPU.

The grader side only parses and validates the device string (:func:`parse_device`);
the runner side builds a :class:`Backend` after torch is imported. A CUDA backend
(later) will synchronise the device, flush L2 between trials and time with CUDA
events; the CPU backend times with the runner's bound ``perf_counter_ns``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["Backend", "CPUBackend", "DeviceError", "make_backend", "parse_device"]


class DeviceError(ValueError):
    """The requested device is malformed, unknown or not available here."""


_CUDA = re.compile(r"^cuda(:\d+)?$")


def parse_device(device: str) -> str:
    """Return the canonical device name or raise :class:`DeviceError` saying what works."""
    name = device.strip().lower()
    if name == "cpu":
        return "cpu"
    if _CUDA.match(name):
        raise DeviceError(
            f"device {device!r} is not supported by kf.evaluation yet: only 'cpu' is "
            "implemented (CUDA timing needs device synchronisation, L2 flush and CUDA "
            "events); use --device cpu"
        )
    raise DeviceError(f"unknown device {device!r}: expected 'cpu' or 'cuda:N'")


class Backend:
    """Device-specific operations used by the runner; the default suits a CPU."""

    name = "cpu"

    def __init__(self, clock_ns: Callable[[], int]) -> None:
        self.clock_ns = clock_ns

    def synchronize(self) -> None:
        """Wait for queued work to finish (nothing is queued on a CPU)."""

    def flush_cache(self) -> None:
        """Evict caches between trials (a no-op on CPU: eager and candidate both run warm)."""

    def to_device(self, value: Any) -> Any:
        """Move a tensor (or anything else, unchanged) to this device."""
        return value

    def describe_timer(self) -> str:
        return (
            "time.perf_counter_ns bound at runner start-up before candidate import; "
            "one forward call per sample"
        )

    def time_call_ns(self, fn: Callable[[], Any]) -> int:
        """Time one call of ``fn`` in nanoseconds, synchronised on both sides."""
        self.synchronize()
        start = self.clock_ns()
        fn()
        self.synchronize()
        return self.clock_ns() - start


class CPUBackend(Backend):
    name = "cpu"


def make_backend(device: str, clock_ns: Callable[[], int]) -> Backend:
    """The backend for a canonical device name (see :func:`parse_device`)."""
    if parse_device(device) == "cpu":
        return CPUBackend(clock_ns)
    raise DeviceError(f"no backend for device {device!r}")  # pragma: no cover
