"""Candidate evaluation: compile, verify and profile in sandboxed runners, and the pool."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kf.evaluation import (
    DeviceError,
    RunnerPool,
    compile_candidate,
    parse_device,
    profile_candidate,
    verify_candidate,
)
from kf.evaluation.grader.grading import TIMER_DISAGREEMENT
from kf.evaluation.grader.sandbox import REQUESTS
from kf.evaluation.grader.timing_checks import cross_check_flags, timing_stats
from kf.evaluation.runner.compare import compare_inputs, compare_outputs
from kf.evaluation.wire.protocol import LoadTask, MakeInputs, Ping, Pong, Setup
from kf.kernels.tasks import TaskError, load_task
from tests.runner_cases import cheat_then_torch

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
TASK = load_task(FIXTURES / "task_gelu.py")


def candidate(name: str) -> str:
    return (FIXTURES / f"{name}.py").read_text()


def test_honest_candidate_passes_every_stage(pool: RunnerPool) -> None:
    """An honest C++ candidate compiles, verifies on 5 trials and gets a positive speedup."""
    source = candidate("honest")
    compiled = compile_candidate(TASK, source, pool=pool)
    assert compiled.ok, compiled.error
    since = time.monotonic()
    verified = verify_candidate(TASK, source, pool=pool)
    assert verified.correct, verified.error
    assert verified.trials == 5
    # the request log saw every runner request of the stage, timed on both sides
    done = [r for r in REQUESTS if r.ended >= since]
    assert [r.op for r in done].count("run") > 5  # trials, then the generalisation gate
    assert {"setup", "load_task", "load_candidate", "make_inputs", "check"} <= {r.op for r in done}
    assert all(0 < r.runner_s <= r.wall_s for r in done if r.op != "lease_wait")
    # ... and the report says where the stage's time went, per request op
    assert compiled.phases.get("load_candidate", 0) > 0
    assert verified.phases["run"] > 0 and verified.phases["check"] > 0
    assert sum(verified.phases.values()) <= verified.duration_s + verified.phases.get(
        "lease_wait", 0.0
    )
    assert len(verified.evidence) == 5
    assert all(e.ok for e in verified.evidence)
    assert len({e.seed for e in verified.evidence}) == 5
    assert verified.max_abs_err < 1e-4
    profiled = profile_candidate(TASK, source, pool=pool, warmup=2, min_trials=20, min_time_s=0.05)
    assert profiled.ok, profiled.error
    assert profiled.trials >= 20
    assert profiled.ref_trials >= 20
    assert profiled.speedup > 0
    assert profiled.runtime_ms > 0
    assert profiled.ref_runtime_ms > 0
    assert profiled.runtime_min_ms <= profiled.runtime_median_ms
    assert profiled.outside_wall_ms is not None
    assert "perf_counter_ns" in profiled.timer
    assert profiled.phases["time"] > 0 and "setup" in profiled.phases
    # the timing turn: waited for (nothing else held the device here) and held while timing
    assert profiled.phases["turn_held"] >= profiled.phases["time"] > 0
    assert 0 <= profiled.phases["turn_wait"] < profiled.phases["turn_held"]
    # a CPU's figure is one call per sample (issue 47): no graph, no clocks, no state left
    assert profiled.method == "events" and profiled.graph_calls == 0
    assert profiled.clocks == {} and profiled.device_state_found == ""


@pytest.mark.parametrize(
    ("name", "kind", "reason"),
    [
        ("wrong", "mismatch", "outside atol=rtol=0.0001"),
        ("nan", "nan_inf", "NaN/Inf"),
        ("wrong_shape", "shape_mismatch", "shape [64, 512], expected [64, 1024]"),
        ("mutating", "input_mutated", "input 0 was modified"),
        ("segfault", "crash", "SIGSEGV"),
    ],
)
def test_verify_rejects_bad_candidate_with_kind(
    pool: RunnerPool, name: str, kind: str, reason: str
) -> None:
    """Each kind of bad candidate is rejected with the matching failure_kind and a clear error."""
    report = verify_candidate(TASK, candidate(name), pool=pool)
    assert not report.correct
    assert report.failure_kind == kind
    assert report.error is not None
    assert reason in report.error


def test_verify_hanging_candidate_times_out(pool: RunnerPool) -> None:
    """A forward that never returns is killed at the timeout and reported as 'timeout'."""
    report = verify_candidate(TASK, candidate("hang"), pool=pool, timeout_s=3)
    assert not report.correct
    assert report.failure_kind == "timeout"


def test_verify_passes_after_a_crash(pool: RunnerPool) -> None:
    """A candidate that segfaults does not stop the next candidate from passing."""
    crashed = verify_candidate(TASK, candidate("segfault"), pool=pool)
    assert crashed.failure_kind == "crash"
    assert verify_candidate(TASK, candidate("honest"), pool=pool).correct


def test_verify_is_thread_safe_and_isolates_crashes(pool: RunnerPool) -> None:
    """Two verifications in parallel threads share the pool; one crashing spoils neither."""
    with ThreadPoolExecutor(max_workers=2) as executor:
        crashed = executor.submit(verify_candidate, TASK, candidate("segfault"), pool=pool)
        honest = executor.submit(verify_candidate, TASK, candidate("honest"), pool=pool)
        assert crashed.result().failure_kind == "crash"
        assert honest.result().correct


def test_profile_clock_tampering_does_not_stop_the_timer(pool: RunnerPool) -> None:
    """A candidate that patches time.perf_counter_ns at import cannot zero its own timings."""
    cheat = cheat_then_torch(FIXTURES / "clock_tamper.py")
    report = profile_candidate(TASK, cheat, pool=pool, warmup=1, min_trials=5, min_time_s=0.01)
    assert report.ok, report.error
    assert report.runtime_min_ms > 0


def test_compile_error_reports_compiler_log(pool: RunnerPool) -> None:
    """C++ that does not compile gives ok=False, kind compile_error and the compiler's log."""
    report = compile_candidate(TASK, candidate("compile_error"), pool=pool)
    assert not report.ok
    assert report.failure_kind == "compile_error"
    assert "undeclared_name" in report.log


def test_compile_without_model_new_says_so(pool: RunnerPool) -> None:
    """A candidate that defines no ModelNew fails to compile with a message saying so."""
    report = compile_candidate(TASK, candidate("no_model_new"), pool=pool)
    assert not report.ok
    assert report.error == "the candidate defines no class ModelNew"


def test_verify_broken_task_raises_task_error(pool: RunnerPool) -> None:
    """A task whose import fails is the task's fault: TaskError, not a rejected candidate."""
    broken = load_task(FIXTURES / "broken_task.py")
    with pytest.raises(TaskError, match=r"broken_task\.py: .*ModuleNotFoundError"):
        verify_candidate(broken, candidate("honest"), pool=pool)


def test_pool_close_kills_every_runner() -> None:
    """Closing a pool kills its idle and leased runners and refuses new leases."""
    runners = RunnerPool(size=1, threads=1)
    leased = runners.acquire()
    idle = list(runners._idle)
    runners.close()
    for handle in [leased, *idle]:
        assert handle.proc.poll() is not None
    with pytest.raises(RuntimeError, match="closed"):
        runners.acquire()


def test_parse_device_rejects_unavailable_devices() -> None:
    """Only 'cpu' is accepted for now; CUDA and unknown devices get a clear DeviceError."""
    assert parse_device("CPU") == "cpu"
    with pytest.raises(DeviceError, match="only 'cpu' is implemented"):
        parse_device("cuda:0")
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        parse_device("tpu")


def test_cross_check_flags_large_disagreement_only() -> None:
    """Timers agreeing within 1.5x raise no flag; a 3x disagreement is flagged."""
    assert cross_check_flags(1.0, 1.2) == ()
    assert cross_check_flags(1.0, 3.0) == (TIMER_DISAGREEMENT,)
    assert cross_check_flags(3.0, 1.0) == (TIMER_DISAGREEMENT,)
    assert cross_check_flags(0.001, 0.004) == ()  # below the absolute gap: overhead, not cheating


def test_timing_stats_summarises_samples() -> None:
    """Mean, median, min and a confidence half width come out of the samples."""
    stats = timing_stats([1.0, 2.0, 3.0, 4.0])
    assert stats["mean"] == 2.5
    assert stats["median"] == 2.5
    assert stats["min"] == 1.0
    assert stats["ci95"] > 0


def test_compare_outputs_flags_dtype_and_tolerance() -> None:
    """Comparison reports a dtype mismatch, and accepts half-precision error within 1e-2."""
    ref = [torch.ones(4)]
    assert compare_outputs(torch, ref, [torch.ones(4, dtype=torch.float64)])["kind"] == (
        "dtype_mismatch"
    )
    half = [torch.ones(4, dtype=torch.float16)]
    assert compare_outputs(torch, half, [half[0] + 0.005])["ok"]
    assert not compare_outputs(torch, ref, [ref[0] + 0.005])["ok"]


def test_compare_inputs_detects_change() -> None:
    """An input that differs after the call is reported; an identical one is not."""
    x = torch.arange(4.0)
    assert compare_inputs(torch, [x], [x.clone()]) is None
    assert compare_inputs(torch, [x], [x + 1]) == "input 0 was modified by the candidate's forward"


def test_reused_reference_keeps_the_inputs_it_made(pool: RunnerPool) -> None:
    """A reference runner serving a second candidate answers a repeated seed from what it
    made, with the same inputs; a model built from another seed makes its own."""
    from kf.evaluation.grader.baseline_settings import Conditions
    from kf.evaluation.grader.grading import Deadline, setup_request
    from kf.evaluation.grader.sandbox import Limits
    from kf.settings import Settings

    deadline = Deadline(60)
    with pool.reference_lease("test-reuse") as ref:
        setup = setup_request(
            ref, "cpu", Limits(), deadline, Conditions(), Settings(), reference=True
        )
        ref.request(setup, 30)
        ref.request(LoadTask(source=TASK.source, name=TASK.name, seed=0), 30)
        first = ref.request(MakeInputs(seed=7), 30)
        again = ref.request(MakeInputs(seed=7), 30)
        other = ref.request(MakeInputs(seed=8), 30)
        assert (first.reused, again.reused, other.reused) == (False, True, False)
        assert torch.equal(_load(first.inputs)[0], _load(again.inputs)[0])
        assert not torch.equal(_load(first.inputs)[0], _load(other.inputs)[0])
        ref.request(LoadTask(source=TASK.source, name=TASK.name, seed=1), 30)
        assert ref.request(MakeInputs(seed=7), 30).reused is False


def test_reference_cache_can_be_switched_off(pool: RunnerPool) -> None:
    """``reference_cache_bytes=0`` (what candidate runners get) keeps nothing."""
    with pool.lease() as runner:
        runner.request(Setup(device="cpu", threads=1, reference_cache_bytes=0), 30)
        runner.request(LoadTask(source=TASK.source, name=TASK.name, seed=0), 30)
        runner.request(MakeInputs(seed=7), 30)
        assert runner.request(MakeInputs(seed=7), 30).reused is False


def _load(data: bytes) -> list[torch.Tensor]:
    import io

    value: list[torch.Tensor] = torch.load(io.BytesIO(data), weights_only=True)
    return value


def test_transport_round_trips_host_values_and_refuses_forged_descriptions() -> None:
    """A payload of host values comes back equal; a description naming a storage class
    PyTorch never produces, or an unknown dtype, is refused rather than rebuilt."""
    import msgspec

    from kf.evaluation.runner.transport import MAGIC, Exports, is_ipc, pack, unpack

    values = [torch.arange(6.0).reshape(2, 3), 3, "x"]
    data = pack(torch, values, Exports())
    assert is_ipc(data)
    back = unpack(torch, data)
    assert torch.equal(back[0], values[0]) and back[1:] == [3, "x"]
    forged = {
        "size": [1], "stride": [1], "offset": 0, "storage": "Evil", "dtype": "float32",
        "device": 0, "handle": b"", "nbytes": 4, "byte_offset": 0, "ref_handle": b"",
        "ref_offset": 0, "event_handle": None, "event_sync": False,
    }  # fmt: skip
    with pytest.raises(ValueError, match="storage class"):
        unpack(torch, MAGIC + msgspec.msgpack.encode([{"ipc": forged}]))
    with pytest.raises(ValueError, match="dtype"):
        unpack(
            torch,
            MAGIC
            + msgspec.msgpack.encode(
                [{"ipc": {**forged, "storage": "UntypedStorage", "dtype": "os"}}]
            ),
        )


def test_builds_run_at_lower_priority_than_grading(
    pool: RunnerPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build box's compiler runs ``$KF_BUILD_NICE`` below grading (the grader starts
    the box niced; here the "compiler" is a shell that says its niceness and fails); the
    compile stage's boxed runner itself is not niced: it is kept for the candidate's
    verification (tests/test_runner_reuse.py), and a niced runner could not be reset."""
    import os

    from kf.evaluation.grader import builds

    base = os.nice(0)
    monkeypatch.setenv("KF_BUILD_NICE", "7")
    out = builds._compile(
        "", "/bin/sh", ["-c", "echo niceness $(nice); exit 3"], tmp_path, tmp_path / "k.so", 60
    )
    assert not out["ok"] and "exited with status 3" in out["error"], out
    assert f"niceness {min(19, base + 7)}" in out["log"], out
    source = (
        "import os\nfrom torch import nn\n\n"
        "class ModelNew(nn.Module):\n"
        "    def __init__(self, *args):\n"
        "        raise RuntimeError(f'niceness {os.nice(0)}')\n"
    )
    report = compile_candidate(TASK, source, pool=pool)
    assert f"niceness {base}" in (report.error or ""), report.error


def test_warmed_runners_trace_and_verify() -> None:
    """A runner warmed at start-up (op tracer loaded before it is ready) still grades:
    the honest candidate verifies, and a candidate computing with PyTorch is flagged."""
    warmed = RunnerPool(size=1, threads=1, warm="cpu")
    try:
        verified = verify_candidate(TASK, candidate("honest"), pool=warmed)
        assert verified.correct, verified.error
        assert not [f for f in verified.flags if f.startswith("torch_compute")]
        cheat = (FIXTURES.parent / "adversarial" / "torch_reference.py").read_text()
        flagged = verify_candidate(TASK, cheat, pool=warmed)
        assert [f for f in flagged.flags if f.startswith("torch_compute")], flagged.flags
    finally:
        warmed.close()


def test_default_pool_takes_settings_made_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kf run` checks its tasks (making the process's pool) before a CUDA worker gives
    the pool its size and warm-up device; configuring applies them to that pool."""
    from kf.evaluation.grader import sandbox

    monkeypatch.delenv("KF_EVAL_POOL", raising=False)
    monkeypatch.delenv("KF_RUNNER_WARM", raising=False)
    monkeypatch.delenv("KF_KEPT_RUNNERS", raising=False)
    monkeypatch.setattr(sandbox, "_default", None)
    monkeypatch.setattr(sandbox, "_configured", None)
    first = sandbox.default_pool()
    try:
        first.start()
        assert (first.size, first.warm, first.max_kept) == (2, None, 8)
        # as kf.app.orchestra's worker does (a GPU keeps as many candidate runners as idle ones)
        sandbox.configure_default_pool(size=3, warm="cpu", kept=19)
        assert sandbox.default_pool() is first
        assert (first.size, first.warm, first.max_kept) == (3, "cpu", 19)
        sandbox.configure_default_pool(size=3, warm="cpu")
        assert first.max_kept == 19  # None: as asked before
        idle = list(first._idle)
        assert len(idle) == 3 and all(h.warm == "cpu" for h in idle)
        with first.lease() as handle:  # a runner that did its warm-up before 'ready' serves
            assert "kf runner: warmed up for cpu in" in handle.log_tail()
            assert isinstance(handle.request(Ping(), 60.0), Pong)
    finally:
        first.close()
