"""Timings that hold (issue 47) on a GPU: the persisting-L2 state reset before every
timed call (checked by reading it back, not by timing), a µs kernel timed by both
methods with the clocks read around it, and the capture-aware cheat."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import pytest
import torch

from kf.evaluation import evaluate
from kf.evaluation.runner.device import CUDABackend
from kf.evaluation.runner.device_state import PolicyWindow, _AttributeValue
from tests.runner_cases import gelu_task

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FIXTURES = Path(__file__).parent / "fixtures"
QUICK = {"min_time_s": 0.05, "warmup": 2, "min_trials": 10}


def test_device_state_reset_clears_a_persisting_window() -> None:
    """A set-aside and an access-policy window left on the timing stream (as a cheat's
    call leaves them) read back as none after the backend's reset before a sample, and
    the reset says what it found."""
    backend = CUDABackend("cuda:0", time.perf_counter_ns)
    assert backend.state is not None, backend.state_error
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
    assert lib.cuCtxSetLimit(0x06, 1 << 20) == 0
    x = torch.randn(1 << 18, device="cuda:0")
    value = _AttributeValue()
    value.accessPolicyWindow = PolicyWindow(x.data_ptr(), x.numel() * 4, 1.0, 2, 1)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    window_set = lib.cuStreamSetAttribute(stream, 1, ctypes.byref(value)) == 0
    assert backend.state.set_aside() > 0
    backend.flush_cache()
    assert backend.state.set_aside() == 0
    assert "persisting-L2 set-aside" in backend.found
    if window_set:  # the driver may refuse a window on the legacy default stream
        assert backend.state.window_bytes() == 0
        assert "access-policy window" in backend.found


def test_persisting_l2_cheat_is_reset_and_flagged() -> None:
    """A CUDA candidate that marks its input persisting in L2 is correct, its state is
    reset before each timed call and the profile says so (device_state_left)."""
    source = (FIXTURES / "adversarial" / "persisting_l2.py").read_text()
    result = evaluate(gelu_task(), source, device="cuda:0", profile_options=QUICK)
    assert result.passed, result.error
    assert result.profile is not None
    assert "persisting-L2 set-aside" in result.profile.device_state_found
    assert any(f.startswith("device_state_left:") for f in result.flags)


def _on_torchs_stream(source: str) -> str:
    """The fixture's kernel launched on torch's current stream (graph-safe), built
    under another name."""
    launch = "<<<(n + 255) / 256, 256>>>("
    assert launch in source
    source = source.replace(
        launch, "<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>("
    )
    source = source.replace(
        "#include <torch/extension.h>",
        "#include <torch/extension.h>\n#include <ATen/cuda/CUDAContext.h>",
    )
    return source.replace('name="gelu_bias_attr"', 'name="gelu_bias_on_stream"')


def test_microsecond_kernel_timed_by_both_methods_with_clocks() -> None:
    """An honest µs kernel (64 x 1024 GELU in load_inline CUDA, launched on torch's
    stream) gets both figures: the graph's as the headline (method graph-N) and one call
    between events beside, with the clocks read around every timing, and no flag (the
    machine's own persisting-L2 setting is not the candidate's)."""
    source = _on_torchs_stream((FIXTURES / "honest" / "load_inline_attr.py").read_text())
    result = evaluate(gelu_task(), source, device="cuda:0", profile_options=QUICK)
    assert result.passed, result.error
    p = result.profile
    assert p is not None
    assert p.method.startswith("graph-"), p.graph_error
    assert p.graph_calls >= 10 and p.events_runtime_ms is not None
    assert p.runtime_ms == p.graph_runtime_ms
    assert p.clocks["readings"] > 0 and p.clocks["sm_mhz"][1] > 0
    assert result.flags == [] or all(f.startswith("unsandboxed") for f in result.flags), (
        result.flags
    )


def test_legacy_stream_kernel_is_timed_call_by_call_unflagged() -> None:
    """KernelBench's idiom, a launch with no stream (not captured by a graph on torch's
    stream), keeps the per-call figure, says why, and is not flagged."""
    source = (FIXTURES / "honest" / "load_inline_attr.py").read_text()
    result = evaluate(gelu_task(), source, device="cuda:0", profile_options=QUICK)
    assert result.passed, result.error
    p = result.profile
    assert p is not None and p.method == "events"
    assert "legacy default stream" in p.graph_error, p.graph_error
    assert not [f for f in result.flags if not f.startswith("unsandboxed")], result.flags


def test_graph_aware_cheat_loses_its_graph_figure() -> None:
    """A candidate that does nothing while captured is caught by the graph's check on
    other inputs: flagged graph_mismatch, its headline the per-call figure."""
    source = (FIXTURES / "adversarial" / "graph_aware.py").read_text()
    result = evaluate(gelu_task(), source, device="cuda:0", profile_options=QUICK)
    assert result.profile is not None and result.profile.ok, result.error
    assert result.profile.method == "events"
    assert any(f.startswith("graph_mismatch:") for f in result.flags)
