"""The profile stage's measurements of its timing cross-checks, made through the
runners: the grader's wall clock around a batch, the empty call's cost, a request's
round trip, the fresh-input timings, and each check measured again before it is flagged
(the pure decisions are :mod:`kf.evaluation.grader.timing_checks`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from kf.evaluation.grader.grading import FRESH_SETS, seed_trials, trim_reference
from kf.evaluation.grader.session import Stage
from kf.evaluation.grader.timing_checks import (
    REMEASURE,
    cache_suspected,
    cross_check_flags,
    paired_disagreement,
)
from kf.evaluation.wire.protocol import Batch, Ping, Settle, Time, TimeInputs


def calls_in(round_s: float, est_ms: float) -> int:
    """How many calls of about ``est_ms`` make a timing round of ``round_s`` (1 to 200)."""
    return max(1, min(200, int(round_s * 1e3 / max(est_ms, 1e-3))))


@contextlib.contextmanager
def turn(send: Callable[[Settle], Any], on: bool, *, compiled: bool = False) -> Iterator[None]:
    """One runner's timing turn (when ``on``: the runners take turns on a GPU): the
    untimed call that allocates its temporaries again before, their blocks given back
    after; each a request of its own, outside what the caller times inside."""
    if on:
        send(Settle(warm=True, compiled=compiled))
    yield
    if on:
        send(Settle())


def batch_check(stage: Stage, turns: bool, k: int, rtt_ns: int) -> tuple[float, float, str | None]:
    """``k`` back-to-back calls timed by the runner and by the grader's wall clock: (the
    in-process ms a call, the wall ms a call less the round trip, why the two disagree
    or None: :func:`kf.evaluation.grader.timing_checks.cross_check_flags`)."""
    with turn(stage.candidate, turns):
        t0 = time.perf_counter_ns()
        batch = stage.candidate(Batch(n=k), what=f"a batch of {k} calls")
        outside_ms = max(0.0, (time.perf_counter_ns() - t0 - rtt_ns) / 1e6 / k)
    inside_ms = batch.total_ns / 1e6 / k
    if not cross_check_flags(inside_ms, outside_ms):
        return inside_ms, outside_ms, None
    return (
        inside_ms,
        outside_ms,
        (
            f"in-process {inside_ms:.4f} ms a call, the grader's wall clock {outside_ms:.4f} ms "
            f"over {k} calls (request round trip {rtt_ns / 1e6:.3f} ms subtracted; measured "
            f"{REMEASURE + 1} times)"
        ),
    )


def fresh_timing(
    stage: Stage, ref: Any, seeds: list[int], made: list[Any]
) -> tuple[list[float], list[float]]:
    """The candidate's one call on each fresh input set (made from ``seeds``; ``made``:
    the reference's sets where it sends them) and, paired, one on its timed inputs after
    each, in ms."""
    given = [f.inputs for f in made if f.inputs is not None]
    trim_reference(ref)
    sets = (
        TimeInputs(seeds=seeds, paired=True)
        if stage.own_inputs
        else TimeInputs(inputs=given, paired=True)
    )
    reply = stage.candidate(sets, what="timing fresh inputs")
    return [ns / 1e6 for ns in reply.samples_ns], [ns / 1e6 for ns in reply.repeated_ns]


def cache_again(
    stage: Stage, ref: Any, seed: int, attempt: int, empty_ms: float, median_ms: float
) -> str | None:
    """:func:`cache_suspected` measured again on fresh sets no call has seen (a cache
    filled by the first measurement would make the same sets look repeated)."""
    seeds = seed_trials(seed ^ 0xF4E5 ^ (attempt << 20), FRESH_SETS)
    made = [] if stage.own_inputs else [stage.make_inputs(s) for s in seeds]
    fresh, repeated = fresh_timing(stage, ref, seeds, made)
    return cache_suspected(fresh, repeated or [median_ms], empty_ms)


def paired_again(
    stage: Stage,
    timed: Callable[[bool, int], list[float]],
    batches: list[tuple[int, float, float]],
    n: int,
    rtt_ns: int,
) -> str | None:
    """The per-request check measured again (:func:`kf.evaluation.grader.timing_checks.
    paired_disagreement`): :data:`REMEASURE` candidate requests of ``n`` calls, each
    right after an empty-call request of ``n`` calls in the reference runner, both
    walls less the same round trip (a round trip measured alone under load can exceed a
    whole request, which made the empty call's cost 0); their samples are not the
    profile's."""
    pairs: list[tuple[int, float, float, float]] = []
    for _ in range(REMEASURE):
        with stage.candidate_quiet():
            t0 = time.perf_counter_ns()
            stage.reference(Time(n=n, empty=True), what="an empty call")
            empty_ms = max(0, time.perf_counter_ns() - t0 - rtt_ns) / 1e6 / n
        before = len(batches)
        timed(True, n)
        pairs += [(calls, wall, sampled, empty_ms) for calls, wall, sampled in batches[before:]]
        del batches[before:]
    return paired_disagreement(pairs)


def empty_call(stage: Stage, n: int, rtt_ns: int) -> tuple[float, float]:
    """The timing loop's cost per call around a call that does nothing, in the
    candidate-free runner: (the grader's wall ms less the request's round trip
    ``rtt_ns``, the same the candidate's requests are measured less, the in-process
    sample in ms), each the smaller of two measurements. (A round trip measured again
    right before, under load, could exceed the whole request and make the cost 0.)"""
    n = max(20, n)
    walls: list[float] = []
    inside: list[float] = []
    for _ in range(2):
        with stage.candidate_quiet():
            t0 = time.perf_counter_ns()
            reply = stage.reference(Time(n=n, empty=True), what="an empty call")
            walls.append(max(0, time.perf_counter_ns() - t0 - rtt_ns) / 1e6 / n)
        inside.append(statistics.median([ns / 1e6 for ns in reply.samples_ns] or [0.0]))
    return min(walls), min(inside)


def round_trip_ns(stage: Stage) -> int:
    t0 = time.perf_counter_ns()
    stage.candidate(Ping())
    return time.perf_counter_ns() - t0
