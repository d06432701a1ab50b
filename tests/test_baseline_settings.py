"""The run's measuring conditions: the torch.compile mode (max-autotune as an option) and TF32
set explicitly in every runner from the grader's messages (never the runner's environment),
recorded in each profile as the reference runner stated them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kf.config import RunConfig
from kf.evaluation.grader import baseline_settings as bs
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.runner import baselines
from kf.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
EVAL = ROOT / "tests" / "fixtures" / "eval"
FAST: dict[str, Any] = {"min_time_s": 0.05, "min_trials": 5, "warmup": 2}


def test_conditions_from_settings_and_from_the_run_config() -> None:
    """The conditions a run starts with come from its settings (errors name the variable);
    the run's config records them and gives them back, an older log's missing keys the
    defaults."""
    default = Conditions.from_settings(Settings.from_env({}))
    assert default == Conditions()
    assert (default.compile_mode, default.tf32) == ("default", "off") and default.compile_baseline
    asked = Conditions.from_settings(
        Settings.from_env(
            {
                "KF_COMPILE_MODE": "max-autotune",
                "KF_TF32": "ON",
                "KF_COMPILE_BASELINE": "off",
                "KF_DEVICE_INPUTS": "0",
            }
        )
    )
    assert asked == Conditions(
        compile_baseline=False, compile_mode="max-autotune", tf32="on", device_inputs=False
    )
    assert Conditions.of(RunConfig.decode(asked.config())) == asked
    older = Conditions.of(RunConfig.decode({"compile_mode": "max-autotune"}))  # before the rest
    assert older == Conditions(compile_mode="max-autotune")
    assert Conditions().differences(asked) == [
        "compile_baseline True in the log, False now",
        "compile_mode 'default' in the log, 'max-autotune' now",
        "tf32 'off' in the log, 'on' now",
        "device_inputs True in the log, False now",
    ]
    assert baselines.compile_kwargs("max-autotune") == {
        "backend": "inductor",
        "dynamic": False,
        "mode": "max-autotune",
    }
    assert "mode" not in baselines.compile_kwargs("default")  # as plain torch.compile(model)
    with pytest.raises(bs.BaselineSettingError, match=r"\$KF_COMPILE_MODE 'fastest'"):
        Conditions.from_settings(Settings.from_env({"KF_COMPILE_MODE": "fastest"}))
    with pytest.raises(
        bs.BaselineSettingError, match=r"\$KF_TF32 'maybe': expected one of off, on$"
    ):
        Conditions.from_settings(Settings.from_env({"KF_TF32": "maybe"}))
    with pytest.raises(bs.BaselineSettingError, match="tf32 'maybe'"):
        Conditions.of(RunConfig.decode({"tf32": "maybe"}))  # a config kf did not write


# A task that shows, in the shape of its input, what its runner's environment says of TF32
# and what the runner applied: (2 if $KF_TF32 is on else 1, 2 if matmul TF32 is on else 1).
WITNESS = """
import os

import torch
from torch import nn


class Model(nn.Module):
    def forward(self, x):
        return x


def get_inputs():
    told = os.environ.get("KF_TF32") == "on"
    return [torch.zeros(1 + told, 1 + torch.backends.cuda.matmul.allow_tf32)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize(("env", "tf32"), [("on", "off"), ("off", "on")])
def test_runner_computes_under_the_sessions_tf32_not_its_environments(
    env: str, tf32: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner started with $KF_TF32 saying one thing (and the grader's own environment
    too) computes under the TF32 its set-up message carries, from the session's
    conditions, and says so in its answer."""
    from kf.evaluation import RunnerPool
    from kf.evaluation.grader.session import GradingSession, Stage
    from kf.evaluation.wire.protocol import MakeInputs
    from kf.kernels.tasks import Task

    monkeypatch.setenv("KF_TF32", env)
    monkeypatch.setenv("KF_SANDBOX_ENV", "KF_TF32")  # a boxed runner gets it too
    pool = RunnerPool(size=1)
    try:
        task = Task.from_source("witness", WITNESS)
        session = GradingSession(task, pool=pool, conditions=Conditions(tf32=tf32))
        stage = Stage(session)
        with pool.reference_lease(session.reference_key) as ref:
            stage.use(ref=ref)
            setup = stage.setup_reference()
            stage.load_task(seed=0)
            made = stage.reference(MakeInputs(seed=0))
    finally:
        pool.close()
    assert setup.precision is not None
    assert setup.precision["tf32"] == tf32
    assert setup.precision["matmul_allow_tf32"] is (tf32 == "on")
    told, applied = made.input_shapes[0]
    assert told == (2 if env == "on" else 1)  # the environment did say the contrary
    assert applied == (2 if tf32 == "on" else 1)


def test_tf32_is_set_explicitly_and_read_back() -> None:
    """PyTorch starts mixed (matmul off, cuDNN on); ``off`` turns both off, ``on`` both on."""
    before = baselines.read_tf32(torch)
    try:
        assert baselines.apply_tf32(torch, "off") == {
            "tf32": "off",
            "matmul_allow_tf32": False,
            "cudnn_allow_tf32": False,
            "float32_matmul_precision": "highest",
        }
        on = baselines.apply_tf32(torch, "on")
        assert on["matmul_allow_tf32"] and on["cudnn_allow_tf32"]
        assert on["float32_matmul_precision"] == "high"
        assert baselines.apply_tf32(torch, None)["tf32"] == "pytorch-default"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before["matmul_allow_tf32"]
        torch.backends.cudnn.allow_tf32 = before["cudnn_allow_tf32"]
        torch.set_float32_matmul_precision(before["float32_matmul_precision"])


def test_profile_records_the_settings_the_runners_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile under the conditions TF32 on and compile mode max-autotune records both as
    the reference runner stated them, whatever the environment says; the compiled baseline
    is described with its mode. Without conditions, a library call takes the process's."""
    from kf.evaluation import RunnerPool, profile_candidate
    from kf.kernels.tasks import load_task

    monkeypatch.setenv("KF_COMPILE_BASELINE", "0")
    monkeypatch.setenv("KF_TF32", "off")
    monkeypatch.setenv("KF_COMPILE_MODE", "reduce-overhead")
    pool = RunnerPool(size=1)
    try:
        task = load_task(EVAL / "task_gelu.py")
        source = (EVAL / "honest.py").read_text()
        run = Conditions(compile_baseline=True, compile_mode="max-autotune", tf32="on")
        report = profile_candidate(task, source, pool=pool, conditions=run, **FAST)
        assert report.ok, report.error
        assert report.tf32 == "on"
        assert report.compile_baseline_error is None, report.compile_baseline_error
        assert report.compile_mode == "max-autotune"
        assert "mode max-autotune" in report.compile_baseline
        off = profile_candidate(task, source, pool=pool, **FAST)
        assert off.ok and off.tf32 == "off" and off.compile_mode == ""
    finally:
        pool.close()


def test_a_resumed_run_grades_under_its_recorded_conditions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that folds a run's log (a resumed run's, a ``kf worker``'s) profiles under
    the conditions the run recorded when it started, though its environment now asks for
    others."""
    from agents.profiler import Profiler, ProfilerState
    from kf.agent import AgentContext
    from kf.events import make_envelope
    from kf.facts import RunStarted, TaskSpec
    from kf.fold import fold
    from kf.kernels.tasks import load_task
    from kf.log import EventLog
    from kf.search_facts import CandidateProposed

    task = load_task(EVAL / "task_gelu.py")
    source = (EVAL / "honest.py").read_text()
    recorded = Conditions(compile_baseline=False, tf32="on")
    events = [
        RunStarted(
            run_id="r1",
            seed=0,
            config={"device": "cpu", "budget": 1, **recorded.config()},
            tasks=(TaskSpec(name=task.name, source=task.source, sha256=task.sha256),),
        ),
        CandidateProposed(
            candidate_id="c1", task=task.name, source=source, operator="seed", mutator="test"
        ),
    ]
    db = tmp_path / "run.db"
    with EventLog(db) as elog:
        elog.append([make_envelope(e, run_id="r1", source="test") for e in events])
    # the environment now: TF32 off, and a compiled baseline in another mode
    monkeypatch.setenv("KF_TF32", "off")
    monkeypatch.setenv("KF_COMPILE_BASELINE", "1")
    monkeypatch.setenv("KF_COMPILE_MODE", "reduce-overhead")
    agent = Profiler(AgentContext(run_id="r1", agent_id="profiler@t", options={"device": "cpu"}))
    with EventLog(db, readonly=True) as elog:
        state = fold(elog.read(), agent)
    assert isinstance(state, ProfilerState)
    assert state.conditions == recorded
    report = agent._profile(state, state.tasks[task.name], "c1", source)
    assert report.ok, report.error
    assert report.tf32 == "on"  # as the runners applied it
    assert report.compile_mode == "" and report.compiled_runtime_ms is None
    assert "turned off" in (report.compile_baseline_error or "")


def test_a_bad_condition_is_one_line_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``$KF_TF32=maybe`` refuses ``kf run`` (no log written) and ``kf eval`` with one line
    naming the variable."""
    from kf.app import RunRequest, prepare_run
    from kf.app.request import RunRefused
    from kf.evaluation.grader.cli import main

    monkeypatch.setenv("KF_TF32", "maybe")
    db = tmp_path / "run.db"
    with pytest.raises(RunRefused, match=r"^\$KF_TF32 'maybe': expected one of off, on$"):
        prepare_run(RunRequest(tasks=EVAL / "task_gelu.py", db=db))
    assert not db.exists()
    assert main([str(EVAL / "task_gelu.py"), str(EVAL / "honest.py")]) == 2
    assert capsys.readouterr().err.strip() == "kf eval: $KF_TF32 'maybe': expected one of off, on"
