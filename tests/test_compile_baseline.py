"""The torch.compile baseline: the reference compiled with inductor and timed beside eager
in the same session, reused by later profiles, recorded (not fatal) when it cannot be had."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kf.evaluation import ProfileReport, RunnerPool, profile_candidate
from kf.evaluation.grader.cli import main as eval_main
from kf.kernels.tasks import load_task

ROOT = Path(__file__).resolve().parent.parent
EVAL = ROOT / "tests" / "fixtures" / "eval"
FAST: dict[str, Any] = {"min_time_s": 0.05, "min_trials": 5, "warmup": 2}


def test_eval_reports_torch_compile_baseline_and_reuses_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kf eval --json` of an honest candidate times the compiled reference (paying the
    compile once) with speed-ups consistent with the three times, and a second profile in
    the same reference runner reuses the compiled reference instead of compiling again."""
    monkeypatch.setenv("KF_COMPILE_BASELINE", "1")
    task, cand = EVAL / "task_gelu.py", EVAL / "honest.py"
    assert eval_main([str(task), str(cand), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    p = out["profile"]
    assert p["compile_baseline_error"] is None
    assert p["compiled_runtime_ms"] > 0 and p["compiled_trials"] >= FAST["min_trials"]
    assert p["compile_baseline_s"] > 0 and p["compile_baseline_cached"] is False
    assert p["compile_baseline_graphs"] >= 1 and "inductor" in p["compile_baseline"]
    assert p["speedup_vs_compiled"] == pytest.approx(p["compiled_runtime_ms"] / p["runtime_ms"])
    best = min(p["ref_runtime_ms"], p["compiled_runtime_ms"])
    assert p["speedup_vs_best"] == pytest.approx(best / p["runtime_ms"])
    assert p["speedup"] == pytest.approx(p["ref_runtime_ms"] / p["runtime_ms"])  # still eager
    assert out["speedup_vs_compiled"] == p["speedup_vs_compiled"]
    assert out["speedup_vs_best"] == p["speedup_vs_best"]

    # kf eval's process-wide pool keeps the task's reference runner: no second compile
    again = profile_candidate(load_task(task), cand.read_text(), **FAST)
    assert again.ok, again.error
    assert again.compile_baseline_cached is True and again.compile_baseline_s == 0.0
    assert again.compiled_runtime_ms is not None and again.compiled_runtime_ms > 0
    assert again.phases.get("compile_baseline", 0.0) < p["compile_baseline_s"]


@pytest.fixture
def pool() -> Any:
    """A runner pool of the test's own, closed afterwards."""
    pool = RunnerPool(size=1)
    try:
        yield pool
    finally:
        pool.close()


def test_profile_without_compile_baseline_says_why(
    monkeypatch: pytest.MonkeyPatch, pool: RunnerPool
) -> None:
    """$KF_COMPILE_BASELINE=0 times eager only: no compiled figures, and the reason."""
    monkeypatch.setenv("KF_COMPILE_BASELINE", "0")
    task = load_task(EVAL / "task_uncompilable.py")
    report = profile_candidate(task, (EVAL / "honest_twice.py").read_text(), pool=pool, **FAST)
    assert report.ok, report.error
    assert report.speedup > 0
    assert report.compiled_runtime_ms is None and report.compiled_trials == 0
    assert report.speedup_vs_compiled is None and report.speedup_vs_best is None
    assert report.compile_baseline_error is not None
    assert "KF_COMPILE_BASELINE=0" in report.compile_baseline_error
    assert "compile_baseline" not in report.phases  # not even asked


def test_profile_of_uncompilable_reference_records_why_and_times_eager(
    monkeypatch: pytest.MonkeyPatch, pool: RunnerPool
) -> None:
    """A reference torch.compile cannot compile leaves the error in the report; the
    candidate is still timed against eager, and the failure is not retried."""
    monkeypatch.setenv("KF_COMPILE_BASELINE", "1")
    task = load_task(EVAL / "task_uncompilable.py")
    source = (EVAL / "honest_twice.py").read_text()
    first = profile_candidate(task, source, pool=pool, **FAST)
    assert first.ok, first.error
    assert first.speedup > 0 and first.ref_runtime_ms > 0
    assert first.compiled_runtime_ms is None and first.speedup_vs_compiled is None
    assert first.compile_baseline_error is not None
    assert "torch.compile failed" in first.compile_baseline_error
    assert "no shape function" in first.compile_baseline_error
    second = profile_candidate(task, source, pool=pool, **FAST)
    assert second.compile_baseline_error == first.compile_baseline_error
    assert second.compile_baseline_cached is True


def test_profile_whose_compile_outlasts_its_limit_loses_only_the_baseline(
    monkeypatch: pytest.MonkeyPatch, pool: RunnerPool
) -> None:
    """A compile past $KF_COMPILE_BASELINE_TIMEOUT_S kills the reference runner; the
    profile is taken again with fresh runners against eager, and the next profile of
    the task does not try the compile again."""
    from kf.evaluation.grader import baseline

    monkeypatch.setenv("KF_COMPILE_BASELINE", "1")
    monkeypatch.setenv("KF_COMPILE_BASELINE_TIMEOUT_S", "0.01")  # no compile is that quick
    monkeypatch.setattr(baseline, "baseline_lost", {})
    task = load_task(EVAL / "task_uncompilable.py")
    source = (EVAL / "honest_twice.py").read_text()
    first = profile_candidate(task, source, pool=pool, **FAST)
    assert first.ok, first.error
    assert first.speedup > 0 and first.compiled_runtime_ms is None
    assert first.compile_baseline_error and "lost its runner" in first.compile_baseline_error
    second = profile_candidate(task, source, pool=pool, **FAST)
    assert second.ok and second.compile_baseline_error == first.compile_baseline_error
    assert "compile_baseline" not in second.phases  # not asked again


def test_baseline_compiled_early_is_the_one_the_profile_times(pool: RunnerPool) -> None:
    """The verifier compiles a task's baseline before any profile's exclusive turn
    (compile_early): the profile then takes that reference runner from among several idle
    ones, finds the baseline made (no compile in its turn) and times it."""
    from kf.evaluation import GradingSession
    from kf.evaluation.grader.baseline import compile_early
    from kf.evaluation.grader.baseline_settings import Conditions
    from kf.evaluation.grader.session import Stage

    task = load_task(EVAL / "task_gelu.py")
    cond = Conditions(compile_baseline=True)
    session = GradingSession(task, device="cpu", pool=pool, conditions=cond)
    # another idle reference runner of the task, released after the one that compiles
    other = Stage(session)
    with other.reference_lease():
        early = compile_early(session)
    assert early is not None and early.error is None, early
    assert early.compile_s > 0 and not early.cached
    assert len(pool._refs[session.reference_key]) == 2

    source = (EVAL / "honest.py").read_text()
    report = profile_candidate(task, source, pool=pool, conditions=cond, **FAST)
    assert report.ok, report.error
    assert report.compile_baseline_cached is True  # the early runner was taken
    assert report.compiled_runtime_ms is not None and report.compiled_runtime_ms > 0
    assert report.phases.get("compile_baseline", 0.0) < early.compile_s
    # a run without the baseline compiles nothing early
    off = GradingSession(
        task, device="cpu", pool=pool, conditions=Conditions(compile_baseline=False)
    )
    assert compile_early(off) is None


def test_profile_report_reads_old_logs_without_compiled_fields() -> None:
    """A ProfileReport from before the compiled baseline decodes with None and defaults."""
    import msgspec

    old = msgspec.json.encode(
        {"ok": True, "runtime_ms": 1.0, "ref_runtime_ms": 2.0, "speedup": 2.0}
    )
    report = msgspec.json.decode(old, type=ProfileReport)
    assert report.speedup == 2.0
    assert report.compiled_runtime_ms is None and report.speedup_vs_best is None
    assert report.compile_baseline_error is None and report.compile_baseline_s == 0.0


needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs an NVIDIA GPU and a CUDA build of PyTorch (CI has neither)",
)


@pytest.mark.gpu
@needs_gpu
def test_cuda_profile_times_torch_compile_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the reference compiles with inductor (Triton), is timed with CUDA events
    and L2 flushes beside eager, and the next profile of the task reuses it."""
    monkeypatch.setenv("KF_COMPILE_BASELINE", "1")
    task = load_task(ROOT / "examples" / "cuda_tasks" / "gelu_residual.py")
    seed = (ROOT / "examples" / "cuda_tasks" / "seeds" / "gelu_residual.py").read_text()
    pool = RunnerPool(size=2, warm="cuda:0")
    try:
        first = profile_candidate(task, seed, device="cuda:0", pool=pool)
        again = profile_candidate(task, seed, device="cuda:0", pool=pool)
    finally:
        pool.close()
    assert first.ok and again.ok, (first.error, again.error)
    assert first.compile_baseline_error is None, first.compile_baseline_error
    assert first.compiled_runtime_ms is not None and first.compiled_runtime_ms > 0
    assert first.compile_baseline_s > 0 and not first.compile_baseline_cached
    assert first.speedup_vs_compiled == pytest.approx(first.compiled_runtime_ms / first.runtime_ms)
    assert again.compile_baseline_cached and again.compile_baseline_s == 0.0


@pytest.mark.gpu
@needs_gpu
def test_cuda_profile_of_uncompilable_reference_times_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU too, a reference torch.compile rejects leaves the reason and eager timing."""
    monkeypatch.setenv("KF_COMPILE_BASELINE", "1")
    task = load_task(EVAL / "task_uncompilable.py")
    pool = RunnerPool(size=2, warm="cuda:0")
    try:
        report = profile_candidate(
            task, (EVAL / "honest_twice.py").read_text(), device="cuda:0", pool=pool
        )
    finally:
        pool.close()
    assert report.ok, report.error
    assert report.compiled_runtime_ms is None
    assert report.compile_baseline_error and "torch.compile failed" in report.compile_baseline_error


def _run_envelopes(
    reports: dict[str, tuple[str, ProfileReport]], early: dict[str, float] | None = None
) -> list[Any]:
    """The committed envelopes of a tiny run: one seed per task, each profiled with the
    given report, the archive's decisions folded back in as the archivist commits them;
    ``early``: per task, the seconds its verification spent compiling the baseline."""
    from agents.archive import ArchiveAgent
    from kf.agent import AgentContext
    from kf.events import Event, Record, make_envelope
    from kf.facts import DeviceAnnounced, RunStarted, TaskSpec
    from kf.reports import CompileReport, VerifyReport
    from kf.search_facts import (
        CandidateCompiled,
        CandidateProfiled,
        CandidateProposed,
        CandidateVerified,
    )

    seed_src = (ROOT / "tests" / "fixtures" / "search" / "seeds" / "scale_relu.py").read_text()
    agent = ArchiveAgent(AgentContext(run_id="r", agent_id="archive@t"))
    state = agent.initial_state()
    envelopes: list[Any] = []

    def feed(ev: Event) -> None:
        nonlocal state
        env = make_envelope(
            ev, run_id="r", source="t@x", event_id=f"e{len(envelopes)}", seq=len(envelopes) + 1
        )
        envelopes.append(env)
        r = Record(env, ev)
        state = agent.evolve(state, r)
        for d in agent.react(state, r):
            feed(d)

    feed(
        RunStarted(
            run_id="r",
            seed=1,
            config={"budget": 1, "islands": 1, "max_in_flight": 1},
            tasks=tuple(
                TaskSpec(name=t, source="x", sha256="h", seeds=(("s", seed_src),)) for t in reports
            ),
        )
    )
    feed(
        DeviceAnnounced(
            device_id="d", kind="cpu", agent_id="hw@x", capabilities={"backends": ["cpp-openmp"]}
        )
    )
    for task, (cid, report) in reports.items():
        feed(
            CandidateProposed(
                candidate_id=cid, task=task, source=seed_src, island=0, operator="seed",
                mutator="offline", selection=None,
            )
        )  # fmt: skip
        where: dict[str, Any] = {"candidate_id": cid, "task": task, "device_id": "d", "attempt": 1}
        feed(CandidateCompiled(report=CompileReport(ok=True), **where))
        phases = {"compile_baseline_early": early[task]} if early and task in early else {}
        verified = VerifyReport(correct=True, trials=5, phases=phases)
        feed(CandidateVerified(report=verified, **where))
        feed(CandidateProfiled(report=report, **where))
    return envelopes


def test_report_states_best_speedups_against_each_baseline() -> None:
    """`kf report` gives each task's best speed-up against eager, torch.compile and the
    better of the two, with fast_p and geomean against the better one; a task without a
    compiled time says why and counts against eager there."""
    from kf.app.report import build_report_from, format_table

    with_compiled = ProfileReport(
        ok=True, runtime_ms=1.0, ref_runtime_ms=4.0, speedup=4.0, compiled_runtime_ms=2.0,
        speedup_vs_compiled=2.0, speedup_vs_best=2.0, compile_baseline_s=7.5,
    )  # fmt: skip
    without = ProfileReport(
        ok=True, runtime_ms=1.0, ref_runtime_ms=3.0, speedup=3.0,
        compile_baseline_error="torch.compile failed: no C++ compiler",
    )  # fmt: skip
    report = build_report_from(_run_envelopes({"a": ("ca", with_compiled), "b": ("cb", without)}))
    tasks = {t["task"]: t for t in report["tasks"]}
    assert tasks["a"]["best_speedup"] == 4.0
    assert tasks["a"]["best_speedup_vs_compiled"] == 2.0
    assert tasks["a"]["best_speedup_vs_best"] == 2.0
    assert tasks["a"]["compiled_ms"] == 2.0 and tasks["a"]["compile_baseline_s"] == 7.5
    assert tasks["b"]["best_speedup_vs_compiled"] is None
    assert tasks["b"]["compile_baseline_error"] == "torch.compile failed: no C++ compiler"
    assert report["tasks_without_compiled_baseline"] == 1
    assert report["fast_p"]["fast_2"] == 1.0  # 4× and 3× against eager
    assert report["fast_p_vs_best"]["fast_2"] == 0.5  # 2× (not above 2) and 3× (eager)
    assert report["geomean_speedup_vs_best"] == pytest.approx((2.0 * 3.0) ** 0.5)
    # the verifier compiled a's baseline before its profile, which found it made
    cached = msgspec.structs.replace(with_compiled, compile_baseline_s=0.0)
    early = build_report_from(_run_envelopes({"a": ("ca", cached)}, early={"a": 12.5}))
    assert early["tasks"][0]["compile_baseline_s"] == 12.5
    table = format_table(report)
    assert "vs t.compile" in table and "no torch.compile baseline" in table
    assert "against the better of eager and torch.compile" in table


def test_reference_runners_with_a_baseline_are_evicted_last() -> None:
    """Over its KF_REFERENCE_RUNNERS, a pool kills the oldest idle reference runner that
    holds no compiled baseline, and keeps the one that does though it is older."""
    from kf.settings import SettingError, Settings

    assert Settings(variables={"KF_REFERENCE_RUNNERS": "8"}).reference_runners == 8
    assert Settings(variables={}).reference_runners is None
    with pytest.raises(SettingError, match="KF_REFERENCE_RUNNERS"):
        _ = Settings(variables={"KF_REFERENCE_RUNNERS": "0"}).reference_runners
    pool = RunnerPool(size=0, references=1)
    try:
        with pool.reference_lease("task-a") as older:
            older.baselines.add("default")  # as compile_reference marks it
        with pool.reference_lease("task-b") as newer:
            assert newer is not older  # task-a's runner is not task-b's
        assert pool._refs["task-a"] == [older] and pool._refs["task-b"] == []
        assert newer.proc.poll() is not None or newer.closed  # killed, not kept
    finally:
        pool.close()


def test_a_profile_waits_for_the_leased_runner_that_holds_its_baseline() -> None:
    """A reference lease that prefers the runner holding the task's compiled baseline
    waits (``wait_s``) while another stage has it leased, and gets it when it comes back,
    instead of a runner that would compile the baseline again; with nothing preferred
    leased, or ``wait_s`` 0, it does not wait for one."""
    import threading

    pool = RunnerPool(size=0, references=4)
    prefer = lambda h: "default" in h.baselines  # noqa: E731 (as has_baseline's)
    try:
        with pool.reference_lease("task") as holder:
            holder.baselines.add("default")
        got: list[Any] = []
        leased, back = threading.Event(), threading.Event()

        def verification() -> None:  # holds the baseline's runner for a moment
            with pool.reference_lease("task") as handle:
                got.append(handle)
                leased.set()
                back.wait(60)

        other = threading.Thread(target=verification)
        other.start()
        assert leased.wait(60) and got == [holder]
        with pool.reference_lease("task", prefer) as fresh:  # no wait asked: another one
            assert fresh is not holder
        threading.Timer(0.5, back.set).start()
        with pool.reference_lease("task", prefer, wait_s=60.0) as waited:
            assert waited is holder  # came back from the verification
        other.join(60)
        with pool.reference_lease("other-task", prefer, wait_s=60.0) as unrelated:
            assert unrelated is not holder  # none of its key leased: no wait
    finally:
        pool.close()


def test_a_profile_can_wait_for_its_baselined_runner_before_it_leases_anything() -> None:
    """``wait_for_reference`` (what a profile calls before it takes its share of the
    device) waits while the runner holding the baseline is leased elsewhere, returns when
    it is back without leasing it, and does not wait where nothing preferred is leased; a
    lease with ``only_preferred`` (the counters') starts a runner rather than take it."""
    import threading

    pool = RunnerPool(size=0, references=4)
    prefer = lambda h: "default" in h.baselines  # noqa: E731 (as has_baseline's)
    try:
        with pool.reference_lease("task") as holder:
            holder.baselines.add("default")
        leased, back = threading.Event(), threading.Event()

        def verification() -> None:
            with pool.reference_lease("task"):
                leased.set()
                back.wait(60)

        other = threading.Thread(target=verification)
        other.start()
        assert leased.wait(60)
        assert not pool.wait_for_reference("task", prefer, 0.0)  # leased, and no wait asked
        threading.Timer(0.5, back.set).start()
        started = time.monotonic()
        assert pool.wait_for_reference("task", prefer, 60.0)
        assert time.monotonic() - started < 30  # it came back; the wait ended then
        other.join(60)
        with pool.reference_lease("task", prefer) as taken:  # still idle: the wait leased nothing
            assert taken is holder
        # the counters' lease: never the baselined runner, though it is the only one idle
        with pool.reference_lease("task", lambda h: not h.baselines, only_preferred=True) as ref:
            assert ref is not holder and not ref.baselines
        assert not pool.wait_for_reference("other-task", prefer, 60.0)  # nothing to wait for
    finally:
        pool.close()


def test_a_reference_runner_is_dropped_for_its_own_failure_only() -> None:
    """A reused reference runner survives an error of another runner of the job (a
    candidate's failure, or the runner under ncu that never started: on the H200 each
    failing counters run killed the runner holding the task's compiled baseline), and is
    dropped when one of its own requests fails."""
    from kf.evaluation.grader.grading import CandidateFailed
    from kf.evaluation.grader.sandbox import RunnerError, RunnerHandle
    from kf.evaluation.wire import protocol

    pool = RunnerPool(size=0, references=2)
    leased: list[RunnerHandle] = []

    def job(then: Any) -> None:
        with pool.reference_lease("task") as handle:
            leased.append(handle)
            then(handle)

    def candidate_failed(handle: RunnerHandle) -> None:
        handle.baselines.add("default")
        raise CandidateFailed("wrong", "the candidate's outputs differ")

    def another_runner_failed(handle: RunnerHandle) -> None:
        other = RunnerError("process exited with status 1 during start-up")
        other.runner_pid = handle.pid + 1_000_000  # not this runner's
        raise other

    def own_request_failed(handle: RunnerHandle) -> None:
        handle.request(protocol.Run(seed=0), 60.0)  # no model loaded: a Failed answer

    try:
        with pytest.raises(CandidateFailed):
            job(candidate_failed)
        with pytest.raises(RunnerError):
            job(another_runner_failed)
        ref = leased[0]
        assert leased == [ref, ref] and pool._refs["task"] == [ref]
        assert ref.proc.poll() is None
        with pytest.raises(RunnerError) as own:
            job(own_request_failed)
        assert leased[2] is ref and own.value.runner_pid == ref.pid
        assert pool._refs["task"] == [] and ref.closed
    finally:
        pool.close()


def test_a_profile_without_the_compiled_baseline_does_not_wait_for_its_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A profile that times against eager only (a tuner's trial, ``compile_baseline``
    False) takes another reference runner at once while the one holding the task's
    compiled baseline is leased elsewhere: it has nothing to gain from that runner, and
    its wait (``BASELINE_WAIT_S``) would hold the device's turn."""
    import threading

    from kf.evaluation.grader import profiling
    from kf.evaluation.grader.session import GradingSession

    monkeypatch.setattr(profiling, "BASELINE_WAIT_S", 300.0)
    task = load_task(EVAL / "task_uncompilable.py")
    source = (EVAL / "honest_twice.py").read_text()
    pool = RunnerPool(size=1, references=4)
    session = GradingSession(task, source, device="cpu", pool=pool)
    key, mode = session.reference_key, session.cond.compile_mode
    used: list[Any] = []
    lease = pool.reference_lease

    def spied(*args: Any, **kwargs: Any) -> Any:
        cm = lease(*args, **kwargs)

        class Spy:
            def __enter__(self) -> Any:
                used.append(cm.__enter__())
                return used[-1]

            def __exit__(self, *exc: Any) -> Any:
                return cm.__exit__(*exc)

        return Spy()

    try:
        with pool.reference_lease(key) as holder:
            holder.baselines.add(mode)  # as if it had compiled the baseline
        leased, back = threading.Event(), threading.Event()

        def verification() -> None:  # holds the baselined runner until the profile ends
            with pool.reference_lease(key):
                leased.set()
                back.wait(120)

        other = threading.Thread(target=verification)
        other.start()
        assert leased.wait(60)
        monkeypatch.setattr(pool, "reference_lease", spied)
        safety = threading.Timer(60.0, back.set)  # a profile that waits gets it then
        safety.start()
        try:
            report = profile_candidate(task, source, pool=pool, compile_baseline=False, **FAST)
        finally:
            back.set()
            safety.cancel()
            other.join(60)
        assert report.ok, report.error
        assert used and all(handle is not holder for handle in used)
    finally:
        pool.close()
