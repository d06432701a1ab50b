"""The CUDA hardware agent: announces one GPU (probed in a child process), heartbeats
while it serves and announces when it leaves, as the CPU one does. The compiler and
verifier a CUDA worker hosts beside it are agents (:mod:`agents.worker`)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from hardware_agents.base import HardwareAgent
from hardware_agents.cuda import probe_in_subprocess, take_early_probe
from kf.agent import AgentContext
from kf.devices.smi import UtilisationSampler

__all__ = ["CudaHardwareAgent"]


class CudaHardwareAgent(HardwareAgent):
    """One GPU, probed in a child process (the worker's own process keeps no CUDA context).

    It announces the GPU before measuring its copy bandwidth and matmul throughput, so
    builds for it start at once (they use the host's cores, not the GPU); the measured
    figures follow in a second announcement. ``kf run`` starts the first description
    while it checks its tasks (:func:`hardware_agents.cuda.probe_early`).
    """

    device_kind = "cuda"
    default_device = "cuda:0"
    announce_before_measuring = True

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self._sampler = UtilisationSampler(self.device)

    async def on_start(self) -> None:
        self._sampler.start()  # before the probe: its measurements are the GPU's work too
        await super().on_start()

    async def on_stop(self) -> None:
        await super().on_stop()
        await asyncio.to_thread(self._sampler.stop)  # never holds the loop on a slow exit

    def utilisation(self) -> float | None:
        return self._sampler.take()

    def probe(self, measure: bool) -> dict[str, Any]:
        early = None if measure else take_early_probe(self.device)
        caps: dict[str, Any] = msgspec.to_builtins(
            early or probe_in_subprocess(self.device, measure=measure)
        )
        return caps
