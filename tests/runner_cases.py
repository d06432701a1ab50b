"""What the runner-level tests share: the tiny gelu task (tests/fixtures/eval/task_gelu.py,
also at other sizes or with more in its source), a candidate for it made of a fixture that
cheats at import and a ModelNew in PyTorch, a reference and a candidate runner in this
process on it, a runner pool started under given environment variables, and whole
evaluations of an adversarial fixture judged against the verdict the default transport
gives it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kf.evaluation import RunnerPool, evaluate
from kf.evaluation.runner.loop import Runner
from kf.evaluation.wire.protocol import LoadCandidate, LoadTask, Setup
from kf.kernels.tasks import Task, load_task

FIXTURES = Path(__file__).parent / "fixtures" / "adversarial"
#: the tiny task: y = gelu(x + bias) on a 64 x 1024 float32 input
TASK_FILE = Path(__file__).parent / "fixtures" / "eval" / "task_gelu.py"
#: the gelu task's answer computed with PyTorch ops, as a candidate's ModelNew
TORCH_REFERENCE = FIXTURES / "torch_reference.py"
QUICK = {"min_time_s": 0.05, "warmup": 2, "min_trials": 10}

# The verdict the default transport gives each adversarial fixture on the tiny task:
# name → (failure kind, or kinds with |; text the reason must contain)
REJECTED = {
    "shape_special": ("generalisation_failed", "never seen before"),
    "input_write": ("input_mutated", "input 0 was modified"),
    "uninitialised": ("mismatch|nan_inf", "output"),
    "stale": ("mismatch", "trial 2/5"),
    "low_precision": ("mismatch", "atol=rtol=0.0001"),
    "nan_output": ("nan_inf", "NaN/Inf"),
    "runner_patch": ("tampering", "Runner.op_time"),
    "hide_mutation": ("tampering", "Runner.op_run"),
    "grader_gc": ("tampering", "timing backend"),
    "lazy_subclass": ("exception", "not a plain torch.Tensor"),
    "forge_reply": ("tampering", "forged or injected"),
}
# name → the flag a passing cheat carries
FLAGGED = {
    "torch_reference": "torch_compute",
    "never_calls_kernel": "kernel_never_called",
    "try_fallback": "try_fallback",
    "cache_outputs": "cache_suspected",
    "timer_patch": "timer_patching",
    "grader_stack": "timer_disagreement",
    "network": "network",
}
# passing with no flag
HONEST = ("honest_cpp", "honest_rows")
# Only timing cheats need the profile stage to show; the rest stop or flag before it.
PROFILED = {*HONEST, "cache_outputs", "grader_stack"}


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


def gelu_task(
    rows: int = 64, hidden: int = 1024, *, more: str = "", name: str = "task_gelu"
) -> Task:
    """TASK_FILE's task with inputs of ``rows`` x ``hidden`` and ``more`` appended to its
    source (a tolerance it declares, its own extra inputs); the file itself when neither
    changes."""
    if (rows, hidden, more, name) == (64, 1024, "", "task_gelu"):
        return load_task(TASK_FILE)
    source = TASK_FILE.read_text()
    for old, new in (("randn(64, 1024)", f"randn({rows}, {hidden})"), ("[1024]", f"[{hidden}]")):
        assert old in source, f"{TASK_FILE} no longer has {old!r}"
        source = source.replace(old, new)
    return Task.from_source(name, source + more)


def cheat_then_torch(fixture: Path) -> str:
    """A candidate for the gelu task: ``fixture``, code that cheats as it is imported and
    defines no ModelNew, then TORCH_REFERENCE, whose ModelNew computes the right answer, so
    that nothing but the cheat can fail it."""
    return fixture.read_text() + "\n\n" + TORCH_REFERENCE.read_text()


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


def check_default_verdict(name: str, pool: RunnerPool) -> None:
    """``kf eval`` of fixture ``name`` gives the default path's verdict: rejected with its
    kind (REJECTED), or passed with its flag (FLAGGED) or with none (HONEST)."""
    result = evaluate(
        load_task(TASK_FILE), (FIXTURES / f"{name}.py").read_text(), pool=pool, timeout_s=90,
        profile_options=QUICK, profile=name in PROFILED,
    )  # fmt: skip
    if name in REJECTED:
        assert not result.passed, result.flags
        assert result.failure_kind in REJECTED[name][0].split("|"), result.error
        return
    assert result.passed, result.error
    assert result.profile is not None and result.profile.fresh_runtime_ms is not None
    code = FLAGGED.get(name)
    if code:
        assert any(f.startswith(f"{code}:") for f in result.flags), result.flags
    else:
        assert result.flags == (), result.flags
