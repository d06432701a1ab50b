"""A challenger timed against the task's incumbent, side by side.

When a challenger's speed-up is within the noise of the incumbent's, the profile's
figure alone cannot rank them (:mod:`kf.evaluation.grader.policy`). Both are loaded in
fresh runners of one session, each checked once on the session seed's inputs, and timed
in alternating rounds on the same device, each round giving both about the same time.
The pairing only ever lowers a challenger's stated speed-up (the policy takes the lower
figure), so neither side can gain by behaving differently here.

It replaced four whole profiles (each loading its candidate, timing eager and
``torch.compile``, the cross-checks and fresh inputs): a retime cost about 17 s of a
140 s CPU run; the pairing times only the two candidates.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.grading import CandidateFailed, log
from kf.evaluation.grader.measuring import calls_in, turn
from kf.evaluation.grader.sandbox import Limits, RunnerError, RunnerPool
from kf.evaluation.grader.session import GradingSession, Stage
from kf.evaluation.wire.protocol import Time
from kf.evaluation.wire.tolerance import Tolerance
from kf.kernels.tasks import Task, TaskError

__all__ = ["MAX_ROUNDS", "paired_times"]

#: at most this many rounds, however short the calls
MAX_ROUNDS = 20


def paired_times(
    task: Task,
    challenger: str,
    incumbent: str,
    *,
    device: str = "cpu",
    seed: int = 0,
    warmup: int = 5,
    min_trials: int = 20,
    min_time_s: float = 0.5,
    timeout_s: float = 120.0,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
    tolerance: Tolerance | None = None,
    conditions: Conditions | None = None,
    alone: Callable[[], AbstractContextManager[object]] | None = None,
    **_: Any,
) -> tuple[list[float], list[float]] | None:
    """The challenger's and the incumbent's samples (ms), timed in alternating rounds
    until each has ``min_trials`` and the challenger ``min_time_s``; None when either
    fails to load, gives a wrong output or fails while timed (the caller keeps what it
    measured before). The other arguments are :func:`profile_candidate`'s."""
    sessions = [
        GradingSession(
            task=task,
            source=src,
            device=device,
            seed=seed,
            pool=pool,
            limits=limits or Limits(),
            timeout_s=timeout_s,
            tolerance=tolerance,
            conditions=conditions,
            alone=alone,
        )
        for src in (challenger, incumbent)
    ]
    mine, theirs = Stage(sessions[0]), Stage(sessions[1])
    try:
        with (
            mine.reference_lease(trimmed=True) as ref,
            mine.candidate_lease(),
            theirs.candidate_lease(),
        ):
            theirs.use(ref=ref)  # one reference runner makes both sides' inputs
            for stage in (mine, theirs):  # loaded and checked sharing the device
                if stage.loaded_and_checked()[2] is not None:
                    return None
            with mine.session.exclusively():  # timed with the device to themselves
                if not device.startswith("cuda"):
                    mine.session.runners.wait_warm()  # no runner start-up during CPU timing
                for stage in (mine, theirs):
                    stage.restart_clock()
                return _rounds(mine, theirs, warmup, min_trials, min_time_s)
    except (CandidateFailed, TaskError, RunnerError) as exc:
        log.info("paired_retime_failed", task=task.name, error=str(exc)[:200])
        return None


def _rounds(
    mine: Stage, theirs: Stage, warmup: int, min_trials: int, min_time_s: float
) -> tuple[list[float], list[float]]:
    """Alternate the two candidates' timing requests, the incumbent first each round."""
    turns = mine.device.startswith("cuda")

    def timed(stage: Stage, n: int) -> list[float]:
        with turn(stage.candidate, turns):
            reply = stage.candidate(Time(n=n), what=f"timing {n} calls, paired")
        return [ns / 1e6 for ns in reply.samples_ns]

    round_s = max(min_time_s / 10, 0.01)
    per = {
        id(s): calls_in(round_s, statistics.median(timed(s, warmup) or [1.0]))
        for s in (theirs, mine)
    }
    a: list[float] = []
    b: list[float] = []
    for _ in range(MAX_ROUNDS):
        if min(len(a), len(b)) >= min_trials and sum(a) >= min_time_s * 1e3:
            break
        if mine.deadline.left() < mine.deadline.timeout_s / 3:
            break
        for stage, into in ((theirs, b), (mine, a)):
            got = timed(stage, per[id(stage)])
            into.extend(got)
            # from what this round measured, as the profile does: a warm-up's first
            # calls are slow and would make every round short
            per[id(stage)] = calls_in(round_s, statistics.median(got)) if got else per[id(stage)]
    return a, b
