"""The run's typed config (kf.config.RunConfig): decoded once from any kf's run.started,
written back as the flat map kf run has always recorded (issue 46)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kf.app.orchestra import RunOptions, _started
from kf.app.request import RunRequest
from kf.app.run import asked_conditions, run_config
from kf.config import RunConfig
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.wire.tolerance import Tolerance
from kf.facts import RunStarted
from kf.llm.cli import add_llm_options, llm_config
from kf.log import EventLog
from kf.settings import current

ROOT = Path(__file__).resolve().parent.parent
#: a log of 2 December, before compile_baseline, device_inputs and confirm_trusted
OLD_LOG = ROOT / "bench" / "results" / "llm_kernelbench_19_ReLU_h200_2026-12-02.db"


def test_run_config_decodes_an_old_log() -> None:
    """An old log's run.started decodes: its keys typed, the keys it lacks at what they
    meant then, and its map written back as it was (plus those keys)."""
    with EventLog(OLD_LOG, create=False, readonly=True) as log:
        started = next(iter(log.records(1, 2))).event
    assert isinstance(started, RunStarted)
    config = started.run_config()
    assert (config.search.budget, config.search.search_version) == (2, 4)
    assert config.llm.llm and config.llm.llm_models == (("scripted", 1.0),)
    assert config.llm.languages == ("cuda", "triton") and config.llm.init == 2
    assert config.evaluation.compile_baseline and config.evaluation.device_inputs  # absent
    assert config.trust.confirm_trusted is None and config.trusted("any/cuda:0")
    assert Conditions.of(config) == Conditions() and Tolerance.of(config) == Tolerance()
    wire = config.wire()
    assert {k: wire[k] for k in started.config} == started.config and config.other == {}
    assert set(wire) - set(started.config) == {"compile_baseline", "device_inputs"}


def test_run_config_keeps_what_it_does_not_know() -> None:
    """A key this kf does not know, and a known key holding another type, are kept as the
    log holds them and written back; the field takes its default; nothing is refused."""
    config = RunConfig.decode({"budget": "many", "islands": 3, "future": {"x": [1]}})
    assert config.search.budget == 20 and config.search.islands == 3
    assert config.search.search_version == 1 and config.tuning.tune_budget == 0  # version 1
    assert config.other == {"budget": "many", "future": {"x": [1]}}
    assert config.wire()["budget"] == "many" and config.wire()["future"] == {"x": [1]}


def test_run_config_overridden_converts_agent_options() -> None:
    """An agent's --option KEY=VALUE (text) takes the key's type; a value that does not
    convert is refused with the key named; a key of no section is ignored."""
    config = RunConfig().overridden({"llm_timeout_s": "3", "llm_max_tokens": "64", "api_key": "k"})
    assert (config.llm.llm_timeout_s, config.llm.llm_max_tokens) == (3.0, 64)
    with pytest.raises(ValueError, match="llm_concurrency='many'"):
        RunConfig().overridden({"llm_concurrency": "many"})


def _llm_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_llm_options(p)
    return p.parse_args(["--llm-url", "http://x/v1", "--model", "m", *argv])


def test_run_config_records_what_kf_run_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config kf run builds once and records in run.started is the map kf run wrote
    before the config was typed: the same keys, the same values."""
    monkeypatch.delenv("KF_TRUSTED_DEVICES", raising=False)
    monkeypatch.delenv("KF_COMPILE_BASELINE", raising=False)  # conftest turns it off
    llm = llm_config(_llm_args("--mutators", "single=1,tools=1"))
    assert isinstance(llm, dict)
    request = RunRequest(
        tasks=Path("tasks"),
        budget=3,
        tune_budget=0,
        llm_url="http://x/v1",
        llm=llm,
        tolerance={"atol": 0.01},
        tf32="on",
        select="a,b",
        local_worker=False,
    )
    asked = asked_conditions(request, current())
    config = run_config(request, ["cpu"], "cpu", [("bad.py", "no Model")], conditions=asked)
    started = _started("r", [], RunOptions(request=request, config=config), "llm")
    assert started.config == {
        "budget": 3,
        "islands": 2,
        "max_in_flight": 2,
        "device": "cpu",
        "llm": True,
        "mutator": llm["mutator"],
        "search_version": started.config["search_version"],
        "tune_budget": 0,
        **llm,
        "atol": 0.01,
        "compile_baseline": True,
        "compile_mode": "default",
        "tf32": "on",
        "device_inputs": True,
        "confirm_trusted": [],
        "skipped_tasks": {"bad.py": "no Model"},
        "task_selection": "a,b",
    }
    assert started.config["search_version"] >= 5
    assert started.run_config().wire() == started.config  # decoded and written back: equal


def test_asked_conditions_are_the_flags_over_the_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--compile-mode and --tf32 are handed down as values over the process's settings
    (no KF_* variable made up for them); a bad setting the flag replaces is not read."""
    monkeypatch.setenv("KF_TF32", "maybe")
    monkeypatch.setenv("KF_COMPILE_BASELINE", "off")
    request = RunRequest(tasks=Path("t"), tf32="on", compile_mode="max-autotune")
    asked = asked_conditions(request, current())
    assert asked == Conditions(compile_baseline=False, compile_mode="max-autotune", tf32="on")
