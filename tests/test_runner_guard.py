"""The runner's integrity guard over a runner made of roles (kf.evaluation.runner.guard).

The runner class is assembled from its roles' classes in several modules; a candidate
that replaces grading code anywhere in them (a role's method, a method shadowed on the
runner's own class, a helper function of any runner module) must be named by the guard.
The end-to-end versions, with real candidates in real runners, are in test_adversarial.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kf.evaluation.runner import candidate as runner_candidate
from kf.evaluation.runner import common as runner_common
from kf.evaluation.runner import reference as runner_reference
from kf.evaluation.runner.guard import Integrity
from kf.evaluation.runner.loop import Runner


def _empty(*_: Any) -> Any:
    return {}


@pytest.mark.parametrize(
    ("owner", "name", "named"),
    [
        (runner_candidate.CandidateRole, "op_run", "Runner.op_run"),
        (runner_reference.ReferenceRole, "_check", "Runner._check"),
        (Runner, "op_check", "Runner.op_check"),  # shadows the role's method
        (runner_common, "flatten_outputs", "kf.evaluation.runner.common.flatten_outputs"),
        (runner_common.RunnerBase, "load", "Runner.load"),
    ],
)
def test_the_guard_names_grading_code_replaced_in_any_runner_module(
    owner: Any, name: str, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = Runner(time.perf_counter_ns)
    guard = Integrity(runner, runner.clock_ns)
    assert guard.check(runner, runner.clock_ns) is None
    replacement: Callable[..., Any] = _empty
    monkeypatch.setattr(owner, name, replacement, raising=False)
    found = guard.check(runner, runner.clock_ns)
    assert found is not None and named in found, found
    monkeypatch.undo()
    assert guard.check(runner, runner.clock_ns) is None
