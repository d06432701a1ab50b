"""The offline mutator: template-parameter mutation and recombination, no LLM.

It proposes every task's seed kernels when the run starts, then answers each
``ParentSelected`` with a new candidate: the parent's ``CONFIG`` mutated within its
declared ``SPACE`` (one or two parameters), or uniformly recombined with a second parent
of the same template family. Its choices are seeded by the selection's ``rng_seed``; it
avoids sources already proposed for the task. It says what it is in every candidate it
proposes (``mutator`` field): it never passes its output off as a model's.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

import msgspec

from agents.tuned import seed_candidates, tuned_candidate
from kf.agent import Agent
from kf.events import Event, Record, derived_id
from kf.facts import RunStarted
from kf.kernels import params
from kf.search_facts import CandidateProposed, MutationFailed, ParentSelected, TunedChosen

__all__ = ["OFFLINE_MUTATOR", "MutatorState", "OfflineMutator"]

OFFLINE_MUTATOR = "offline (no LLM): template-parameter mutation and recombination"
_ATTEMPTS = 48
_GRID_LIMIT = 20_000  # spaces up to this size are enumerated when jumping


class MutatorState(msgspec.Struct, kw_only=True):
    """Seeds of the run's tasks, every proposed source, and what each task has seen."""

    run_id: str = ""
    islands: int = 1
    device: str = "cpu"
    seeds: dict[str, list[tuple[str, str]]] = {}
    sources: dict[str, str] = {}  # candidate id → source
    seen: dict[str, set[str]] = {}  # task → sha256 of proposed sources


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


class OfflineMutator(Agent[MutatorState]):
    """Proposes seeds, then tunes and recombines template parameters of selected parents."""

    kind = "mutator"
    listens = (RunStarted, CandidateProposed, ParentSelected, TunedChosen)

    def initial_state(self) -> MutatorState:
        return MutatorState()

    def evolve(self, state: MutatorState, rec: Record) -> MutatorState:
        ev = rec.event
        if isinstance(ev, RunStarted):
            state.run_id = ev.run_id
            config = ev.run_config()
            state.islands = config.search.islands or 1
            state.device = config.evaluation.device
            state.seeds = {t.name: list(t.seeds) for t in ev.tasks}
        elif isinstance(ev, CandidateProposed):
            state.sources[ev.candidate_id] = ev.source
            state.seen.setdefault(ev.task, set()).add(_digest(ev.source))
        return state

    def react(self, state: MutatorState, rec: Record) -> Sequence[Event]:
        ev = rec.event
        if isinstance(ev, RunStarted):
            return seed_candidates(state, rec.event_id, mutator=OFFLINE_MUTATOR)
        if isinstance(ev, ParentSelected):
            return [self._child(state, ev, rec.event_id)]
        if isinstance(ev, TunedChosen):
            return [tuned_candidate(state.sources, ev, rec.event_id, island=0, device=state.device)]
        return ()

    def _child(self, state: MutatorState, ev: ParentSelected, event_id: str) -> Event:
        def failed(reason: str) -> MutationFailed:
            return MutationFailed(
                task=ev.task, selection=ev.selection, reason=reason, mutator=OFFLINE_MUTATOR
            )

        parent = state.sources.get(ev.parent_id)
        if parent is None:
            return failed(f"parent {ev.parent_id} was never proposed in this run")
        try:
            parsed = params.parse(parent)
        except params.ParamsError as exc:
            return failed(f"parent's kf:params block is invalid: {exc}")
        if parsed is None:
            return failed(
                "parent declares no template parameters; the offline mutator only tunes "
                "parameters and recombines variants (configure an LLM to rewrite code)"
            )
        space, config = parsed
        rng = random.Random(ev.rng_seed)
        seen = state.seen.get(ev.task, set())
        note = ""
        start: dict[str, Any] = dict(config)
        if ev.operator == "crossover" and ev.second_parent_id in state.sources:
            other = params.parse(state.sources[ev.second_parent_id])
            if other is not None and params.family(
                state.sources[ev.second_parent_id]
            ) == params.family(parent):
                start = params.crossover(space, config, other[1], rng)
                note = f"uniform crossover with {ev.second_parent_id}"
        for attempt in range(_ATTEMPTS):
            if attempt == 0 and note and start != config:
                child = start
            else:
                n = 1 if rng.random() < 0.6 else 2
                child = params.mutate(space, start, rng, n_changes=min(n, len(space.names)))
            source = params.apply(parent, child)
            if _digest(source) not in seen:
                changed = sorted(k for k in child if child[k] != config.get(k))
                return CandidateProposed(
                    candidate_id=derived_id("candidate", event_id),
                    task=ev.task,
                    source=source,
                    operator=ev.operator if note and attempt == 0 else "mutate",
                    mutator=OFFLINE_MUTATOR,
                    island=ev.island,
                    selection=ev.selection,
                    parent_id=ev.parent_id,
                    second_parent_id=ev.second_parent_id if note else None,
                    device=state.device,
                    family=params.family(source),
                    config=dict(child),
                    note=note or f"changed {', '.join(changed)}",
                )
        # the neighbourhood is explored: jump to an unexplored point anywhere in the space
        size = params.size(space)
        pool = (
            list(params.grid(space))
            if size <= _GRID_LIMIT
            else [
                params.mutate(space, config, rng, n_changes=len(space.names))
                for _ in range(_ATTEMPTS)
            ]
        )
        rng.shuffle(pool)
        for child in pool:
            source = params.apply(parent, child)
            if _digest(source) not in seen:
                return CandidateProposed(
                    candidate_id=derived_id("candidate", event_id),
                    task=ev.task,
                    source=source,
                    operator="jump",
                    mutator=OFFLINE_MUTATOR,
                    island=ev.island,
                    selection=ev.selection,
                    parent_id=ev.parent_id,
                    device=state.device,
                    family=params.family(source),
                    config=dict(child),
                    note=f"no unexplored neighbour after {_ATTEMPTS} tries: a random unexplored "
                    "point of the space",
                )
        return failed(
            f"every configuration of the parent's space ({size} points) was already proposed"
            if size <= _GRID_LIMIT
            else f"no unexplored configuration found in {2 * _ATTEMPTS} tries ({size} points)"
        )
