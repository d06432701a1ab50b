"""One candidate, one runner: the boxed runner that built a candidate verifies it, and
that one profiles it (:attr:`GradingSession.candidate_key`), saving two runner start-ups
a candidate; never a runner another candidate ran in, and never one a stage failed in.

Real boxed runners of a pool of their own, the tiny gelu task and the adversarial
fixtures' honest and cheating C++ kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kf.evaluation import Limits, RunnerPool, evaluate
from kf.evaluation.grader import sandbox
from kf.evaluation.grader.compiling import compile_session
from kf.evaluation.grader.profiling import Timing, profile_session
from kf.evaluation.grader.sandbox import RunnerHandle
from kf.evaluation.grader.session import GradingSession
from kf.evaluation.grader.verifying import verify_session
from kf.kernels.tasks import load_task
from tests.runner_cases import FIXTURES, gelu_task

ROOT = Path(__file__).resolve().parent.parent

TASK = gelu_task()
QUICK = Timing(warmup=2, min_trials=10, min_time_s=0.05)

#: a correct kernel that spins the CPU in every call after the first (the verification's
#: CPU limit must stop it in a runner kept from the build)
SPINNER = """
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(0.1 * torch.randn(hidden))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        n = 0
        while self.calls > 1 and n >= 0:
            n += 1
        return torch.nn.functional.gelu(x + self.bias)
"""


@pytest.fixture(scope="module")
def pool() -> Iterator[RunnerPool]:
    runners = RunnerPool(size=1, threads=1, kept=4)
    yield runners
    runners.close()


def kept(pool: RunnerPool) -> dict[str, RunnerHandle]:
    return {key: handle for key, (handle, _) in pool._kept.items()}


def kept_pids(pool: RunnerPool) -> dict[str, int]:
    return {key: handle.pid for key, handle in kept(pool).items()}


def session(pool: RunnerPool, name: str, key: str | None, **kw: object) -> GradingSession:
    source = (FIXTURES / f"{name}.py").read_text() if name != "spinner" else SPINNER
    return GradingSession(TASK, source, pool=pool, timeout_s=90, candidate_key=key, **kw)  # type: ignore[arg-type]


def test_a_candidate_is_built_verified_and_profiled_in_one_runner(pool: RunnerPool) -> None:
    """The build's runner is kept under the candidate's key, the verification takes it
    (and says so in its phases) and keeps it for the profile, which takes it and lets it
    go: the same process throughout, and the verdicts of fresh runners."""
    s = session(pool, "honest_cpp", "cand-1")
    assert compile_session(s).ok
    (built,) = kept_pids(pool).values()
    verified = verify_session(s)
    assert verified.correct, verified.error
    assert "kept_runner_wait" in verified.phases
    assert list(kept_pids(pool).values()) == [built]
    profiled = profile_session(s, QUICK)
    assert profiled.ok and profiled.speedup > 0, profiled.error
    assert "kept_runner_wait" in profiled.phases
    assert kept_pids(pool) == {}  # the profile is the last stage: nothing kept
    fresh = verify_session(dataclasses.replace(s, candidate_key=None))
    assert fresh.correct and "kept_runner_wait" not in fresh.phases


def test_kf_eval_keeps_nothing_past_its_last_stage(pool: RunnerPool) -> None:
    """``kf eval`` (:func:`evaluate`) verifies in its build's runner; asked for no
    profile, it lets the runner its verification kept go when it returns."""
    source = (FIXTURES / "honest_cpp.py").read_text()
    result = evaluate(TASK, source, pool=pool, timeout_s=90, profile=False)
    assert result.passed and result.verify is not None, result.error
    assert "kept_runner_wait" in result.verify.phases
    assert kept(pool) == {}


def test_another_candidate_never_gets_a_kept_runner(pool: RunnerPool) -> None:
    """A runner kept for one candidate is not leased to another (another key, or the same
    key with other source): that one gets a fresh runner, and the kept one stays kept."""
    mine = session(pool, "honest_cpp", "cand-2")
    assert compile_session(mine).ok
    before = kept_pids(pool)
    other = session(pool, "honest_rows", "cand-3")
    same_key_other_source = session(pool, "honest_rows", "cand-2")
    for s in (other, same_key_other_source):
        report = verify_session(s)
        assert report.correct and "kept_runner_wait" not in report.phases, report.phases
    after = kept_pids(pool)
    assert set(before.items()) <= set(after.items()) and len(after) == 3, after
    for key in list(after):
        pool.drop_kept(key)
    assert kept(pool) == {}


def test_a_stage_that_rejects_keeps_no_runner(pool: RunnerPool) -> None:
    """A candidate rejected by its verification (here: wrong on a shape it never saw)
    leaves nothing kept, and its runner is gone."""
    s = session(pool, "shape_special", "cand-4")
    assert compile_session(s).ok
    (built,) = kept(pool).values()
    report = verify_session(s)
    assert report.failure_kind == "generalisation_failed", report.error
    assert kept(pool) == {}
    assert built.closed and built.proc.poll() is not None


def test_a_kept_runner_is_held_to_its_stages_cpu_limit(pool: RunnerPool) -> None:
    """The verification's CPU limit applies in the runner kept from the build: a
    candidate that spins in its second call is stopped by SIGXCPU, as in a fresh one."""
    s = session(pool, "spinner", "cand-5", limits=Limits(cpu_s=3))
    assert compile_session(s).ok
    assert len(kept(pool)) == 1
    report = verify_session(s)
    assert not report.correct and report.failure_kind == "crash", report.error
    assert "SIGXCPU" in (report.error or ""), report.error
    assert "kept_runner_wait" in report.phases
    assert kept(pool) == {}


def fail_in_lease(pool: RunnerPool, key: str, expected: RunnerHandle) -> None:
    with pool.lease(key) as handle:
        assert handle is expected  # taken again by its own key
        handle.keep_as = key
        raise RuntimeError("a stage that fails keeps nothing")


def test_a_full_pool_keeps_its_oldest_and_a_failed_block_keeps_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool keeps at most ``kept`` runners (``$KF_KEPT_RUNNERS``): when full, a new one
    is killed, not the oldest (the stages take candidates about in the order they came),
    unless the oldest was kept past ``KEPT_MAX_AGE_S``; a block that raises keeps
    nothing, and a kept runner dropped is killed."""
    pool = RunnerPool(size=0, threads=1, kept=2)
    try:
        handles = []
        for key in ("a", "b", "c"):
            with pool.lease(key) as handle:
                handle.keep_as = key
            handles.append(handle)
        assert kept_pids(pool) == {"a": handles[0].pid, "b": handles[1].pid}
        assert handles[2].closed and handles[2].proc.poll() is not None
        with pytest.raises(RuntimeError):
            fail_in_lease(pool, "b", handles[1])
        assert handles[1].closed and kept_pids(pool) == {"a": handles[0].pid}
        with pool.lease("d") as handle:
            handle.keep_as = "d"
        monkeypatch.setattr(sandbox, "KEPT_MAX_AGE_S", 0.0)
        with pool.lease("e") as late:
            late.keep_as = "e"  # the two kept are past their age now: they go, it stays
        assert kept_pids(pool) == {"e": late.pid} and handles[0].closed and handle.closed
        pool.drop_kept("e")
        assert late.closed and kept(pool) == {}
    finally:
        pool.close()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs an NVIDIA GPU and a CUDA build of PyTorch (CI has neither)",
)
def test_a_cuda_candidate_is_built_verified_and_profiled_in_one_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU: a ``load_inline`` CUDA kernel, its extension imported again in the kept
    runner at each stage, verifies and profiles as in fresh runners; with
    ``$KF_KEPT_RUNNERS=0`` nothing is kept. (The task's stages peak at about 8 GB on an
    H200, over ``$KF_BIG_TASK_MB``'s 2 GB, above which nothing is kept: raised here.)"""
    monkeypatch.setenv("KF_KEPT_RUNNERS", "4")
    monkeypatch.setenv("KF_BIG_TASK_MB", "65536")
    task = load_task(ROOT / "examples" / "cuda_tasks" / "gelu_residual.py")
    source = (ROOT / "examples" / "cuda_candidates" / "gelu_residual_load_inline.py").read_text()
    pool = RunnerPool(size=1, warm="cuda:0")
    try:
        s = GradingSession(task, source, device="cuda:0", pool=pool, candidate_key="gpu-1")
        assert compile_session(s).ok
        assert len(kept(pool)) == 1
        verified = verify_session(s)
        assert verified.correct and "kept_runner_wait" in verified.phases, verified.error
        profiled = profile_session(s, QUICK)
        assert profiled.ok and "kept_runner_wait" in profiled.phases, profiled.error
        fresh = profile_session(dataclasses.replace(s, candidate_key=None), QUICK)
        assert fresh.ok and "kept_runner_wait" not in fresh.phases, fresh.error
    finally:
        pool.close()
    monkeypatch.setenv("KF_KEPT_RUNNERS", "0")
    pool = RunnerPool(size=1, warm="cuda:0")
    try:
        off = GradingSession(task, source, device="cuda:0", pool=pool, candidate_key="gpu-2")
        assert compile_session(off).ok and kept(pool) == {}
    finally:
        pool.close()
