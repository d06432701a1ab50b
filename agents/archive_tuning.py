"""The archive's tuning decisions (search versions 3 and 4), folded like every other decision.

Once a task has spent its search budget and nothing of it is in flight, the archive asks
each live device that can run a kernel to tune that kernel's template parameters
(``search.tuning_requested``), if the kernel declares a ``kf:params`` space and the run's
``tune_budget`` is positive. Version 3 asks once per task and device, for the task's best
kernel, with the whole budget. Version 4 asks for every elite (every distinct occupant of
the task's cells, not itself a tuned candidate), best speed-up first (ties: proposal
order), one request at a time per task and device, each with what the task has left of
``tune_budget`` on that device (the budget less the timings the tuner recorded for the
earlier elites); it stops when less than :data:`kf.kernels.tuning.MIN_PER_SHAPE` is left. The
device's tuner answers each request with one ``tuning.config_tuned`` per shape set, the
last marked ``last``. For every shape set where the tuner's best configuration beat the
kernel's own by more than the timing noise, the archive decides ``search.tuned_chosen``:
the mutator proposes that configuration as a candidate (operator ``tune``) pinned to the
device, evaluated at that shape set through the normal compile / verify / profile path.
At the task's own shape set it competes for the archive's cells like any candidate; at
other shape sets its speed-up is measured there and ranks nowhere in the archive (``kf
export`` dispatches to it by shape, for the best kernel's template).

An open request counts as in flight, so the run finishes only once every tuning and
tuned candidate is done. A request ends early when its device is lost or leaves, or the
tuner's reaction fails. Everything here is a pure function of the log prefix.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kf.events import Event, Record
from kf.facts import ReactionFailed
from kf.kernels import params
from kf.kernels.tuning import MIN_PER_SHAPE
from kf.llm_facts import ConfigTuned
from kf.search_facts import TunedChosen, TuningRequested

__all__ = [
    "Tuning",
    "device_gone",
    "failed",
    "fold",
    "key",
    "open_count",
    "order",
    "proposed",
    "request",
    "spent",
    "summary",
]


class Tuning(msgspec.Struct, kw_only=True):
    """One tuning request of a task's kernel on one device, and what came of it."""

    task: str
    candidate_id: str
    device_id: str
    event_id: str = ""  # the committed request's id (for a failed reaction to it)
    budget: int = 0  # configurations it may time (version 4: what the task had left)
    open: bool = True
    ended: str = ""  # why it ended without its last shape set, if it did
    shapes: list[dict[str, Any]] = []  # per shape set: index, shape, best/baseline config, ms
    awaiting: list[int] = []  # shape sets whose tuned candidate is chosen but not yet proposed
    chosen: list[tuple[int, str]] = []  # (shape set, source) of each tuned candidate chosen


def key(task: str, device_id: str, candidate_id: str = "") -> str:
    """The ``state.tuning`` key of a task's request on a device: ``task|device`` (version 3,
    one request per task and device), ``task|device|candidate`` (version 4, one per elite)."""
    return f"{task}|{device_id}" + (f"|{candidate_id}" if candidate_id else "")


def _find(state: Any, task: str, device_id: str, candidate_id: str) -> Tuning | None:
    """The request of ``candidate_id`` on a device, under either version's key."""
    found: Tuning | None = state.tuning.get(key(task, device_id, candidate_id))
    if found is None:
        found = state.tuning.get(key(task, device_id))
    return found if found is not None and found.candidate_id == candidate_id else None


def spent(state: Any, task: str, device_id: str) -> int:
    """Configurations the tuner timed for ``task`` on a device, over all its requests."""
    return sum(
        int(s["trials"])
        for t in state.tuning.values()
        if t.task == task and t.device_id == device_id
        for s in t.shapes
    )


def open_count(state: Any) -> int:
    """Tuning requests not yet answered, and tuned candidates chosen but not yet proposed."""
    return sum(int(t.open) + len(t.awaiting) for t in state.tuning.values())


def _tunable(source: str) -> bool:
    try:
        parsed = params.parse(source)
    except params.ParamsError:
        return False
    return parsed is not None and params.size(parsed[0]) > 1


def _search_done(state: Any, t: Any) -> bool:
    cfg = state.config
    if t.skipped is not None or t.pending or t.proposed < t.seeds:
        return False
    budget = t.budget if t.budget is not None else cfg.budget  # a package's own, or the run's
    if t.seeds + t.selections < budget and state.llm_stopped is None:
        return False
    return not any(c.in_flight for c in state.candidates.values() if c.task == t.name)


def request(state: Any, plan: list[Event]) -> int:
    """Decide the tuning requests now due; return how many requests are open."""
    cfg = state.config
    if cfg.tune_budget <= 0:
        return open_count(state)
    for t in state.tasks.values():
        if cfg.search_version >= 4:
            _request_elites(state, t, plan)
        else:
            _request_best(state, t, plan)
    return open_count(state)


def _fits(state: Any, c: Any, device_id: str) -> bool:
    slot = state.devices[device_id]
    return (
        slot.live
        and slot.kind == c.target.partition(":")[0]
        and (not slot.backends or c.backend in slot.backends)
    )


def _request_best(state: Any, t: Any, plan: list[Event]) -> None:
    """Version 3: the task's best kernel, once per live device, with the whole budget."""
    cfg = state.config
    if not _search_done(state, t):
        return
    best = state.best(t.name)
    if best is None or not _tunable(best.source):
        return
    for device_id in sorted(state.devices):
        k = key(t.name, device_id)
        if k in state.tuning or not _fits(state, best, device_id):
            continue
        state.tuning[k] = Tuning(
            task=t.name, candidate_id=best.id, device_id=device_id, budget=cfg.tune_budget
        )
        plan.append(
            TuningRequested(
                task=t.name, candidate_id=best.id, device_id=device_id, budget=cfg.tune_budget
            )
        )


def order(state: Any, t: Any) -> list[Any]:
    """Version 4's order: the task's distinct elites that declare a space of more than one
    point and are not themselves tuned candidates, best speed-up first (ties: proposal
    order)."""
    order = {cid: i for i, cid in enumerate(state.candidates)}
    ids = sorted(set(t.elites.values()), key=order.__getitem__)
    found = [state.candidates[cid] for cid in ids]
    found = [c for c in found if c.operator != "tune" and _tunable(c.source)]
    return sorted(found, key=lambda c: (-(c.speedup or 0.0), order[c.id]))


def _request_elites(state: Any, t: Any, plan: list[Event]) -> None:
    """Version 4: per live device, the next elite not yet tuned there, with what is left."""
    cfg = state.config
    mine = [x for x in state.tuning.values() if x.task == t.name]
    if not mine and not _search_done(state, t):
        return  # tuning begins when the search ends; then it goes on regardless
    queue = order(state, t)
    for device_id in sorted(state.devices):
        here = [x for x in mine if x.device_id == device_id]
        if any(x.open for x in here):
            continue  # one request at a time: the next gets what this one leaves
        left = cfg.tune_budget - spent(state, t.name, device_id)
        if left < MIN_PER_SHAPE:
            continue
        done = {x.candidate_id for x in here}
        nxt = next((c for c in queue if c.id not in done and _fits(state, c, device_id)), None)
        if nxt is None:
            continue
        state.tuning[key(t.name, device_id, nxt.id)] = Tuning(
            task=t.name, candidate_id=nxt.id, device_id=device_id, budget=left
        )
        mine.append(state.tuning[key(t.name, device_id, nxt.id)])
        plan.append(
            TuningRequested(task=t.name, candidate_id=nxt.id, device_id=device_id, budget=left)
        )


def fold(state: Any, rec: Record, plan: list[Event]) -> None:
    """Take a committed request or a tuner's answer into account."""
    ev = rec.event
    if isinstance(ev, TuningRequested):
        found = _find(state, ev.task, ev.device_id, ev.candidate_id)
        if found is not None:
            found.event_id = rec.event_id
        return
    assert isinstance(ev, ConfigTuned)
    tuning = _find(state, ev.task, ev.device_id, ev.candidate_id)
    if tuning is None or not tuning.open or not ev.requested:
        return
    tuning.shapes.append(
        {
            "shape_index": ev.shape_index,
            "shape": ev.shape,
            "baseline_config": dict(ev.baseline_config),
            "best_config": dict(ev.best_config) if ev.best_config is not None else None,
            "baseline_ms": ev.baseline_ms,
            "best_ms": ev.best_ms,
            "improved": ev.improved,
            "trials": len(ev.trials),
            "note": ev.note,
        }
    )
    if ev.last:
        tuning.open = False
        _choose(state, tuning, plan)


def _choose(state: Any, tuning: Tuning, plan: list[Event]) -> None:
    """A candidate for every shape set whose best configuration beat the kernel's own."""
    parent = state.candidates.get(tuning.candidate_id)
    if parent is None:
        return
    known = {c.source for c in state.candidates.values() if c.task == tuning.task}
    # what another elite's tuning on this device already chose (version 4; in version 3
    # there is no other): the same configuration of the same template at the same shapes
    chosen = {
        (index, source)
        for other in state.tuning.values()
        if other is not tuning and other.task == tuning.task and other.device_id == tuning.device_id
        for index, source in other.chosen
    }
    done: set[int] = set()
    for s in tuning.shapes:
        best = s["best_config"]
        index = int(s["shape_index"])
        if not s["improved"] or best is None or best == s["baseline_config"] or index in done:
            continue
        try:
            source = params.apply(parent.source, best)
        except params.ParamsError:
            continue
        if index == 0 and source in known:
            continue  # measured already, as the search's own candidate
        if (index, source) in chosen:
            continue  # chosen already, from another elite's tuning on this device
        done.add(index)
        tuning.awaiting.append(index)
        tuning.chosen.append((index, source))
        plan.append(
            TunedChosen(
                task=tuning.task,
                parent_id=parent.id,
                device_id=tuning.device_id,
                shape_index=index,
                shape=str(s["shape"]),
                config=dict(best),
                baseline_ms=s["baseline_ms"],
                best_ms=s["best_ms"],
            )
        )


def proposed(
    state: Any, task: str, tuned_on: str, shape_index: int, parent_id: str | None = None
) -> None:
    """A tuned candidate the archive chose was proposed (or could not be: ``shape_index``
    -1 clears every one the task awaits). ``parent_id``: the elite it was tuned from."""
    for tuning in state.tuning.values():
        if tuning.task != task or (tuned_on and tuning.device_id != tuned_on):
            continue
        if parent_id is not None and tuning.candidate_id != parent_id:
            continue
        if shape_index < 0:
            tuning.awaiting.clear()
        elif shape_index in tuning.awaiting:
            tuning.awaiting.remove(shape_index)


def failed(state: Any, rec: Record) -> bool:
    """Whether a failed reaction was the tuner's answer to a request (which then ends)."""
    ev = rec.event
    cause = rec.envelope.caused_by or ""
    if not isinstance(ev, ReactionFailed) or not cause:
        return False
    for tuning in state.tuning.values():
        if tuning.open and tuning.event_id == cause:
            tuning.open = False
            tuning.ended = f"the tuner failed: {ev.error[:500]}"
            return True
    return False


def summary(state: Any, task: str) -> list[dict[str, Any]]:
    """Per device and shape set of ``task``: what the tuner found and the tuned candidate's
    measured outcome (for reports and the dashboard)."""
    out: list[dict[str, Any]] = []
    for tuning in state.tuning.values():
        if tuning.task != task:
            continue
        if not tuning.shapes:
            why = tuning.ended or ("tuning" if tuning.open else "no shape set tuned")
            out.append(
                {"device_id": tuning.device_id, "candidate_id": tuning.candidate_id, "note": why}
            )
        for s in tuning.shapes:
            tuned = next(
                (
                    c
                    for c in state.candidates.values()
                    if c.task == task
                    and c.operator == "tune"
                    and c.parent_id == tuning.candidate_id
                    and c.tuned_on == tuning.device_id
                    and c.shape_index == s["shape_index"]
                ),
                None,
            )
            out.append(
                {
                    "device_id": tuning.device_id,
                    "candidate_id": tuning.candidate_id,
                    **s,
                    "tuned_candidate_id": tuned.id if tuned else None,
                    "tuned_status": tuned.status if tuned else None,
                    "tuned_speedup": tuned.speedup if tuned else None,
                    "tuned_ms": tuned.runtime_ms if tuned else None,
                    "tuned_ref_ms": tuned.ref_ms if tuned else None,
                }
            )
    return out


def device_gone(state: Any, device_id: str) -> None:
    """Requests open on a device that was lost or left end there."""
    for tuning in state.tuning.values():
        if tuning.open and tuning.device_id == device_id:
            tuning.open = False
            tuning.ended = f"device {device_id} went away before the tuning finished"
