"""The tuner: a kernel's template parameters tuned per input shape set on this device.

It answers the archive's ``search.tuning_requested`` for this worker's device (search
versions 3 and 4; see :mod:`agents.archive_tuning`): for the requested kernel (an elite),
which declares a parameter space (a ``kf:params`` block), and for each shape set of the task
(:mod:`kf.kernels.tuning`: set 0 is the task's own ``get_inputs()``, then its
``get_tuning_inputs()``), it climbs the space from the kernel's own configuration: time
the configurations one step away in one parameter (in a seeded order), move to the
fastest, repeat until no neighbour is faster or the shape set's share of the budget is
spent. The fastest configuration found and the kernel's own are then timed once more
each, and the best counts as ``improved`` only if it beat the kernel's own in both
rounds by more than the timings' noise (no 95% interval of it reaches any of the
kernel's own; :func:`improvement`). One ``tuning.config_tuned`` per shape set records every trial.

Budget (run config): ``tune_budget`` configurations timed per request, over all shape
sets (each gets an equal share, at least 4: two for the climb, two for the final check;
shape sets beyond what the budget affords are not tuned), at most ``tune_shapes`` (4)
shape sets. Measurements use :func:`kf.evaluation.profile_candidate` under the device's
exclusive timing gate, so they never overlap another stage's timing.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Sequence
from typing import Any

import msgspec

from agents.evaluator import EvaluatorAgent, EvaluatorState
from kf.config import RunConfig
from kf.devices.gate import gate_for
from kf.evaluation import profile_candidate
from kf.evaluation.grader.task_check import run_task_check
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.kernels import params
from kf.kernels.tasks import Task, TaskError, TaskInfo
from kf.kernels.tuning import MIN_PER_SHAPE, shape_sets
from kf.llm_facts import ConfigTuned, TuningTrial
from kf.search_facts import CandidateProposed, TuningRequested

__all__ = ["MIN_PER_SHAPE", "Tuner", "TunerState", "improvement"]


class TunerState(EvaluatorState, kw_only=True):
    """Sources and tasks (as every evaluator), plus the run config and what was tuned."""

    config: RunConfig = RunConfig()
    tuned: dict[str, str] = {}  # task → candidate id last asked for on this device


def improvement(base: Sequence[TuningTrial], best: Sequence[TuningTrial]) -> tuple[bool, str]:
    """Whether ``best`` beat ``base`` by more than the noise, and how: in every round, and
    with the slowest of ``best``'s 95% intervals' upper ends below the fastest of
    ``base``'s lower ends (the intervals of the two never overlap)."""
    if not base or not best or not all(t.ok and t.runtime_ms > 0 for t in (*base, *best)):
        return False, "a timing failed"
    b = sum(t.runtime_ms for t in base) / len(base)
    x = sum(t.runtime_ms for t in best) / len(best)
    b_low = min(t.runtime_ms - t.runtime_ci95_ms for t in base)
    x_high = max(t.runtime_ms + t.runtime_ci95_ms for t in best)
    wins = all(y.runtime_ms < a.runtime_ms for a, y in zip(base, best, strict=False))
    ok = wins and x_high < b_low
    return ok, (
        f"{x:.4f} ms (at most {x_high:.4f}) vs {b:.4f} ms (at least {b_low:.4f}) for the "
        f"kernel's own configuration over {len(base)} rounds, {b / x:.2f}x: "
        + ("improved beyond the noise" if ok else "not beyond the noise")
    )


class Tuner(EvaluatorAgent):
    """Climbs a kernel's parameter space per input shape set on this device."""

    kind = "tuner"
    listens = (RunStarted, CandidateProposed, TuningRequested)

    def initial_state(self) -> TunerState:
        return TunerState()

    def evolve(self, state: EvaluatorState, rec: Record) -> EvaluatorState:
        assert isinstance(state, TunerState)
        super().evolve(state, rec)
        ev = rec.event
        if isinstance(ev, RunStarted):
            state.config = ev.run_config()
        elif isinstance(ev, TuningRequested) and self.mine(ev.device_id):
            state.tuned[ev.task] = ev.candidate_id
        return state

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        assert isinstance(state, TunerState)
        ev = rec.event
        if not isinstance(ev, TuningRequested) or not self.mine(ev.device_id):
            return ()
        cid = ev.candidate_id
        found = self.lookup(state, ev.task, cid)
        if found is None:
            return [self._ended(ev, "", {}, f"candidate {cid} was never proposed in this run")]
        task, source = found
        try:
            parsed = params.parse(source)
        except params.ParamsError as exc:
            return [self._ended(ev, source, {}, f"its kf:params block is invalid: {exc}")]
        if parsed is None:
            return [self._ended(ev, source, {}, "it declares no template parameters")]
        space, config = parsed
        limit = max(1, state.config.tuning.tune_shapes)
        shapes: list[tuple[int, Task, TaskInfo]] = []
        for index, shaped in shape_sets(task, limit):
            try:
                info = await asyncio.to_thread(
                    run_task_check,
                    shaped,
                    device=self.device,
                    timeout_s=self.timeout_s,
                    conditions=state.conditions,
                )
            except TaskError as exc:
                if index == 0:
                    return [self._ended(ev, source, config, f"the task failed: {exc}")]
                break  # no more tuning shape sets
            shapes.append((index, shaped, info))
        affordable = max(1, ev.budget // MIN_PER_SHAPE)
        shapes = shapes[:affordable]
        share = max(2, ev.budget // len(shapes))
        out: list[ConfigTuned] = []
        for index, shaped, info in shapes:
            rng = random.Random(_seed(state.seed, ev.task, self.device_id, index))
            out.append(
                await self._tune_shape(
                    ev, state, source, space, config, index, shaped, info, share, rng
                )
            )
        out[-1] = msgspec.structs.replace(out[-1], last=True)
        return out

    async def _tune_shape(
        self,
        ev: TuningRequested,
        state: EvaluatorState,
        source: str,
        space: params.ParamSpace,
        config: params.Config,
        index: int,
        task: Task,
        info: TaskInfo,
        share: int,
        rng: random.Random,
    ) -> ConfigTuned:
        seed = _seed(0, ev.task, index, "timing") % (2**31)
        climb = max(1, share - 2)
        timed: dict[str, TuningTrial] = {}
        trials: list[TuningTrial] = []

        async def time(cfg: params.Config) -> TuningTrial:
            trial = await self._time(state, task, source, cfg, seed)
            trials.append(trial)
            timed[params.config_key(cfg)] = trial
            return trial

        base = await time(dict(config))
        current: params.Config = dict(config)
        while len(trials) < climb:
            around = [
                n for n in params.neighbours(space, current) if params.config_key(n) not in timed
            ]
            rng.shuffle(around)
            if not around:
                break
            for cfg in around[: climb - len(trials)]:
                await time(cfg)
            ok = [t for t in timed.values() if t.ok]
            if not ok:
                break
            fastest = min(ok, key=lambda t: t.runtime_ms)
            if params.config_key(fastest.config) == params.config_key(current):
                break  # a local optimum
            current = dict(fastest.config)
        ok = [t for t in timed.values() if t.ok]
        best = min(ok, key=lambda t: t.runtime_ms) if ok else None
        improved, how = False, "no configuration other than the kernel's own was faster"
        if (
            best is not None
            and base.ok
            and params.config_key(best.config) != params.config_key(config)
        ):
            again_base = await time(dict(config))
            again_best = await time(dict(best.config))
            improved, how = improvement([base, again_base], [best, again_best])
        elif not base.ok:
            how = f"the kernel's own configuration failed at this shape: {base.error or ''}"
        return ConfigTuned(
            task=ev.task,
            candidate_id=ev.candidate_id,
            device_id=self.device_id,
            family=params.family(source),
            shape_index=index,
            shape=str(info.input_shapes),
            baseline_config=dict(config),
            best_config=dict(best.config) if best else None,
            best_ms=best.runtime_ms if best else None,
            baseline_ms=base.runtime_ms if base.ok else None,
            trials=tuple(trials),
            note=f"{len(trials)} timings of {len(timed)} of {params.size(space)} "
            f"configurations; {how}",
            requested=True,
            improved=improved,
        )

    def _ended(
        self, ev: TuningRequested, source: str, config: dict[str, Any], why: str
    ) -> ConfigTuned:
        return ConfigTuned(
            task=ev.task,
            candidate_id=ev.candidate_id,
            device_id=self.device_id,
            family=params.family(source),
            shape_index=0,
            shape="",
            baseline_config=dict(config),
            note=f"not tuned: {why[:500]}",
            requested=True,
            last=True,
        )

    async def _time(
        self, state: EvaluatorState, task: Task, source: str, config: dict[str, Any], seed: int
    ) -> TuningTrial:
        """One timing of ``config``, under the run's tolerance and conditions."""
        async with await gate_for(self.device).exclusive("tuner"):
            report = await asyncio.to_thread(
                profile_candidate,
                task,
                params.apply(source, config),
                device=self.device,
                seed=seed,
                warmup=2,
                min_trials=5,
                min_time_s=0.1,
                timeout_s=self.timeout_s,
                compile_baseline=False,  # a trial ranks configurations: eager suffices
                tolerance=state.tolerance,
                conditions=state.conditions,
            )
        return TuningTrial(
            config=dict(config),
            ok=report.ok,
            runtime_ms=report.runtime_ms,
            runtime_std_ms=report.runtime_std_ms,
            ref_runtime_ms=report.ref_runtime_ms,
            error=report.error,
            runtime_ci95_ms=report.runtime_ci95_ms,
        )

    def snapshot(self, state: EvaluatorState) -> Any:
        assert isinstance(state, TunerState)
        return msgspec.to_builtins({"tuned": state.tuned})


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big")
