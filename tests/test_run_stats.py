"""The run summary's figures from a log's envelopes (kf.app.run_stats)."""

from __future__ import annotations

from kf.app.run_stats import format_run_stats, run_stats
from kf.events import Envelope, Event, make_envelope
from kf.facts import DeviceAnnounced, DeviceHeartbeat, RunFinished
from kf.reports import CompileReport
from kf.search_facts import CandidateAssigned, CandidateCompiled


def _envelopes(*timed: tuple[float, Event]) -> list[Envelope]:
    return [
        make_envelope(ev, run_id="r", source="t@x", event_id=f"e{i}", seq=i + 1, at=at)
        for i, (at, ev) in enumerate(timed)
    ]


def test_a_gpus_utilisation_is_the_mean_of_its_heartbeats() -> None:
    """A GPU's heartbeats carry nvidia-smi's mean utilisation since the one before; the
    summary gives their mean for the device and says so; a device whose heartbeats carry
    none (a CPU's) gets no such figure."""
    gpu, cpu = "h/cuda:0", "h/cpu"
    failed = CompileReport(ok=False, error="no")
    log = _envelopes(
        (0.0, DeviceAnnounced(device_id=gpu, kind="cuda", agent_id="a")),
        (1.0, CandidateAssigned(candidate_id="c1", task="t", device_id=gpu, attempt=1)),
        (1.5, CandidateAssigned(candidate_id="c2", task="t", device_id=cpu, attempt=1)),
        (10.0, DeviceHeartbeat(device_id=gpu, utilisation_pct=12.0)),
        (10.0, DeviceHeartbeat(device_id=cpu)),
        (20.0, DeviceHeartbeat(device_id=gpu, utilisation_pct=30.0)),
        (25.0, CandidateCompiled(candidate_id="c1", task="t", device_id=gpu, report=failed)),
        (26.0, CandidateCompiled(candidate_id="c2", task="t", device_id=cpu, report=failed)),
        (30.0, RunFinished(reason="budget")),
    )
    stats = run_stats(log)
    assert stats["devices"][gpu]["gpu_utilisation_pct"] == 21.0
    assert "gpu_utilisation_pct" not in stats["devices"][cpu]
    lines = "\n".join(format_run_stats(stats))
    assert "GPU utilisation 21.0% (nvidia-smi, mean)" in lines
    assert lines.count("GPU utilisation") == 1
