"""The profile stage: the candidate and PyTorch eager (and ``torch.compile``) timed
alternately, with the cross-checks of the timing.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import msgspec

from kf.evaluation import baseline_settings
from kf.evaluation.baseline import (
    _baseline_lost,
    _BaselineLost,
    _compile_baseline,
    compile_baseline_wanted,
)
from kf.evaluation.device import parse_device
from kf.evaluation.grading import (
    _FRESH_SETS,
    CACHE_SUSPECTED,
    OUTPUT_CHANGED,
    TIMER_DISAGREEMENT,
    _after_candidate_failure,
    _candidate,
    _CandidateFailed,
    _Deadline,
    _device_lock,
    _given,
    _loaded_and_checked,
    _own_inputs,
    _phases,
    _ref_key,
    _reference,
    _run_and_check,
    _sandboxed,
    _seed_trials,
    _tol,
    _trimmed,
    log,
)
from kf.evaluation.reports import ProfileReport
from kf.evaluation.sandbox import (
    Limits,
    RunnerCrashed,
    RunnerFailed,
    RunnerHandle,
    RunnerPool,
    RunnerTimeout,
    default_pool,
)
from kf.evaluation.timing_checks import cache_suspected, timer_disagreement
from kf.evaluation.tolerance import Tolerance
from kf.tasks import Task


def timing_stats(samples_ms: list[float]) -> dict[str, float]:
    """Mean, sample std, median, min and the 95% confidence half width of the mean."""
    n = len(samples_ms)
    mean = statistics.fmean(samples_ms)
    std = statistics.stdev(samples_ms) if n > 1 else 0.0
    # Student t for small samples, 1.96 beyond 30.
    t_table = {
        2: 12.71,
        3: 4.30,
        4: 3.18,
        5: 2.78,
        6: 2.57,
        8: 2.36,
        10: 2.26,
        15: 2.14,
        20: 2.09,
        30: 2.04,
    }
    t = next((v for k, v in sorted(t_table.items()) if n <= k), 1.96)
    return {
        "mean": mean,
        "std": std,
        "median": statistics.median(samples_ms),
        "min": min(samples_ms),
        "ci95": t * std / math.sqrt(n) if n > 1 else 0.0,
    }


def cross_check_flags(
    in_process_ms: float, outside_ms: float, *, ratio: float = 1.5, min_gap_ms: float = 0.02
) -> tuple[str, ...]:
    """Flag a disagreement over ``ratio``× (and over ``min_gap_ms``) between the two timers."""
    if in_process_ms <= 0 or outside_ms <= 0:
        return (TIMER_DISAGREEMENT,) if abs(in_process_ms - outside_ms) > min_gap_ms else ()
    r = outside_ms / in_process_ms
    if (r > ratio or r < 1 / ratio) and abs(outside_ms - in_process_ms) > min_gap_ms:
        return (TIMER_DISAGREEMENT,)
    return ()


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
) -> ProfileReport:
    """Time the candidate, PyTorch eager and the reference under ``torch.compile``
    alternately, in separate runners (eager and compiled share the candidate-free one),
    in one session.

    ``compile_baseline`` None follows ``$KF_COMPILE_BASELINE`` (default on). The
    reference is compiled once per model seed and input shapes in its runner, which
    later profiles of the task reuse; a compile that fails is recorded in the report
    (``compile_baseline_error``) and the speed-up is stated against eager only. Raises
    :class:`TaskError` when the task itself is broken.
    """
    since = time.monotonic()
    leased: list[RunnerHandle] = []
    want = compile_baseline_wanted() if compile_baseline is None else compile_baseline
    kw: dict[str, Any] = {
        "device": device,
        "seed": seed,
        "warmup": warmup,
        "min_trials": min_trials,
        "min_time_s": min_time_s,
        "max_trials": max_trials,
        "timeout_s": timeout_s,
        "limits": limits,
        "pool": pool,
        "tolerance": tolerance,
    }
    try:
        report = _profile(task, source, leased, compile_baseline=want, **kw)
    except _BaselineLost:
        # the reference runner was lost to torch.compile; the failure is remembered, so
        # this second session, with fresh runners, times against eager only
        report = _profile(task, source, leased, compile_baseline=want, **kw)
    return _sandboxed(msgspec.structs.replace(report, phases=_phases(since, *leased)), leased)


def _profile(
    task: Task,
    source: str,
    leased: list[RunnerHandle],
    *,
    device: str,
    seed: int,
    warmup: int,
    min_trials: int,
    min_time_s: float,
    max_trials: int,
    timeout_s: float,
    limits: Limits | None,
    pool: RunnerPool | None,
    compile_baseline: bool,
    tolerance: Tolerance | None = None,
) -> ProfileReport:
    """:func:`profile_candidate`; the runners it leases are added to ``leased``.

    Raises :class:`_BaselineLost` when the reference runner died or hung over the
    compiled baseline (remembered, so a second call skips it).
    """
    device = parse_device(device)
    pool = pool or default_pool()
    limits = limits or Limits()
    tol = _tol(task, tolerance)
    with (
        _device_lock(device),
        _trimmed(pool.reference_lease(_ref_key(task, device))) as ref,
        pool.lease() as cand,
    ):
        leased += [ref, cand]
        if not device.startswith("cuda"):
            # replacement runners import torch now, not during a CPU timing; CUDA events
            # time the GPU, which runner start-ups on the host do not slow
            pool.wait_warm()
        start = time.monotonic()
        deadline = _Deadline(timeout_s)
        try:
            made, problem = _loaded_and_checked(
                task, source, ref, cand, device, limits, deadline, seed, tol
            )
            if problem is not None:
                return ProfileReport(
                    ok=False,
                    failure_kind=problem[0],
                    error=f"wrong output before timing: {problem[1]}",
                    device=device,
                    duration_s=time.monotonic() - start,
                )

            baseline = _compile_baseline(task, ref, device, seed, compile_baseline)
            deadline = _Deadline(timeout_s)  # the compile had a time limit of its own
            compiled: dict[str, Any] = {
                "on": baseline.get("error") is None,
                "error": baseline.get("error"),
            }

            rtt_ns = min(_round_trip_ns(task, cand, deadline) for _ in range(3))
            # The grader's own wall clock around every timing request of the candidate:
            # samples forged or shrunk in-process cannot add up to it.
            # Per request: (calls, wall ms less the round trip, sum of the samples in ms).
            batches: list[tuple[int, float, float]] = []

            def timed(handle: RunnerHandle, n: int, is_candidate: bool) -> list[float]:
                call = _candidate if is_candidate else _reference
                t0 = time.perf_counter_ns()
                reply = call(task, handle, "time", deadline, n=n, what=f"timing {n} calls")
                samples = [ns / 1e6 for ns in reply["samples_ns"]]
                if is_candidate:
                    spent = max(0, time.perf_counter_ns() - t0 - rtt_ns) / 1e6
                    batches.append((len(samples), spent, sum(samples)))
                return samples

            def timed_compiled(n: int) -> list[float]:
                """Samples of the compiled reference; none once it has failed."""
                if not compiled["on"]:
                    return []
                try:
                    reply = ref.request(
                        "time", deadline.left(), n=n, compiled=True, what=f"timing {n} compiled"
                    )
                except (RunnerTimeout, RunnerCrashed) as exc:
                    why = f"the compiled reference lost its runner while timed: {exc}"
                    _baseline_lost[f"{_ref_key(task, device)}:{seed}"] = why
                    raise _BaselineLost(why) from exc
                except RunnerFailed as exc:
                    compiled.update(on=False, error=f"the compiled reference failed: {exc}")
                    return []
                return [ns / 1e6 for ns in reply["samples_ns"]]

            est_c = statistics.median(timed(cand, warmup, True) or [1.0])
            batches.clear()  # warm-up calls (first launches, caches) are not compared
            est_r = statistics.median(timed(ref, warmup, False) or [1.0])
            est_k = statistics.median(timed_compiled(warmup) or [0.0])
            round_s = max(min_time_s / 10, 0.01)
            per_round = max(1, min(200, int(round_s * 1e3 / max(est_c, est_r, est_k, 1e-3))))
            cand_ms: list[float] = []
            ref_ms: list[float] = []
            comp_ms: list[float] = []
            while len(cand_ms) < max_trials:
                enough = len(cand_ms) >= min_trials and len(ref_ms) >= min_trials
                enough = enough and (len(comp_ms) >= min_trials or not compiled["on"])
                if enough and (sum(cand_ms) >= min_time_s * 1e3 or deadline.left() < timeout_s / 3):
                    break
                cand_ms += timed(cand, per_round, True)
                ref_ms += timed(ref, per_round, False)
                comp_ms += timed_compiled(per_round)
            c, r = timing_stats(cand_ms), timing_stats(ref_ms)
            kc = timing_stats(comp_ms) if compiled["on"] and comp_ms else None

            # Outside view: wall time of K back-to-back calls, minus one request's overhead.
            k = max(5, min(10_000, math.ceil(50.0 / max(c["mean"], 1e-3))))
            t0 = time.perf_counter_ns()
            batch = _candidate(task, cand, "batch", deadline, n=k, what=f"a batch of {k} calls")
            outside_ms = max(0.0, (time.perf_counter_ns() - t0 - rtt_ns) / 1e6 / k)
            inside_ms = int(batch["total_ns"]) / 1e6 / k
            # Same K calls seen by both clocks: machine noise cancels, a tampered clock does not.
            flags = list(cross_check_flags(inside_ms, outside_ms))
            # the timing loop's own cost, from the candidate-free runner (timing_checks)
            empty = _empty_call(task, ref, deadline, per_round)
            disagree = timer_disagreement(batches, empty[0])
            if not flags and disagree is not None:
                flags.append(f"{TIMER_DISAGREEMENT}: {disagree}")
            elif flags:
                flags = [
                    f"{TIMER_DISAGREEMENT}: in-process {inside_ms:.4f} ms a call, the grader's "
                    f"wall clock {outside_ms:.4f} ms over {k} calls (request round trip "
                    f"{rtt_ns / 1e6:.3f} ms subtracted)"
                ]

            if (
                _run_and_check(
                    task,
                    ref,
                    cand,
                    given=_given(cand, device, made, seed),
                    seed=seed,
                    deadline=deadline,
                    tol=tol,
                )
                is not None
            ):
                flags.append(f"{OUTPUT_CHANGED}: the timed inputs' output is wrong after timing")

            # Fresh inputs after timing: stale buffers and result caches show up here.
            fresh = [
                _reference(
                    task, ref, "make_inputs", deadline, seed=fs, send=not _own_inputs(cand, device)
                )
                for fs in _seed_trials(seed ^ 0xF4E5, _FRESH_SETS)
            ]
            fresh_seed = _seed_trials(seed ^ 0xF4E5, _FRESH_SETS)[0]
            problem = _run_and_check(
                task,
                ref,
                cand,
                given=_given(cand, device, fresh[0], fresh_seed),
                seed=fresh_seed,
                deadline=deadline,
                tol=tol,
            )
            if problem is not None:
                return ProfileReport(
                    ok=False,
                    failure_kind="stale_output",
                    error=f"wrong output on fresh inputs after timing: {problem[1]}",
                    device=device,
                    flags=tuple(flags),
                    duration_s=time.monotonic() - start,
                )
            reply = _candidate(
                task,
                cand,
                "time_inputs",
                deadline,
                **(
                    {"seeds": _seed_trials(seed ^ 0xF4E5, _FRESH_SETS)}
                    if _own_inputs(cand, device)
                    else {"inputs": [f["inputs"] for f in fresh]}
                ),
                paired=True,
                what="timing fresh inputs",
            )
            fresh_samples = [ns / 1e6 for ns in reply["samples_ns"]]
            fresh_ms = statistics.median(fresh_samples or [0.0])
            # older runners answer without the paired calls: compare with the timed median
            repeated = [ns / 1e6 for ns in reply.get("repeated_ns") or []] or [c["median"]]
            cached = cache_suspected(fresh_samples, repeated, empty[1])
            if cached is not None:
                flags.append(f"{CACHE_SUSPECTED}: {cached}")
            flags += [f for f in cand.findings if f not in flags]
        except _CandidateFailed as exc:
            _after_candidate_failure(ref, exc, device)
            log.info("candidate_profile_failed", task=task.name, kind=exc.kind)
            return ProfileReport(
                ok=False,
                failure_kind=exc.kind,
                error=exc.error,
                device=device,
                duration_s=time.monotonic() - start,
            )
    timer = (
        "time.perf_counter_ns bound at runner start-up before candidate import; one call per "
        "sample; PyTorch eager (and the reference under torch.compile) timed alternately in "
        "a candidate-free runner; cross-checked against the grader's wall clock over a "
        "batch of calls"
    )
    best_ref = min(r["mean"], kc["mean"]) if kc is not None else None
    report = ProfileReport(
        ok=True,
        runtime_ms=c["mean"],
        runtime_std_ms=c["std"],
        runtime_median_ms=c["median"],
        runtime_min_ms=c["min"],
        runtime_ci95_ms=c["ci95"],
        trials=len(cand_ms),
        ref_runtime_ms=r["mean"],
        ref_runtime_std_ms=r["std"],
        ref_runtime_median_ms=r["median"],
        ref_trials=len(ref_ms),
        ref_runtime_ci95_ms=r["ci95"],
        fresh_runtime_ms=fresh_ms,
        speedup=r["mean"] / c["mean"] if c["mean"] > 0 else 0.0,
        timer=timer,
        outside_wall_ms=outside_ms,
        outside_calls=k,
        empty_call_ms=empty[0],
        flags=tuple(flags),
        device=device,
        threads=cand.threads,
        duration_s=time.monotonic() - start,
        compiled_runtime_ms=kc["mean"] if kc is not None else None,
        compiled_runtime_std_ms=kc["std"] if kc is not None else 0.0,
        compiled_runtime_median_ms=kc["median"] if kc is not None else 0.0,
        compiled_runtime_ci95_ms=kc["ci95"] if kc is not None else 0.0,
        compiled_trials=len(comp_ms) if kc is not None else 0,
        compile_baseline=str(baseline.get("baseline", "")),
        compile_baseline_s=0.0 if baseline.get("cached") else float(baseline.get("compile_s", 0.0)),
        compile_baseline_cached=bool(baseline.get("cached")),
        compile_baseline_graphs=int(baseline.get("graphs", 0)),
        compile_baseline_error=None
        if kc is not None
        else str(compiled["error"] or "no sample of the compiled reference"),
        speedup_vs_compiled=kc["mean"] / c["mean"] if kc is not None and c["mean"] > 0 else None,
        speedup_vs_best=best_ref / c["mean"] if best_ref is not None and c["mean"] > 0 else None,
        # what the reference runner said: a runner that does not say compiles the default
        # mode and leaves TF32 as PyTorch starts (kf.evaluation.baseline_settings)
        compile_mode=str(baseline.get("mode") or "default") if kc is not None else "",
        tf32=baseline_settings.tf32_summary(made.get("precision")) or "pytorch-default",
    )
    log.info(
        "candidate_profiled",
        task=task.name,
        runtime_ms=report.runtime_ms,
        speedup=report.speedup,
        speedup_vs_compiled=report.speedup_vs_compiled,
        flags=report.flags,
    )
    return report


def _empty_call(task: Task, ref: RunnerHandle, deadline: _Deadline, n: int) -> tuple[float, float]:
    """The timing loop's cost per call around a call that does nothing, in the
    candidate-free runner: (the grader's wall ms less the request's round trip, the
    in-process sample in ms), each the smaller of two measurements."""
    n = max(20, n)
    walls: list[float] = []
    inside: list[float] = []
    for _ in range(2):
        t0 = time.perf_counter_ns()
        _reference(task, ref, "ping", deadline)
        rtt = time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        reply = _reference(task, ref, "time", deadline, n=n, empty=True, what="an empty call")
        walls.append(max(0, time.perf_counter_ns() - t0 - rtt) / 1e6 / n)
        inside.append(statistics.median([ns / 1e6 for ns in reply["samples_ns"]] or [0.0]))
    return min(walls), min(inside)


def _round_trip_ns(task: Task, handle: RunnerHandle, deadline: _Deadline) -> int:
    t0 = time.perf_counter_ns()
    _candidate(task, handle, "ping", deadline)
    return time.perf_counter_ns() - t0
