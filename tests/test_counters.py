"""Hardware counters: ncu's CSV read right, the collector's new-best policy, and (on a GPU
with Nsight Compute) counters for a real kernel."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
import torch

from agents.counters import CounterCollector, CounterState
from kf.agent import AgentContext
from kf.cuda import ncu
from kf.evaluation import ProfileReport
from kf.evaluation.grader.counters import collect_counters
from kf.events import Event, Record, make_envelope
from kf.search_facts import CandidateProfiled
from kf.tasks import load_task

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "examples" / "cuda_tasks" / "gelu_residual.py"
SEED = ROOT / "examples" / "cuda_tasks" / "seeds" / "gelu_residual.py"

# The shape of `ncu --csv --page raw` output (two kernels), with ncu's scaled units.
# ruff: noqa: E501
NCU_LOG = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "gelu_residual" - 0: 0%....50%....100% - 9 passes
==PROF== Profiling "vectorized_elementwise_kernel" - 1: 0%....50%....100% - 9 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","launch__block_size","launch__grid_size","launch__registers_per_thread","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active"
"","","","","","","","","","","","Mbyte","Mbyte","%","usecond","","","register/thread","%","%"
"0","4242","python3.12","127.0.0.1","gelu_residual","1","7","(256, 1, 1)","(8192, 1, 1)","0","9.0","268.44","134.22","91.50","94.00","256","8192","40","35.20","88.10"
"1","4242","python3.12","127.0.0.1","vectorized_elementwise_kernel","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","1,000.00","0.50","50.00","6.00","128","1024","16","10.00","60.00"
==PROF== Disconnected from process 4242
"""


def test_ncu_raw_csv_is_read_in_bytes_and_nanoseconds() -> None:
    """Each kernel's row becomes its metrics, scaled from ncu's units to bytes and ns."""
    kernels = ncu.parse(NCU_LOG)
    assert [k["kernel"] for k in kernels] == ["gelu_residual", "vectorized_elementwise_kernel"]
    first = kernels[0]
    assert first["dram_bytes_read"] == pytest.approx(268.44e6)
    assert first["duration_ns"] == pytest.approx(94_000.0)
    assert first["registers_per_thread"] == 40
    assert kernels[1]["dram_bytes_read"] == pytest.approx(1e9)  # thousands separator
    summary = ncu.summarise(kernels)
    assert summary["kernels"] == 2
    assert summary["duration_ns"] == pytest.approx(100_000.0)
    # time-weighted: (91.5 * 94 + 50 * 6) / 100
    assert summary["dram_throughput_pct"] == pytest.approx(89.01)
    assert summary["dram_gbs"] == pytest.approx((268.44e6 + 134.22e6 + 1e9 + 0.5e6) / 1e5)


def test_ncu_log_without_kernels_and_refusals_are_told_apart() -> None:
    """No CSV at all parses to nothing; a permission refusal is recognised as one."""
    assert ncu.parse("==PROF== Connected\n==ERROR== nothing\n") == []
    assert ncu.permission_refused("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission")
    assert not ncu.permission_refused("==PROF== Disconnected")


def test_find_ncu_honours_the_switch_and_an_explicit_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KF_NCU=0`` switches counters off; ``KF_NCU=/path`` is used when executable."""
    monkeypatch.setenv("KF_NCU", "0")
    assert ncu.find_ncu() is None
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho 'Version 2099.1.0.0 (build 1)'\n")
    monkeypatch.setenv("KF_NCU", str(fake))
    assert ncu.find_ncu() is None  # not executable
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert ncu.find_ncu() == str(fake)
    assert ncu.version(str(fake)) == "Version 2099.1.0.0 (build 1)"
    argv = ncu.command(str(fake), "/tmp/x.csv")
    assert argv[0] == str(fake) and "--profile-from-start" in argv and "off" in argv


def test_counters_on_a_cpu_say_why_there_are_none() -> None:
    """Asked for a CPU device, the stage reports the reason instead of measuring."""
    report = collect_counters(load_task(TASK), SEED.read_text(), device="cpu")
    assert not report.ok and report.error


_seq = 0


def _rec(ev: Event) -> Record:
    global _seq
    _seq += 1
    return Record(make_envelope(ev, run_id="r", source="t@x", event_id=f"c{_seq}", seq=_seq), ev)


def _profiled(
    cid: str, speedup: float, *, device: str = "gpu0", flags: tuple[str, ...] = ()
) -> Record:
    report = ProfileReport(ok=True, speedup=speedup, runtime_ms=1.0, flags=flags)
    return _rec(CandidateProfiled(candidate_id=cid, task="t", device_id=device, report=report))


def test_collector_measures_only_new_trustworthy_bests_of_its_own_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """New bests on this device are measured; slower ones, suspect ones and other devices'
    are not; without ncu nothing is measured at all."""
    agent = CounterCollector(
        AgentContext(
            run_id="r", agent_id="counters@t", options={"device": "cuda:0", "device_id": "gpu0"}
        )
    )
    state = agent.initial_state()
    assert isinstance(state, CounterState)
    for rec in (
        _profiled("a", 1.5),
        _profiled("b", 1.2),
        _profiled("c", 3.0, flags=("timer_disagreement: x",)),
        _profiled("d", 9.0, device="gpu1"),
        _profiled("e", 2.0),
    ):
        state = agent.evolve(state, rec)
    assert isinstance(state, CounterState)
    assert state.new_bests == {"a", "e"}
    assert state.best == {"t": 2.0}
    monkeypatch.setenv("KF_NCU", "0")
    assert asyncio.run(agent.react(state, _profiled("a", 1.5))) == ()


needs_gpu_ncu = pytest.mark.skipif(
    not torch.cuda.is_available() or ncu.find_ncu() is None,
    reason="needs an NVIDIA GPU, a CUDA build of PyTorch and Nsight Compute (CI has none)",
)


@needs_gpu_ncu
def test_counters_of_the_fused_kernel_on_a_gpu() -> None:
    """ncu measures the NVRTC seed's one kernel: it moves about the bytes the task needs
    (two 128 MiB inputs read, one written) at a large share of DRAM bandwidth."""
    report = collect_counters(load_task(TASK), SEED.read_text(), device="cuda:0")
    print(report.error, report.summary, report.network_isolated)
    assert report.ok, report.error
    assert len(report.kernels) == 1
    moved = report.summary["dram_bytes"]
    assert 0.9 * 3 * 128 * 2**20 < moved < 1.3 * 3 * 128 * 2**20
    assert report.summary["dram_throughput_pct"] > 50
    print(os.environ.get("KF_NCU"), report.tool, report.summary, report.network_isolated)


def test_mutation_prompt_carries_the_parents_build_report_and_counters() -> None:
    """What the compiler said (registers, spills) and ncu measured reaches the model."""
    from agents.llm_mutator import build_notes
    from kf.llm.prompts import MutationContext, mutation_messages

    log = (
        "building…\n"
        "kf.cuda: gelu_residual sm_90: 40 registers, 0 bytes smem, 8 bytes spill stores\n"
        "other line\n"
    )
    notes = build_notes(log)
    assert notes == "kf.cuda: gelu_residual sm_90: 40 registers, 0 bytes smem, 8 bytes spill stores"
    assert build_notes("nothing here") is None
    ctx = MutationContext(
        task="t", reference="ref", parent_id="p" * 12, parent_source="src", operator="rewrite",
        regions={}, parent_build=notes,
        parent_counters={"dram_throughput_pct": 91.5, "achieved_occupancy_pct": 88.1},
    )  # fmt: skip
    user = mutation_messages(ctx)[1]["content"]
    assert "8 bytes spill stores" in user
    assert "DRAM throughput % of peak 91.5" in user and "achieved occupancy % 88.1" in user
    bare = mutation_messages(
        MutationContext(
            task="t", reference="r", parent_id="p", parent_source="s", operator="o", regions={}
        )
    )
    assert "hardware counters say" not in bare[1]["content"]
