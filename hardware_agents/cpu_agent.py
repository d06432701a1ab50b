"""The CPU hardware agent: announces the CPU's capabilities on connect, heartbeats with its
load while it serves, and announces when it leaves."""

from __future__ import annotations

from typing import Any

import msgspec

from hardware_agents.base import HardwareAgent
from hardware_agents.cpu import probe

__all__ = ["CpuHardwareAgent"]


class CpuHardwareAgent(HardwareAgent):
    """A CPU: model, cores, ISA extensions, caches, memory, measured bandwidth, compilers."""

    device_kind = "cpu"
    default_device = "cpu"

    def probe(self, measure: bool) -> dict[str, Any]:
        caps: dict[str, Any] = msgspec.to_builtins(probe(measure=measure))
        return caps
