"""What the transport tests share (test_seed_inputs, test_shared_memory): a reference and
a candidate runner in this process on the tiny adversarial task, a runner pool started
under given environment variables, and whole evaluations of a fixture judged against the
verdict the default transport gives it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kf.evaluation import RunnerPool, evaluate
from kf.evaluation.runner.loop import Runner
from kf.evaluation.wire.protocol import LoadCandidate, LoadTask, Setup

FIXTURES = Path(__file__).parent / "fixtures" / "adversarial"
TASK_FILE = FIXTURES / "task_gelu.py"
QUICK = {"min_time_s": 0.05, "warmup": 2, "min_trials": 10}
PROFILED = ("honest_cpp", "cache_outputs")


def runner_pair(
    candidate: str, ref_setup: dict[str, Any], cand_setup: dict[str, Any]
) -> tuple[Runner, Runner]:
    """A reference runner with the task loaded and a candidate runner with ``candidate``."""
    ref, cand = Runner(time.perf_counter_ns), Runner(time.perf_counter_ns)
    ref.op_setup(Setup(device="cpu", threads=1, **ref_setup))
    cand.op_setup(Setup(device="cpu", threads=1, **cand_setup))
    source = TASK_FILE.read_text()
    init = ref.op_load_task(LoadTask(source=source, name="task_gelu", seed=3)).init
    cand.op_load_candidate(
        LoadCandidate(source=candidate, seed=3, init=init, task_source=source,
                      task_name="task_gelu")
    )  # fmt: skip
    return ref, cand


def pool_under(env: dict[str, str]) -> Iterator[RunnerPool]:
    """A started pool of two runners spawned under ``env`` (for a module fixture)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        runners = RunnerPool(size=2, threads=1)
        runners.start()
        try:
            yield runners
        finally:
            runners.close()


def check_default_verdict(
    name: str, passed: bool, kind_or_flag: str | None, pool: RunnerPool
) -> None:
    """``kf eval`` of fixture ``name`` gives the default path's verdict: passed (with
    ``kind_or_flag`` among its flags, or no flag) or failed with that kind."""
    from kf.tasks import load_task

    result = evaluate(
        load_task(TASK_FILE), (FIXTURES / f"{name}.py").read_text(), pool=pool, timeout_s=90,
        profile_options=QUICK, profile=name in PROFILED,
    )  # fmt: skip
    assert result.passed is passed, result.error
    if passed:
        assert result.profile is not None and result.profile.fresh_runtime_ms is not None
        flags = " ".join(result.flags)
        assert (kind_or_flag or "") in flags if kind_or_flag else result.flags == (), flags
    else:
        assert result.failure_kind == kind_or_flag, result.error
