"""How the search treats untrustworthy results: suspect timings, failed generalisation, noise."""

from __future__ import annotations

import msgspec
import pytest

from agents.archive import best_candidate
from kf.evaluation.grader.policy import relative_noise, within_noise
from kf.reports import CompileReport, ProfileReport, VerifyReport
from kf.search_facts import (
    CandidateCompiled,
    CandidateProfiled,
    CandidateVerified,
    EliteAdmitted,
    GeneralisationFailed,
)
from tests.test_archive import Driver, propose, started


def profile(d: Driver, cid: str, speedup: float, flags: tuple[str, ...] = ()) -> list[object]:
    c = d.state.candidates[cid]
    where = {"device_id": c.device_id or "?", "attempt": c.attempt}
    d.feed(CandidateCompiled(candidate_id=cid, task="t", report=CompileReport(ok=True), **where))
    d.feed(
        CandidateVerified(
            candidate_id=cid, task="t", report=VerifyReport(correct=True, trials=5), **where
        )
    )
    report = ProfileReport(
        ok=True, speedup=speedup, runtime_ms=1.0, ref_runtime_ms=speedup, flags=flags
    )
    return list(d.feed(CandidateProfiled(candidate_id=cid, task="t", report=report, **where)))


def test_archive_suspect_timing_never_becomes_elite_or_best() -> None:
    """A profile flagged cache_suspected is recorded but neither admitted nor reported best."""
    d = Driver()
    d.feed(started())
    d.feed(propose("honest"))
    profile(d, "honest", 1.2)
    d.feed(propose("cheat", selection=0))
    out = profile(d, "cheat", 50.0, flags=("cache_suspected: 0.01 ms vs 0.7 ms",))
    assert not [e for e in out if isinstance(e, EliteAdmitted)]
    assert d.state.candidates["cheat"].suspect
    best = best_candidate(d.state, "t")
    assert best is not None and best.id == "honest"


def test_archive_generalisation_failure_removes_elite_and_best() -> None:
    """A kernel.generalisation_failed event takes an elite out of its cells and the best list."""
    d = Driver()
    d.feed(started())
    d.feed(propose("seed1"))
    profile(d, "seed1", 3.0)
    assert "seed1" in d.state.tasks["t"].elites.values()
    d.feed(
        GeneralisationFailed(
            candidate_id="seed1", task="t", device_id="d", reason="[97, 1024]: mismatch"
        )
    )
    assert "seed1" not in d.state.tasks["t"].elites.values()
    assert best_candidate(d.state, "t") is None
    assert d.state.candidates["seed1"].generalisation == "[97, 1024]: mismatch"


def test_profiler_within_noise_only_for_small_wins() -> None:
    """A win smaller than the combined noise is within noise; a larger one or a loss is not."""
    assert within_noise(1.05, 0.05, 1.0, 0.05)
    assert not within_noise(1.5, 0.05, 1.0, 0.05)
    assert not within_noise(0.9, 0.05, 1.0, 0.05)
    assert not within_noise(1.05, 0.0, 0.0, 0.0)


def test_profiler_relative_noise_combines_both_timings() -> None:
    """The noise of a speed-up combines the candidate's and eager's relative CIs."""
    report = ProfileReport(
        ok=True, runtime_ms=2.0, runtime_ci95_ms=0.06, ref_runtime_ms=4.0, ref_runtime_ci95_ms=0.16
    )
    assert abs(relative_noise(report) - 0.05) < 1e-9


def test_profiler_retimes_challenger_within_noise_of_best(monkeypatch: pytest.MonkeyPatch) -> None:
    """A challenger within noise of the best that loses the pairing gets a lower speed-up."""
    from agents import profiler as profiler_module
    from kf.agent import AgentContext
    from kf.evaluation.grader import policy
    from kf.kernels.tasks import Task

    first = ProfileReport(
        ok=True, speedup=2.1, runtime_ms=1.0, runtime_ci95_ms=0.1, ref_runtime_ms=2.1
    )
    calls: list[str] = []

    def once(task: Task, source: str, **kw: object) -> ProfileReport:
        calls.append(source)
        return first

    def paired(task: Task, mine: str, theirs: str, **kw: object) -> tuple[list[float], ...]:
        calls.append(f"{mine}|{theirs}")
        return [1.25] * 20, [1.0] * 20  # the challenger is slower when timed side by side

    monkeypatch.setattr(policy, "profile_candidate", once)
    monkeypatch.setattr(policy, "paired_times", paired)
    monkeypatch.setattr(policy, "reverify_fast", lambda t, s, r, **kw: r)
    agent = profiler_module.Profiler(AgentContext(run_id="r", agent_id="profiler@t"))
    state = profiler_module.ProfilerState(
        sources={"inc": "inc", "new": "new"},
        best={"t": "inc"},
        timings={"inc": (2.0, 0.1)},
    )
    task = Task.from_source("t", "x")
    report = agent._profile(state, task, "new", "new")
    assert calls == ["new", "new|inc"]
    assert abs(report.speedup - 2.0 * 1.0 / 1.25) < 1e-9
    assert any(f.startswith("retimed:") for f in report.flags)


def test_profiler_pairing_never_raises_a_measured_speedup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A challenger that wins the pairing keeps the speed-up measured against eager, no more."""
    from agents import profiler as profiler_module
    from kf.agent import AgentContext
    from kf.evaluation.grader import policy
    from kf.kernels.tasks import Task

    first = ProfileReport(
        ok=True, speedup=2.1, runtime_ms=1.0, runtime_ci95_ms=0.1, ref_runtime_ms=2.1
    )
    monkeypatch.setattr(policy, "profile_candidate", lambda t, s, **kw: first)
    # side by side the challenger looks 1.5x faster
    monkeypatch.setattr(policy, "paired_times", lambda t, a, b, **kw: ([1.0] * 20, [1.5] * 20))
    monkeypatch.setattr(policy, "reverify_fast", lambda t, s, r, **kw: r)
    agent = profiler_module.Profiler(AgentContext(run_id="r", agent_id="profiler@t"))
    state = profiler_module.ProfilerState(
        sources={"inc": "inc", "new": "new"}, best={"t": "inc"}, timings={"inc": (2.0, 0.1)}
    )
    report = agent._profile(state, Task.from_source("t", "x"), "new", "new")
    assert report.speedup == 2.1  # not 2.0 * 1.5 = 3.0
    assert any(f.startswith("retimed:") for f in report.flags)


def test_profiler_does_not_retime_a_clear_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """A challenger well beyond the noise of the best is reported as first measured."""
    from agents import profiler as profiler_module
    from kf.agent import AgentContext
    from kf.evaluation.grader import policy
    from kf.kernels.tasks import Task

    clear = ProfileReport(ok=True, speedup=4.0, runtime_ms=1.0, ref_runtime_ms=4.0)
    monkeypatch.setattr(policy, "profile_candidate", lambda t, s, **kw: clear)
    monkeypatch.setattr(policy, "reverify_fast", lambda t, s, r, **kw: r)
    agent = profiler_module.Profiler(AgentContext(run_id="r", agent_id="profiler@t"))
    state = profiler_module.ProfilerState(
        sources={"inc": "inc", "new": "new"}, best={"t": "inc"}, timings={"inc": (2.0, 0.05)}
    )
    assert agent._profile(state, Task.from_source("t", "x"), "new", "new") is clear


# eager times of the 39 ordinary sessions of a 40-candidate H200 run (ms); the 40th was 0.518
H200_EAGER = [0.357] * 4 + [0.358] * 5 + [0.359, 0.36, 0.36, 0.36, 0.361, 0.361, 0.361]
H200_EAGER += [0.362] * 4 + [0.364] * 3 + [0.365, 0.366, 0.366, 0.368, 0.369, 0.369, 0.372]
H200_EAGER += [0.373, 0.373, 0.375, 0.376, 0.377, 0.379, 0.384, 0.387, 0.395]


def test_eager_outlier_needs_history_and_a_clear_margin() -> None:
    from kf.evaluation.grader.policy import eager_median_if_outlier

    assert len(H200_EAGER) == 39
    median = eager_median_if_outlier(H200_EAGER, 0.518)
    assert median is not None and abs(median - 0.362) < 1e-9
    assert eager_median_if_outlier(H200_EAGER, 0.395) is None  # the slowest ordinary one
    assert eager_median_if_outlier(H200_EAGER, 0.30) is None  # fast: errs on the safe side
    assert eager_median_if_outlier([0.36, 0.36], 0.9) is None  # too little history
    # a noisy device widens the margin beyond the fixed 10 %
    noisy = [1.0, 1.3, 0.8, 1.2, 0.9]
    assert eager_median_if_outlier(noisy, 1.3) is None
    assert eager_median_if_outlier(noisy, 2.0) == 1.0


def test_profiler_states_speedup_against_usual_eager_after_an_outlier_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session whose eager time was an outlier does not inflate the speed-up; the log's
    earlier profiles on the same device say what eager usually takes."""
    from agents import profiler as profiler_module
    from kf.agent import AgentContext
    from kf.evaluation.grader import policy
    from kf.events import Record, make_envelope
    from kf.kernels.tasks import Task

    def profiled(i: int, eager: float, device: str) -> Record:
        report = ProfileReport(ok=True, speedup=eager / 0.1, runtime_ms=0.1, ref_runtime_ms=eager)
        ev = CandidateProfiled(candidate_id=f"c{i}", task="t", device_id=device, report=report)
        return Record(make_envelope(ev, run_id="r", source="profiler@x"), ev)

    outlier = ProfileReport(ok=True, speedup=0.518 / 0.112, runtime_ms=0.112, ref_runtime_ms=0.518)
    monkeypatch.setattr(policy, "profile_candidate", lambda t, s, **kw: outlier)
    monkeypatch.setattr(policy, "reverify_fast", lambda t, s, r, **kw: r)
    ctx = AgentContext(run_id="r", agent_id="profiler@t", options={"device_id": "host/cuda:0"})
    agent = profiler_module.Profiler(ctx)
    state = agent.initial_state()
    for i, eager in enumerate(H200_EAGER):
        state = agent.evolve(state, profiled(i, eager, "host/cuda:0"))
    assert isinstance(state, profiler_module.ProfilerState)
    state.sources["new"] = "new"
    report = agent._profile(state, Task.from_source("t", "x"), "new", "new")
    assert abs(report.speedup - 0.362 / 0.112) < 1e-9  # 3.23x, not the 4.63x measured
    assert report.runtime_ms == 0.112 and report.ref_runtime_ms == 0.518  # measurements kept
    (flag,) = [f for f in report.flags if f.startswith("eager_outlier:")]
    assert "0.5180 ms" in flag and "39 earlier sessions" in flag and "4.625×" in flag

    # history from another device says nothing about this one
    other = profiler_module.Profiler(
        AgentContext(run_id="r", agent_id="profiler@u", options={"device_id": "other/cuda:0"})
    )
    state2 = other.initial_state()
    for i, eager in enumerate(H200_EAGER):
        state2 = other.evolve(state2, profiled(i, eager, "host/cuda:0"))
    assert other._profile(state2, Task.from_source("t", "x"), "new", "new") is outlier


def test_kf_eval_states_its_speedup_by_the_profilers_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kf eval` (pipeline.evaluate) and the profiler agent state a speed-up through the same
    policy: a 12x profile of a real, verified candidate goes through the policy's
    re-verification, and what the policy returns is what the evaluation reports."""
    from pathlib import Path

    from kf.evaluation import evaluate
    from kf.evaluation.grader import policy
    from kf.kernels.tasks import load_task

    fixtures = Path(__file__).parent / "fixtures" / "adversarial"
    fast = ProfileReport(ok=True, speedup=12.0, runtime_ms=0.1, ref_runtime_ms=1.2)
    seen: list[float] = []

    def reverify(task: object, source: str, report: ProfileReport, **kw: object) -> ProfileReport:
        seen.append(report.speedup)
        return msgspec.structs.replace(report, flags=("speedup_over_10x: checked",))

    monkeypatch.setattr(policy, "profile_candidate", lambda t, s, **kw: fast)
    monkeypatch.setattr(policy, "reverify_fast", reverify)
    result = evaluate(
        load_task(fixtures.parent / "eval" / "task_gelu.py"),
        (fixtures / "honest_cpp.py").read_text(),
        timeout_s=90,
    )
    assert result.verify is not None and result.verify.correct
    assert seen == [12.0]
    assert result.profile is not None and result.profile.flags == ("speedup_over_10x: checked",)
