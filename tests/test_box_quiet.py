"""A candidate's box is quiet while anything else is timed: a process it forks at import
to load the machine (issue 43, NK2: eager and ``torch.compile`` timed slower, the
candidate's speed-up inflated) is stopped while the baseline is timed, and a candidate
runner kept between its stages is stopped while kept.

Real boxed runners of a pool of their own and the tiny gelu task; what is asserted is the
processes' state as /proc shows it while the reference runner times, never a timing.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kf.evaluation import RunnerPool
from kf.evaluation.grader import box
from kf.evaluation.grader.compiling import compile_session
from kf.evaluation.grader.profiling import Timing, profile_session
from kf.evaluation.grader.runner_handle import RunnerHandle
from kf.evaluation.grader.session import GradingSession
from kf.evaluation.grader.verifying import verify_session
from kf.evaluation.wire.protocol import LoadCandidate, Time
from tests.runner_cases import gelu_task

needs_box = pytest.mark.skipif(box.probe() is not None, reason=f"no runner box here: {box.probe()}")

TASK = gelu_task()
QUICK = Timing(warmup=2, min_trials=10, min_time_s=0.05)
SPINNER_NAME = "kf-spinner"

ADVERSARIAL = Path(__file__).parent / "fixtures" / "adversarial"
#: the gelu seed, plus one process forked at import that spins for ever (named SPINNER_NAME)
SABOTEUR = (ADVERSARIAL / "baseline_sabotage.py").read_text()
#: the same, its process keeping the GPU busy (named SPINNER_NAME once it holds the GPU)
GPU_SABOTEUR = (ADVERSARIAL / "gpu_busy_child.py").read_text()


def _box(root: int) -> list[int]:
    """``root`` and every process below it, from each process's parent in /proc (not
    kf's own walk)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def _states(root: int) -> list[tuple[str, str]]:
    """(name, state) of every thread of every process in the box of bwrap ``root`` (the
    processes below it: bwrap itself is the host's side of the box)."""
    seen = []
    for pid in _box(root)[1:]:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            seen.append((name, rest.split()[0]))
    return seen


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[str, str]]]:
    """Each timing request to a candidate-free runner, as it is sent: the state of every
    thread of every candidate runner's box."""
    candidates: list[RunnerHandle] = []
    seen: list[list[tuple[str, str]]] = []
    real = RunnerHandle.request

    def request(self: RunnerHandle, message: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(message, LoadCandidate):
            candidates.append(self)
        elif isinstance(message, Time) and self not in candidates:
            for cand in candidates:
                if cand.proc.poll() is None:
                    seen.append(_states(cand.proc.pid))
        return real(self, message, *args, **kw)

    monkeypatch.setattr(RunnerHandle, "request", request)
    return seen


@needs_box
def test_box_quiet_spinner_forked_at_import_is_stopped_while_the_baseline_is_timed(
    watched: list[list[tuple[str, str]]],
) -> None:
    """A candidate that forks a spinning process at import is profiled; while eager and
    the empty call are timed in the reference runner, every thread of every process in
    the candidate's box, the spinner's included, is stopped (T) or gone, and the profile
    says ``busy_child``; the same candidate without its spinner has no flag. (The compiled
    reference is timed by the same request, ``Time(compiled=True)``: the GPU test below
    times it too; on this CPU its compile alone takes a minute and a half.)"""
    pool = RunnerPool(size=0, threads=1)
    try:
        session = GradingSession(TASK, SABOTEUR, pool=pool, timeout_s=90)
        report = profile_session(session, QUICK, compile_baseline=False)
        seen = len(watched)
        # the same candidate without its spinner: the runner's own processes (its file
        # maker among them) are not the candidate's
        plain = dataclasses.replace(session, source=SABOTEUR.replace("os.fork() == 0", "False"))
        honest = profile_session(plain, QUICK, compile_baseline=False)
    finally:
        pool.close()
    assert honest.ok and honest.flags == (), (honest.error, honest.flags)
    del watched[seen:]
    assert report.ok, report.error
    assert watched, "no timing of the reference was seen"
    assert any(name == SPINNER_NAME for states in watched for name, _ in states), watched
    running = [s for states in watched for s in states if s[1] not in ("T", "t", "Z", "X")]
    assert running == [], f"candidate threads not stopped while the baseline was timed: {running}"
    assert any(f.startswith("busy_child") for f in report.flags), report.flags


@needs_box
def test_box_quiet_kept_runner_is_stopped_until_its_next_stage() -> None:
    """A runner kept from the saboteur's build for its verification is stopped, spinner
    and all, while it waits; the verification takes it, runs it as before, and keeps it,
    stopped again, for the profile."""
    pool = RunnerPool(size=0, threads=1, kept=2)
    try:
        session = GradingSession(TASK, SABOTEUR, pool=pool, timeout_s=90, candidate_key="c")
        assert compile_session(session).ok
        ((built, _),) = pool._kept.values()
        states = _states(built.proc.pid)
        assert any(name == SPINNER_NAME for name, _ in states), states
        assert all(state in ("T", "t", "Z", "X") for _, state in states), states
        report = verify_session(session)
        assert report.correct and "kept_runner_wait" in report.phases, report.error
        ((kept, _),) = pool._kept.values()
        assert kept is built
        states = _states(kept.proc.pid)
        assert all(state in ("T", "t", "Z", "X") for _, state in states), states
    finally:
        pool.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@needs_box
def test_box_quiet_gpu_child_is_gone_while_the_baseline_is_timed(
    watched: list[list[tuple[str, str]]],
) -> None:
    """On a GPU: a child forked at import that keeps the device busy (its own CUDA
    context, kernels in a loop) is gone while eager and ``torch.compile`` are timed, not
    merely stopped (a stopped process's kernels already queued would still run), and the
    profile says so (``gpu_child_killed``)."""
    source = GPU_SABOTEUR
    pool = RunnerPool(size=0, threads=1, warm="cuda:0")
    try:
        session = GradingSession(TASK, source, device="cuda:0", pool=pool, timeout_s=180)
        report = profile_session(session, QUICK, compile_baseline=True)
    finally:
        pool.close()
    assert report.ok, report.error
    assert report.speedup_vs_compiled is not None, report.compile_baseline_error
    assert watched
    alive = [s for states in watched for s in states if s[0] == SPINNER_NAME and s[1] not in "ZX"]
    assert alive == [], watched  # killed (a zombie until the box's init, stopped, reaps it)
    running = [s for states in watched for s in states if s[1] not in ("T", "t", "Z", "X")]
    assert running == [], running
    assert any(f.startswith("gpu_child_killed") for f in report.flags), report.flags


#: an honest candidate that compiles its forward with torch.compile (inductor's compile
#: workers are processes the candidate started, and must not be taken for a saboteur)
COMPILED = """
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(0.1 * torch.randn(hidden))
        self.fn = torch.compile(lambda x, b: torch.nn.functional.gelu(x + b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.bias)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@needs_box
def test_box_quiet_gpu_torch_compile_candidate_is_not_taken_for_a_saboteur() -> None:
    """On a GPU: a candidate whose forward is ``torch.compile``d (inductor's compile
    workers run beside it) profiles correctly and is neither killed nor flagged
    ``gpu_child_killed`` when its box is quiet while eager is timed."""
    pool = RunnerPool(size=0, threads=1, warm="cuda:0")
    try:
        session = GradingSession(TASK, COMPILED, device="cuda:0", pool=pool, timeout_s=300)
        report = profile_session(session, QUICK, compile_baseline=False)
    finally:
        pool.close()
    assert report.ok, report.error
    assert not any(f.startswith("gpu_child_killed") for f in report.flags), report.flags
