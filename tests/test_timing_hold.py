"""Timings that hold (issue 47) on the CPU: the clocks' readings and the drop rule, the
retiming bound, the persisting-L2 reset's bindings against cuda.h, and a CPU profile's
record of its method."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kf.devices.clocks import ClockReader, Clocks, parse_smi_clocks
from kf.evaluation.grader.cli import _hold_lines
from kf.evaluation.grader.clock_watch import GIVE_UP, RETIMES, ClockWatch, clock_dropped
from kf.evaluation.grader.graph_figures import GRAPH_MISMATCH, GraphFigures, graph_calls, with_hold
from kf.evaluation.runner import device_state
from kf.reports import ProfileReport

HIGH, LOW = Clocks(1980, 3201, 40), Clocks(1200, 3201, 41)


class _Scripted:
    """Readings in the order a GPU gave them (there is no GPU here)."""

    how = "scripted"

    def __init__(self, readings: list[Clocks]) -> None:
        self.readings = iter(readings)

    def read(self) -> Clocks | None:
        return next(self.readings, HIGH)


def test_parse_smi_clocks_reads_three_numbers_or_none() -> None:
    """nvidia-smi's clocks line becomes Clocks; [N/A] or an empty answer becomes None."""
    assert parse_smi_clocks("1980, 3201, 41\n") == Clocks(1980, 3201, 41)
    assert parse_smi_clocks("[N/A], 3201, 41") is None
    assert parse_smi_clocks("") is None


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU answers here")
def test_clock_reader_without_gpu_reads_none() -> None:
    """Without NVML or nvidia-smi a reading is None (a timing without one), not an error."""
    reader = ClockReader("cuda:0")
    assert reader.read() is None
    assert reader.how == "none"


def test_clock_dropped_below_the_profiles_peak() -> None:
    """A timing whose SM or memory clock fell over 10 % below the profile's highest is
    dropped, with both clocks named; one at the peak, or without readings, is not."""
    assert clock_dropped(HIGH, HIGH, HIGH) is None
    assert clock_dropped(None, HIGH, HIGH) is None
    why = clock_dropped(HIGH, LOW, HIGH)
    assert why is not None and why.startswith("SM clock 1200 MHz") and "1980 MHz" in why
    mem = clock_dropped(Clocks(1980, 1600, 40), HIGH, HIGH)
    assert mem is not None and mem.startswith("memory clock 1600 MHz")


def test_clock_watch_retimes_a_dropped_timing_then_keeps_it() -> None:
    """A timing that ran on dropped clocks is timed again; one that recovers is kept
    silently, one dropped RETIMES more times is kept and recorded; after GIVE_UP such
    timings no timing is retimed."""
    watch = ClockWatch(_Scripted([HIGH, LOW, HIGH, HIGH]))  # type: ignore[arg-type]
    calls: list[int] = []
    assert watch.timed(lambda: calls.append(1) or len(calls)) == 2
    assert len(watch.retimed) == 1 and not watch.kept_dropped
    calls.clear()
    watch = ClockWatch(_Scripted([HIGH] + [LOW] * 40))  # type: ignore[arg-type]
    watch.timed(lambda: calls.append(1))
    assert len(calls) == RETIMES + 1 and len(watch.kept_dropped) == 1
    for _ in range(GIVE_UP):
        watch.timed(lambda: calls.append(1))
    calls.clear()
    watch.timed(lambda: calls.append(1))
    assert len(calls) == 1
    summary = watch.summary()
    assert summary["sm_mhz"] == [1200, 1980] and summary["kept_dropped"] == GIVE_UP + 2


def test_graph_calls_make_a_replay_of_about_a_millisecond() -> None:
    """N is about 1 ms of calls, 10 at least and 1000 at most."""
    assert graph_calls(0.005) == 200
    assert graph_calls(0.09) == 12
    assert graph_calls(0.5) == 10 and graph_calls(0.0001) == 1000


def test_device_state_bindings_match_cuda_h(tmp_path: Path) -> None:
    """The ctypes layout of the access-policy window and the attribute value, and the
    limit's and attribute's numbers, are cuda.h's (compiled against the installed one)."""
    nvcc = shutil.which("nvcc")
    homes = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    homes += [str(Path(nvcc).resolve().parent.parent)] if nvcc else []
    headers = [Path(h) / "include" / "cuda.h" for h in homes if h]
    header = next((h for h in headers if h.exists()), None)
    if header is None or shutil.which("gcc") is None:
        pytest.skip("no CUDA toolkit here to compile against")
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <cuda.h>\n#include <stdio.h>\n#include <stddef.h>\n"
        'int main(void){printf("%zu %zu %zu %zu %d %d\\n", sizeof(CUaccessPolicyWindow),'
        " offsetof(CUaccessPolicyWindow, num_bytes), offsetof(CUaccessPolicyWindow, hitProp),"
        " sizeof(CUlaunchAttributeValue), (int)CU_LIMIT_PERSISTING_L2_CACHE_SIZE,"
        " (int)CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW); return 0;}\n"
    )
    exe = tmp_path / "layout"
    subprocess.run(["gcc", f"-I{header.parent}", str(src), "-o", str(exe)], check=True)
    got = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    import ctypes

    window = device_state.PolicyWindow
    ours = [
        ctypes.sizeof(window),
        window.num_bytes.offset,
        window.hitProp.offset,
        ctypes.sizeof(device_state._AttributeValue),
        device_state._CU_LIMIT_PERSISTING_L2_CACHE_SIZE,
        device_state._CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW,
    ]
    assert [int(v) for v in got] == ours


def _profiled() -> ProfileReport:
    """A CPU-like profile: 0.012 ms against eager's 0.024 ms, by events."""
    return ProfileReport(
        ok=True, runtime_ms=0.012, ref_runtime_ms=0.024, speedup=2.0, trials=40, ref_trials=40
    )


def test_graph_figures_headline_only_when_every_side_has_one() -> None:
    """With the candidate's and eager's graph figures the headline (runtime, speed-up)
    is the graph's, method graph-N, the per-call figures kept beside; without eager's it
    stays events with the graph's figure and why beside; the flags say what was found."""
    both = GraphFigures(200, {"candidate": [0.004] * 5, "eager": [0.010] * 5}, {}, "")
    report = with_hold(_profiled(), both, ClockWatch(None), "")
    assert report.method == "graph-200" and report.runtime_ms == pytest.approx(0.004)
    assert report.speedup == pytest.approx(2.5) and report.events_speedup == 2.0
    assert report.events_runtime_ms == 0.012 and report.trials == 5
    lines = _hold_lines(report)
    assert lines == ["  one call between events: 0.0120 ms, eager 0.0240 ms, speedup 2.00×"]
    why = "the graph's output on other inputs differs from the same call's outside a graph"
    half = GraphFigures(200, {"candidate": [], "eager": [0.01] * 5}, {"candidate": why}, "x")
    report = with_hold(_profiled(), half, ClockWatch(None), "a persisting-L2 set-aside of 8 bytes")
    assert report.method == "events" and report.runtime_ms == 0.012
    assert report.graph_ref_runtime_ms == pytest.approx(0.01) and report.graph_runtime_ms is None
    codes = [f.split(":", 1)[0] for f in report.flags]
    assert codes == ["device_state_left", GRAPH_MISMATCH]
    assert _hold_lines(report)[0].startswith("  200 calls in a CUDA graph: none (candidate: the")


def test_graph_mismatch_of_a_legacy_stream_launch_is_said_not_flagged() -> None:
    """A candidate whose source launches with no stream (KernelBench's ``<<<grid,
    block>>>``, which a CUDA graph on torch's stream does not capture) keeps the per-call
    headline with the reason, unflagged; the same mismatch from a source that launches
    on a stream, or none, is flagged."""
    why = "the graph's output on other inputs differs from the same call's outside a graph"
    half = GraphFigures(200, {"candidate": [], "eager": [0.01] * 5}, {"candidate": why}, "")
    legacy = "k<<<(n + 255) / 256, 256>>>(x, y, n);"
    report = with_hold(_profiled(), half, ClockWatch(None), "", legacy)
    assert report.method == "events" and report.flags == ()
    assert "legacy default stream" in report.graph_error and why in report.graph_error
    for source in ("k<<<blocks, 256, 0, stream>>>(x, y, n);", "import torch", ""):
        report = with_hold(_profiled(), half, ClockWatch(None), "", source)
        assert [f.split(":", 1)[0] for f in report.flags] == [GRAPH_MISMATCH], source


def test_graph_mismatch_legacy_launches_read_as_their_configuration() -> None:
    """A launch's configuration is split at its top-level commas: ``dim3(a, b)`` grids with
    no stream, or stream ``0``, are the legacy stream (said, unflagged); a ``dim3`` launch
    on a stream, or a legacy launch only in a comment, is flagged."""
    why = "the graph's output on other inputs differs from the same call's outside a graph"
    half = GraphFigures(200, {"candidate": [], "eager": [0.01] * 5}, {"candidate": why}, "")
    said = (
        "k<<<dim3(gx, gy), dim3(16, 16)>>>(x, y, n);",
        "k<<<dim3(gx, gy), dim3(16, 16), 0, 0>>>(x, y, n);",
        "k<<<grid, block, smem, nullptr>>>(x, y, n);",
    )
    flagged = (
        "k<<<dim3(gx, gy), dim3(16, 16), 0, stream>>>(x, y, n);",
        "// k<<<g, b>>>(x, y, n);\nk<<<g, b, 0, at::cuda::getCurrentCUDAStream()>>>(x, y, n);",
    )
    for source in said:
        report = with_hold(_profiled(), half, ClockWatch(None), "", source)
        assert report.flags == () and "legacy default stream" in report.graph_error, source
    for source in flagged:
        report = with_hold(_profiled(), half, ClockWatch(None), "", source)
        assert [f.split(":", 1)[0] for f in report.flags] == [GRAPH_MISMATCH], source


def test_hold_lines_state_the_clocks() -> None:
    """kf eval's profile states the clocks' range beside the figures."""
    watch = ClockWatch(_Scripted([HIGH, LOW, HIGH, HIGH]))  # type: ignore[arg-type]
    watch.timed(lambda: None)
    report = with_hold(_profiled(), None, watch, "")
    assert report.clocks["retimed"] == 1 and report.method == "events"
    assert _hold_lines(report) == [
        "  clocks: SM 1200-1980 MHz, memory 3201-3201 MHz, 40-41 °C "
        "(4 readings, scripted; 1 timing(s) retimed)"
    ]
