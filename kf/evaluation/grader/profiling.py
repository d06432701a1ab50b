"""The profile stage: the candidate and PyTorch eager (and ``torch.compile``) timed
alternately, with the cross-checks of the timing.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple

import msgspec

from kf.evaluation.grader import baseline_settings
from kf.evaluation.grader.baseline import (
    BaselineLost,
    baseline_lost,
    compile_reference,
    has_baseline,
)
from kf.evaluation.grader.clock_watch import ClockWatch
from kf.evaluation.grader.grading import (
    CACHE_SUSPECTED,
    FRESH_SETS,
    OUTPUT_CHANGED,
    TIMER_DISAGREEMENT,
    CandidateFailed,
    log,
    seed_trials,
)
from kf.evaluation.grader.graph_figures import graph_timing, with_hold
from kf.evaluation.grader.measuring import (
    batch_check,
    cache_again,
    calls_in,
    empty_call,
    fresh_timing,
    paired_again,
    round_trip_ns,
    turn,
)
from kf.evaluation.grader.sandbox import (
    Limits,
    RunnerCrashed,
    RunnerFailed,
    RunnerHandle,
    RunnerPool,
    RunnerTimeout,
)
from kf.evaluation.grader.session import GradingSession, Stage
from kf.evaluation.grader.timing_checks import (
    REMEASURE,
    cache_suspected,
    confirmed,
    timer_disagreement,
    timing_stats,
)
from kf.evaluation.wire.protocol import BaselineCompiled, Settle, SetUp, Time
from kf.evaluation.wire.tolerance import Tolerance
from kf.kernels.tasks import Task
from kf.reports import ProfileReport

#: seconds a profile waits for its task's reference runner that holds the compiled
#: baseline, when another stage (a verification, about a second) has it leased, before
#: it takes another runner and compiles the baseline again there (10-15 s of an H200
#: host, with the device's shared side held, which every timing waits on: on the H200
#: three such compiles made three 10-17 s gaps in the timings of a 220 s run)
BASELINE_WAIT_S = 10.0


def await_baselined_reference(
    task: Task,
    *,
    device: str,
    conditions: baseline_settings.Conditions | None = None,
    pool: RunnerPool | None = None,
    wait_s: float = BASELINE_WAIT_S,
) -> bool:
    """Wait, holding no share of the device, up to ``wait_s`` for the task's reference
    runner that holds its compiled baseline, while another stage has it leased (True: it
    is idle now). A profile calls this before it takes its share: the profile's own
    lease would wait as long holding the share, and every timing then waits on it."""
    session = GradingSession(task, "", device=device, pool=pool, conditions=conditions)
    key = session.reference_key
    return session.runners.wait_for_reference(key, has_baseline(session), wait_s)


def profile_candidate(
    task: Task,
    source: str,
    *,
    device: str = "cpu",
    seed: int = 0,
    warmup: int = 5,
    min_trials: int = 20,
    min_time_s: float = 0.5,
    max_trials: int = 1000,
    timeout_s: float = 120.0,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
    compile_baseline: bool | None = None,
    tolerance: Tolerance | None = None,
    conditions: baseline_settings.Conditions | None = None,
    alone: Callable[[], AbstractContextManager[object]] | None = None,
    candidate_key: str | None = None,
) -> ProfileReport:
    """Time the candidate, PyTorch eager and the reference under ``torch.compile``
    alternately, in separate runners (eager and compiled share the candidate-free one),
    in one session; ``alone`` gives the timing the device to itself
    (:attr:`GradingSession.alone`); ``candidate_key``: the candidate's runner kept by its
    verification is taken (:attr:`GradingSession.candidate_key`).

    ``compile_baseline`` None follows the run's ``conditions`` (None: the process's
    settings, ``$KF_COMPILE_BASELINE``, default on). The
    reference is compiled once per model seed and input shapes in its runner, which
    later profiles of the task reuse; a compile that fails is recorded in the report
    (``compile_baseline_error``) and the speed-up is stated against eager only. Raises
    :class:`TaskError` when the task itself is broken.
    """
    session = GradingSession(
        task, source, device=device, seed=seed, pool=pool, limits=limits or Limits(),
        timeout_s=timeout_s, tolerance=tolerance, conditions=conditions, alone=alone,
        candidate_key=candidate_key,
    )  # fmt: skip
    options = Timing(warmup, min_trials, min_time_s, max_trials)
    return profile_session(session, options, compile_baseline=compile_baseline)


class Timing(NamedTuple):
    """How long a profile times: warm-up calls, then at least ``min_trials`` samples and
    ``min_time_s`` of the candidate's calls, at most ``max_trials``."""

    warmup: int = 5
    min_trials: int = 20
    min_time_s: float = 0.5
    max_trials: int = 1000


def profile_session(
    session: GradingSession,
    options: Timing | None = None,
    *,
    compile_baseline: bool | None = None,
) -> ProfileReport:
    """:func:`profile_candidate` of the session's candidate (``options`` None: :class:`Timing`'s
    defaults)."""
    options = options or Timing()
    stage = Stage(session)
    want = session.cond.compile_baseline if compile_baseline is None else compile_baseline
    try:
        report = _profile(stage, options, want)
    except BaselineLost:
        # the reference runner was lost to torch.compile; the failure is remembered, so
        # this second session, with fresh runners, times against eager only
        report = _profile(stage, options, want)
    return stage.sandboxed(
        msgspec.structs.replace(
            report, phases=stage.phases(), peak_device_mb=stage.peak_device_mb()
        )
    )


def _profile(stage: Stage, options: Timing, compile_baseline: bool) -> ProfileReport:
    """:func:`profile_session` in ``stage``.

    Raises :class:`BaselineLost` when the reference runner died or hung over the
    compiled baseline (remembered, so a second call skips it).
    """
    session, task, device, seed = stage.session, stage.task, stage.device, stage.session.seed
    with (
        # only a profile that times the compiled baseline waits for the runner holding
        # it (one timed against eager, a tuner's trial, has nothing to gain from it)
        stage.reference_lease(
            trimmed=True,
            prefer=has_baseline(session),
            wait_s=BASELINE_WAIT_S if compile_baseline else 0.0,
        ) as ref,
        stage.candidate_lease() as cand,
    ):
        start = time.monotonic()
        stage.restart_clock()
        try:
            # loading, the first check and the baseline's compile share the device; only
            # the timing, the checks after it and the fresh inputs' timing have it alone
            made, setup, problem = stage.loaded_and_checked()
            if problem is not None:
                return _failed(
                    stage, problem[0], f"wrong output before timing: {problem[1]}", start
                )
            baseline = compile_reference(session, ref, compile_baseline)
            with stage.alone():
                if not device.startswith("cuda"):
                    # replacement runners import torch now, not during a CPU timing; CUDA
                    # events time the GPU, which runner start-ups on the host do not slow
                    session.runners.wait_warm()
                stage.restart_clock()  # the compile (and the wait for the turn) had its own
                timed = _Timed(stage, ref, baseline, min(round_trip_ns(stage) for _ in range(3)))
                samples = _alternate(timed, options, session.timeout_s)
                checks = _cross_checks(timed, samples)
                flags = checks.flags
                if stage.run_and_check(stage.run_request(made, seed), seed) is not None:
                    flags.append(
                        f"{OUTPUT_CHANGED}: the timed inputs' output is wrong after timing"
                    )
                fresh = _fresh_after_timing(stage, ref, samples.candidate["median"], checks.empty)
                graph = graph_timing(timed, samples.candidate["median"])
            if fresh.problem is not None:
                why = f"wrong output on fresh inputs after timing: {fresh.problem[1]}"
                return _failed(stage, "stale_output", why, start, flags)
            if fresh.cached is not None:
                flags.append(f"{CACHE_SUSPECTED}: {fresh.cached}")
            flags += [f for f in cand.findings if f not in flags]
        except CandidateFailed as exc:
            stage.after_candidate_failure(exc)
            log.info("candidate_profile_failed", task=task.name, kind=exc.kind)
            return _failed(stage, exc.kind, exc.error, start)
    report = _report(timed, samples, checks, fresh.runtime_ms, setup, cand.threads, start)
    found = timed.state_found or (graph.state_found if graph is not None else "")
    report = with_hold(report, graph, timed.clocks, found, session.source)
    log.info(
        "candidate_profiled",
        task=task.name,
        runtime_ms=report.runtime_ms,
        speedup=report.speedup,
        speedup_vs_compiled=report.speedup_vs_compiled,
        flags=report.flags,
    )
    return report


def _failed(
    stage: Stage, kind: str, error: str, start: float, flags: list[str] | None = None
) -> ProfileReport:
    """A profile that ended in ``kind`` of failure (no timing stated)."""
    return ProfileReport(
        ok=False,
        failure_kind=kind,
        error=error,
        device=stage.device,
        flags=tuple(flags or ()),
        duration_s=time.monotonic() - start,
    )


class _Timed:
    """The profile's timing requests, each side in its turn: the candidate's and eager's in
    their runners, the compiled reference's in the reference runner (none once it failed),
    and the grader's own wall clock around every timing request of the candidate, which
    samples forged or shrunk in-process cannot add up to."""

    def __init__(
        self, stage: Stage, ref: RunnerHandle, baseline: BaselineCompiled, rtt_ns: int
    ) -> None:
        self.stage, self.ref, self.baseline, self.rtt_ns = stage, ref, baseline, rtt_ns
        self.compiled_on = baseline.error is None
        self.compiled_error = baseline.error
        # Per request: (calls, wall ms less the round trip, sum of the samples in ms).
        self.batches: list[tuple[int, float, float]] = []
        # On a GPU the two runners take turns: each gives its calls' temporaries back
        # after its turn and allocates them again, untimed, before its next one;
        # requests of their own, outside the wall clock around the timed ones
        self.turns = _takes_turns(stage.device)
        # the GPU's clocks read around every timing request, retimed when they dropped,
        # and device state the candidate's calls left (issue 47: graph_figures)
        self.clocks = ClockWatch.for_device(stage.device)
        self.state_found = ""

    def __call__(self, is_candidate: bool, n: int) -> list[float]:
        """Samples of ``n`` calls of the candidate or of eager, in ms."""
        call = self.stage.candidate if is_candidate else self.stage.reference
        # the candidate's box is quiet while eager is timed (issue 43, NK2)
        quiet = contextlib.nullcontext() if is_candidate else self.stage.candidate_quiet()
        with quiet, turn(call, self.turns):
            t0 = time.perf_counter_ns()
            reply = self.clocks.timed(lambda: call(Time(n=n), what=f"timing {n} calls"))
            samples = [ns / 1e6 for ns in reply.samples_ns]
            if is_candidate:
                self.state_found = reply.state_found or self.state_found
                spent = max(0, time.perf_counter_ns() - t0 - self.rtt_ns) / 1e6
                self.batches.append((len(samples), spent, sum(samples)))
        return samples

    def compiled(self, n: int) -> list[float]:
        """Samples of the compiled reference; none once it has failed."""
        if not self.compiled_on:
            return []
        stage, ref = self.stage, self.ref

        def settle(message: Settle) -> object:
            return ref.request(message, stage.deadline.left())

        try:
            with stage.candidate_quiet(), turn(settle, self.turns, compiled=True):
                reply = self.clocks.timed(
                    lambda: ref.request(
                        Time(n=n, compiled=True), stage.deadline.left(), what=f"timing {n} compiled"
                    )
                )
        except (RunnerTimeout, RunnerCrashed) as exc:
            why = f"the compiled reference lost its runner while timed: {exc}"
            baseline_lost[f"{stage.session.reference_key}:{stage.session.seed}"] = why
            raise BaselineLost(why) from exc
        except RunnerFailed as exc:
            self.compiled_on = False
            self.compiled_error = f"the compiled reference failed: {exc}"
            return []
        return [ns / 1e6 for ns in reply.samples_ns]


class _Samples(NamedTuple):
    """The alternating rounds' samples (ms) and their statistics (``compiled`` None: no
    sample of the compiled reference)."""

    cand_ms: list[float]
    ref_ms: list[float]
    comp_ms: list[float]
    per_candidate: int  # the candidate's calls a round
    candidate: dict[str, float]
    eager: dict[str, float]
    compiled: dict[str, float] | None


def _alternate(timed: _Timed, options: Timing, timeout_s: float) -> _Samples:
    """Warm-up, then rounds of the candidate, eager and the compiled reference in turn
    until each has its trials and the candidate its time (or a third of the time is left)."""
    warmup, min_trials, min_time_s, max_trials = options
    est_c = statistics.median(timed(True, warmup) or [1.0])
    timed.batches.clear()  # warm-up calls (first launches, caches) are not compared
    est_r = statistics.median(timed(False, warmup) or [1.0])
    est_k = statistics.median(timed.compiled(warmup) or [0.0])
    # each side gets about the same time a round (its own count of calls, from what its
    # last round measured: a warm-up's first calls are slow), so a fast candidate's
    # profile does not time the slower eager side as many times as itself
    round_s = max(min_time_s / 10, 0.01)
    per_c, per_r, per_k = (calls_in(round_s, est) for est in (est_c, est_r, est_k))
    cand_ms: list[float] = []
    ref_ms: list[float] = []
    comp_ms: list[float] = []
    while len(cand_ms) < max_trials:
        enough = len(cand_ms) >= min_trials and len(ref_ms) >= min_trials
        enough = enough and (len(comp_ms) >= min_trials or not timed.compiled_on)
        left = timed.stage.deadline.left()
        if enough and (sum(cand_ms) >= min_time_s * 1e3 or left < timeout_s / 3):
            break
        got_c, got_r = timed(True, per_c), timed(False, per_r)
        got_k = timed.compiled(per_k)
        cand_ms, ref_ms, comp_ms = cand_ms + got_c, ref_ms + got_r, comp_ms + got_k
        per_c, per_r, per_k = (
            calls_in(round_s, statistics.median(got)) if got else per
            for got, per in ((got_c, per_c), (got_r, per_r), (got_k, per_k))
        )
    kc = timing_stats(comp_ms) if timed.compiled_on and comp_ms else None
    return _Samples(
        cand_ms, ref_ms, comp_ms, per_c, timing_stats(cand_ms), timing_stats(ref_ms), kc
    )


class _Checks(NamedTuple):
    """The timing's cross-checks: the outside view of ``calls`` back-to-back calls, the
    empty call's cost (ms: per call, per request) and the flags they raised."""

    outside_ms: float
    calls: int
    empty: tuple[float, float]
    flags: list[str]


def _cross_checks(timed: _Timed, samples: _Samples) -> _Checks:
    """The in-process figure against the grader's clocks."""
    stage, rtt_ns, per_c = timed.stage, timed.rtt_ns, samples.per_candidate
    # Outside view: wall time of K back-to-back calls, minus one request's overhead.
    # Same K calls seen by both clocks: machine noise cancels, a tampered clock does
    # not; a disagreement is measured again (timing_checks.confirmed: host load only
    # adds wall time, so the least disagreeing measurement decides)
    k = max(5, min(10_000, math.ceil(50.0 / max(samples.candidate["mean"], 1e-3))))
    _, outside_ms, said = batch_check(stage, timed.turns, k, rtt_ns)
    said = confirmed(said, lambda: batch_check(stage, timed.turns, k, rtt_ns)[2])
    # the timing loop's own cost, from the candidate-free runner (timing_checks)
    empty = empty_call(stage, per_c, rtt_ns)
    disagree = timer_disagreement(timed.batches, empty[0])
    if disagree is not None:  # measured again, each request right after an empty call
        disagree = paired_again(stage, timed, timed.batches, per_c, rtt_ns)
    flags = [f"{TIMER_DISAGREEMENT}: {said or disagree}"] if said or disagree else []
    return _Checks(outside_ms, k, empty, flags)


class _Fresh(NamedTuple):
    """Fresh inputs after timing: a wrong output's (kind, why), the candidate's median
    time on them (ms), and why a cache is suspected."""

    problem: tuple[str, str] | None
    runtime_ms: float
    cached: str | None


def _fresh_after_timing(
    stage: Stage, ref: RunnerHandle, median_ms: float, empty: tuple[float, float]
) -> _Fresh:
    """Fresh inputs after timing: stale buffers and result caches show up here."""
    seed = stage.session.seed
    fresh_seeds = seed_trials(seed ^ 0xF4E5, FRESH_SETS)
    # the reference makes the first, which it judges; the others only when it
    # sends them (a candidate that makes its own inputs makes every set from its
    # seed): at KernelBench's sizes each is another set on the device
    fresh = [stage.make_inputs(fs) for fs in fresh_seeds[: 1 if stage.own_inputs else None]]
    problem = stage.run_and_check(stage.run_request(fresh[0], fresh_seeds[0]), fresh_seeds[0])
    if problem is not None:
        return _Fresh(problem, 0.0, None)
    # the reference's sets are not needed while the candidate times its fresh
    # ones (the candidate holds two at once): at KernelBench's sizes each is GBs
    fresh_samples, repeated = fresh_timing(stage, ref, fresh_seeds, fresh)
    fresh_ms = statistics.median(fresh_samples or [0.0])
    # no paired calls (none asked for): compare with the timed median
    cached = cache_suspected(fresh_samples, repeated or [median_ms], empty[1])
    # measured again on other fresh sets before it is flagged: a loaded host slows
    # single calls at random, a cache keyed on the inputs is fast on every repeat
    again = iter(range(1, REMEASURE + 1))
    cached = confirmed(
        cached, lambda: cache_again(stage, ref, seed, next(again), empty[1], median_ms)
    )
    return _Fresh(None, fresh_ms, cached)


_TIMER = (
    "time.perf_counter_ns bound at runner start-up before candidate import; one call per "
    "sample; PyTorch eager (and the reference under torch.compile) timed alternately in "
    "a candidate-free runner; cross-checked against the grader's wall clock over a "
    "batch of calls"
)


def _report(
    timed: _Timed,
    samples: _Samples,
    checks: _Checks,
    fresh_ms: float,
    setup: SetUp,
    threads: int,
    start: float,
) -> ProfileReport:
    """The profile of a candidate that ran correctly throughout."""
    c, r, kc, baseline = samples.candidate, samples.eager, samples.compiled, timed.baseline
    best_ref = min(r["mean"], kc["mean"]) if kc is not None else None
    return ProfileReport(
        ok=True,
        runtime_ms=c["mean"],
        runtime_std_ms=c["std"],
        runtime_median_ms=c["median"],
        runtime_min_ms=c["min"],
        runtime_ci95_ms=c["ci95"],
        trials=len(samples.cand_ms),
        ref_runtime_ms=r["mean"],
        ref_runtime_std_ms=r["std"],
        ref_runtime_median_ms=r["median"],
        ref_trials=len(samples.ref_ms),
        ref_runtime_ci95_ms=r["ci95"],
        fresh_runtime_ms=fresh_ms,
        speedup=r["mean"] / c["mean"] if c["mean"] > 0 else 0.0,
        timer=_TIMER,
        outside_wall_ms=checks.outside_ms,
        outside_calls=checks.calls,
        empty_call_ms=checks.empty[0],
        flags=tuple(checks.flags),
        device=timed.stage.device,
        threads=threads,
        duration_s=time.monotonic() - start,
        compiled_runtime_ms=kc["mean"] if kc is not None else None,
        compiled_runtime_std_ms=kc["std"] if kc is not None else 0.0,
        compiled_runtime_median_ms=kc["median"] if kc is not None else 0.0,
        compiled_runtime_ci95_ms=kc["ci95"] if kc is not None else 0.0,
        compiled_trials=len(samples.comp_ms) if kc is not None else 0,
        compile_baseline=baseline.baseline,
        compile_baseline_s=0.0 if baseline.cached else baseline.compile_s,
        compile_baseline_cached=baseline.cached,
        compile_baseline_graphs=baseline.graphs,
        compile_baseline_error=None
        if kc is not None
        else str(timed.compiled_error or "no sample of the compiled reference"),
        speedup_vs_compiled=kc["mean"] / c["mean"] if kc is not None and c["mean"] > 0 else None,
        speedup_vs_best=best_ref / c["mean"] if best_ref is not None and c["mean"] > 0 else None,
        # what the reference runner said: a runner that does not say compiles the default
        # mode and leaves TF32 as PyTorch starts (kf.evaluation.grader.baseline_settings)
        compile_mode=(baseline.mode or "default") if kc is not None else "",
        tf32=baseline_settings.tf32_summary(setup.precision) or "pytorch-default",
    )


def _takes_turns(device: str) -> bool:
    """Whether the runners settle between timed requests (a GPU's caching allocator)."""
    return device.startswith("cuda")
