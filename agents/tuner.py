"""The tuner: template parameters tuned per input shape and per device.

When a candidate that declares a parameter space (a ``kf:params`` block) becomes an
elite, the tuner times its configuration and its neighbours (one step in one
parameter's list, in ``SPACE`` order) on this worker's device, for each input shape set
the task defines, and records per shape the configurations timed and the best one
(``ConfigTuned``). Measurements use :func:`kf.evaluation.profile_candidate` under the
device's exclusive timing gate, so they never overlap the profiler's.

Shapes: a task may define ``get_tuning_inputs()`` returning a list of input lists (each
like ``get_inputs()``, all valid for the same ``get_init_inputs()``); the tuner then
tunes each of the first ``tune_shapes`` of them. Without it, the one shape of
``get_inputs()`` is tuned. Budget (run config): ``tune_per_task`` elites tuned per task
(default 1), ``tune_evals`` configurations per shape (default 4, the incumbent
included), ``tune_shapes`` shape sets (default 3).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec

from agents.evaluator import EvaluatorAgent, EvaluatorState, gate_for
from kf import params
from kf.evaluation import profile_candidate
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.llm_facts import ConfigTuned, TuningTrial
from kf.search_facts import CandidateProposed, EliteAdmitted
from kf.tasks import Task, TaskError, check_task

__all__ = ["Tuner", "TunerState", "shape_tasks"]


class TunerState(EvaluatorState, kw_only=True):
    """Sources and tasks (as every evaluator), plus what was chosen for tuning."""

    config: dict[str, Any] = {}
    tuned: dict[str, int] = {}  # task → elites chosen for tuning
    todo: dict[str, str] = {}  # EliteAdmitted event id → candidate id
    chosen: set[str] = set()


def shape_tasks(task: Task, limit: int) -> list[tuple[int, Task]]:
    """The task once per tuning shape set: ``get_inputs`` rebound to the i-th set."""
    if "def get_tuning_inputs" not in task.source:
        return [(0, task)]
    out = []
    for i in range(limit):
        src = f"{task.source}\n\ndef get_inputs():\n    return list(get_tuning_inputs()[{i}])\n"
        out.append((i, Task.from_source(task.name, src, path=task.path)))
    return out


class Tuner(EvaluatorAgent):
    """Times an elite's configuration and its neighbours per input shape on this device."""

    kind = "tuner"
    listens = (RunStarted, CandidateProposed, EliteAdmitted)

    def initial_state(self) -> TunerState:
        return TunerState()

    def evolve(self, state: EvaluatorState, rec: Record) -> EvaluatorState:
        assert isinstance(state, TunerState)
        super().evolve(state, rec)
        ev = rec.event
        if isinstance(ev, RunStarted):
            state.config = dict(ev.config)
        elif isinstance(ev, EliteAdmitted) and ev.migrated_from is None:
            src = state.sources.get(ev.candidate_id, "")
            limit = int(state.config.get("tune_per_task", 1))
            if (
                ev.candidate_id not in state.chosen
                and state.tuned.get(ev.task, 0) < limit
                and "kf:params" in src
            ):
                state.tuned[ev.task] = state.tuned.get(ev.task, 0) + 1
                state.chosen.add(ev.candidate_id)
                state.todo[rec.event_id] = ev.candidate_id
        return state

    async def react(self, state: EvaluatorState, rec: Record) -> Sequence[Event]:  # type: ignore[override]
        assert isinstance(state, TunerState)
        cid = state.todo.pop(rec.event_id, None)
        ev = rec.event
        if cid is None or not isinstance(ev, EliteAdmitted):
            return ()
        found = self.lookup(state, ev.task, cid)
        if found is None:
            return ()
        task, source = found
        try:
            parsed = params.parse(source)
        except params.ParamsError:
            return ()
        if parsed is None:
            return ()
        space, config = parsed
        evals = max(1, int(state.config.get("tune_evals", 4)))
        configs = [dict(config), *params.neighbours(space, config)][:evals]
        out: list[Event] = []
        for index, shaped in shape_tasks(task, int(state.config.get("tune_shapes", 3))):
            try:
                info = await asyncio.to_thread(
                    check_task, shaped, device=self.device, timeout_s=self.timeout_s
                )
            except TaskError as exc:
                if index == 0:
                    out.append(self._skipped(ev, cid, source, config, index, str(exc)))
                break  # no more tuning shape sets
            trials = [await self._time(shaped, source, cfg, state.seed) for cfg in configs]
            ok = [t for t in trials if t.ok]
            best = min(ok, key=lambda t: t.runtime_ms) if ok else None
            out.append(
                ConfigTuned(
                    task=ev.task,
                    candidate_id=cid,
                    device_id=self.device_id,
                    family=params.family(source),
                    shape_index=index,
                    shape=str(info.input_shapes),
                    baseline_config=dict(config),
                    best_config=dict(best.config) if best else None,
                    best_ms=best.runtime_ms if best else None,
                    baseline_ms=trials[0].runtime_ms if trials[0].ok else None,
                    trials=tuple(trials),
                    note=f"{len(trials)} of {params.size(space)} configurations timed",
                )
            )
        return out

    def _skipped(
        self, ev: EliteAdmitted, cid: str, source: str, config: dict[str, Any], i: int, why: str
    ) -> ConfigTuned:
        return ConfigTuned(
            task=ev.task,
            candidate_id=cid,
            device_id=self.device_id,
            family=params.family(source),
            shape_index=i,
            shape="",
            baseline_config=dict(config),
            note=f"not tuned: the task's shape set {i} failed: {why[:500]}",
        )

    async def _time(
        self, task: Task, source: str, config: dict[str, Any], seed: int
    ) -> TuningTrial:
        async with await gate_for(self.device).exclusive():
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
            )
        return TuningTrial(
            config=dict(config),
            ok=report.ok,
            runtime_ms=report.runtime_ms,
            runtime_std_ms=report.runtime_std_ms,
            ref_runtime_ms=report.ref_runtime_ms,
            error=report.error,
        )

    def snapshot(self, state: EvaluatorState) -> Any:
        assert isinstance(state, TunerState)
        return msgspec.to_builtins({"tuned": state.tuned})
