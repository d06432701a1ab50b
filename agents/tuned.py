"""The candidates a mutator proposes with no LLM involved: the tasks' seed kernels, and
the one a ``search.tuned_chosen`` decision asks for (the parent kernel with the
configuration a tuner found best for one shape set on one device).

Both mutators (offline and LLM) propose seeds with :func:`seed_candidates` and answer the
decision with :func:`tuned_candidate`, so a run proposes them whichever mutator it uses.
"""

from __future__ import annotations

from typing import Protocol

from kf.events import Event, derived_id
from kf.kernels import params
from kf.search_facts import CandidateProposed, MutationFailed, TunedChosen

__all__ = ["TUNER_LABEL", "Seeding", "seed_candidates", "tuned_candidate"]

TUNER_LABEL = "tuner (no LLM): a template configuration timed per shape and device"


class Seeding(Protocol):
    """What a mutator's state knows of the run when it proposes the seeds."""

    @property
    def seeds(self) -> dict[str, list[tuple[str, str]]]: ...  # task → (name, source)
    @property
    def islands(self) -> int: ...
    @property
    def device(self) -> str: ...


def seed_candidates(state: Seeding, event_id: str, *, mutator: str) -> list[Event]:
    """``CandidateProposed`` (operator ``seed``) for each task's seeds, named (``name``,
    ``source``) and spread over the islands in turn; a seed whose kf:params block is
    missing or broken is proposed with no configuration."""
    islands, device = state.islands, state.device
    out: list[Event] = []
    for task, named in state.seeds.items():
        for i, (name, source) in enumerate(named):
            try:
                parsed = params.parse(source)
            except params.ParamsError:
                parsed = None
            out.append(
                CandidateProposed(
                    candidate_id=derived_id("seed", event_id, task, name),
                    task=task,
                    source=source,
                    operator="seed",
                    mutator=mutator,
                    island=i % islands,
                    device=device,
                    family=params.family(source),
                    config=dict(parsed[1]) if parsed else {},
                    note=f"seed kernel {name}",
                )
            )
    return out


def tuned_candidate(
    sources: dict[str, str], ev: TunedChosen, event_id: str, *, island: int, device: str
) -> Event:
    """``CandidateProposed`` (operator ``tune``) for the decision, or why there is none."""
    parent = sources.get(ev.parent_id)
    why = ""
    if parent is None:
        why = f"parent {ev.parent_id} was never proposed in this run"
    else:
        try:
            source = params.apply(parent, ev.config)
        except params.ParamsError as exc:
            why = f"the tuned configuration does not apply to the parent: {exc}"
    if why or parent is None:
        return MutationFailed(task=ev.task, selection=-1, reason=why, mutator=TUNER_LABEL)
    where = "the task's own shapes" if ev.shape_index == 0 else f"shape set {ev.shape_index}"
    timing = (
        f": {ev.best_ms:.4f} ms vs {ev.baseline_ms:.4f} ms for the parent's configuration"
        if ev.best_ms is not None and ev.baseline_ms is not None
        else ""
    )
    return CandidateProposed(
        candidate_id=derived_id("tuned", event_id),
        task=ev.task,
        source=source,
        operator="tune",
        mutator=TUNER_LABEL,
        island=island,
        parent_id=ev.parent_id,
        device=device,
        family=params.family(source),
        config=dict(ev.config),
        note=f"tuned for {where} {ev.shape} on {ev.device_id}{timing}",
        shape_index=ev.shape_index,
        shape=ev.shape,
        tuned_on=ev.device_id,
    )
