"""Hardware agents that announce before measuring, and the GPU probe started early."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hardware_agents.base import HardwareAgent
from kf import bus
from kf.agent import AgentContext
from kf.bus import EmbeddedServer
from kf.devices.gate import gate_for
from kf.events import decode_event
from kf.log import EventLog
from kf.runtime import AgentRunner
from tests.harness import archivist, wait_for

RUN = "hwtest"


class MeasuresLater(HardwareAgent):
    """A device whose measurement takes a while (and may fail)."""

    device_kind = "cpu"
    default_device = "cpu"
    announce_before_measuring = True
    fail = False
    calls: list[bool] = []

    def probe(self, measure: bool) -> dict[str, Any]:
        MeasuresLater.calls.append(measure)
        if measure:
            time.sleep(0.2)
            if self.fail:
                raise RuntimeError("bandwidth test crashed")
        return {
            "backends": ["cpp-openmp"],
            "measured_copy_bandwidth_gbs": 12.5 if measure else None,
        }


def announced(db: Path) -> list[dict[str, Any]]:
    with EventLog(db, readonly=True) as elog:
        return [
            decode_event(e).capabilities  # type: ignore[attr-defined]
            for e in elog.read(types=["device.announced"])
        ]


async def _serve(url: str, db: Path, agent: HardwareAgent, hold_gate: bool) -> list[dict]:
    nc = await bus.connect(bus.BusOptions(url))
    stop, ready = asyncio.Event(), asyncio.Event()
    async with archivist(url, RUN, db):
        gate = await gate_for("cpu").exclusive() if hold_gate else None
        task = asyncio.create_task(AgentRunner(agent, nc).run(stop, ready))
        await wait_for(lambda: len(announced(db)) >= 1, what="the first announcement")
        if gate is not None:
            await asyncio.sleep(0.5)  # the measurement waits for the gate timing holds
            assert len(announced(db)) == 1
            await gate.__aexit__(None, None, None)
        if not agent.fail:  # type: ignore[attr-defined]
            await wait_for(lambda: len(announced(db)) >= 2, what="the measured announcement")
        else:
            await asyncio.sleep(0.6)
        stop.set()
        await task
    await bus.close(nc)
    return announced(db)


def _agent(fail: bool = False) -> MeasuresLater:
    MeasuresLater.calls = []
    agent = MeasuresLater(
        AgentContext(run_id=RUN, agent_id="hardware@t", options={"device_id": "box/cpu"})
    )
    agent.fail = fail  # type: ignore[misc]
    return agent


async def test_announces_at_once_then_measures_with_the_device_to_itself(
    nats_server: EmbeddedServer, db_path: Path
) -> None:
    """The device is announced unmeasured (so work is routed at once); the measurement
    waits for the device gate that timing takes, then a second announcement carries it."""
    caps = await _serve(nats_server.url, db_path, _agent(), hold_gate=True)
    assert MeasuresLater.calls == [False, True]
    assert [c["measured_copy_bandwidth_gbs"] for c in caps] == [None, 12.5]
    assert all(c["backends"] == ["cpp-openmp"] for c in caps)


async def test_a_failed_measurement_keeps_the_first_announcement(
    nats_server: EmbeddedServer, db_path: Path
) -> None:
    caps = await _serve(nats_server.url, db_path, _agent(fail=True), hold_gate=False)
    assert MeasuresLater.calls == [False, True]
    assert len(caps) == 1 and caps[0]["measured_copy_bandwidth_gbs"] is None
    with EventLog(db_path, readonly=True) as elog:
        assert list(elog.read(types=["device.left"]))  # it went on serving and left cleanly


def test_early_gpu_probe_is_taken_once_and_failures_fall_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kf run` starts the GPU's description while it checks its tasks; the CUDA hardware
    agent takes it instead of probing again (once), and probes itself if it failed."""
    from hardware_agents import cuda, cuda_agent
    from hardware_agents.cuda import CudaCapabilities, probe_early, take_early_probe

    started = threading.Event()
    caps = CudaCapabilities(
        device="cuda:3", name="Fake GPU", compute_capability="9.0", sm_count=132,
        memory_bytes=1 << 30, l2_bytes=1 << 20, backends=("cuda-nvrtc",),
    )  # fmt: skip

    def fake(device: str, *, measure: bool = True, timeout_s: float = 300.0) -> CudaCapabilities:
        assert not measure
        started.set()
        if device == "cuda:4":
            raise RuntimeError("no such GPU")
        return caps

    monkeypatch.setattr(cuda, "probe_in_subprocess", fake)
    probe_early("cuda:3")
    probe_early("cuda:3")  # started once
    assert started.wait(5)
    assert take_early_probe("cuda:3") == caps
    assert take_early_probe("cuda:3") is None  # taken
    probe_early("cuda:4")
    assert take_early_probe("cuda:4") is None  # failed: the agent probes again

    probed: list[tuple[str, bool]] = []

    def direct(device: str, *, measure: bool = True) -> CudaCapabilities:
        probed.append((device, measure))
        return caps

    monkeypatch.setattr(cuda_agent, "probe_in_subprocess", direct)
    agent = cuda_agent.CudaHardwareAgent(
        AgentContext(run_id=RUN, agent_id="hardware@t", options={"device": "cuda:3"})
    )
    probe_early("cuda:3")
    assert agent.probe(False)["name"] == "Fake GPU" and probed == []  # the early one
    assert agent.probe(False)["name"] == "Fake GPU" and probed == [("cuda:3", False)]
    agent.probe(True)
    assert probed[-1] == ("cuda:3", True)  # measuring never uses the early description
