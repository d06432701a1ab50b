"""Replay: fold a log into the deciding agents' states, and prove the decisions deterministic.

``fold`` rebuilds every deciding agent's state from the log (with :func:`kf.fold.fold`)
and hashes the snapshots; it also gives the task checks the log recorded
(``kernel.task_checked``), which are observations and take no part in the hash.
``check`` walks the log once more and, at every committed event, recomputes what each
deciding agent would decide from the prefix up to that event, comparing with the
decisions recorded in the log (same ids, types, data and ``based_on``). The first
difference is returned, named by its ``seq``. Before any of that, ``check`` verifies the
log's hash chain (:meth:`kf.log.EventLog.verify`): a row rewritten, inserted or deleted
outside kf is a difference of kind ``integrity`` at the first bad ``seq``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kf.agent import Agent, AgentContext, agent_types, snapshot_hash
from kf.events import Decision, Envelope, Event, EventError, Record, decode_event, derived_id
from kf.fold import fold as fold_events
from kf.log import EventLog, Integrity, LogError
from kf.search_facts import TaskChecked, TaskChecks

__all__ = ["CheckResult", "Difference", "FoldResult", "check", "deciding_agent_types", "fold"]

_ENC = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class FoldResult:
    """States of the deciding agents after the whole log, and their hash."""

    head: int
    events: int
    snapshots: dict[str, Any]
    hash: str
    run_id: str = ""
    task_checks: dict[str, TaskChecked] = field(default_factory=dict)


@dataclass(frozen=True)
class Difference:
    """The first place where the log and a recomputed decision disagree."""

    seq: int
    kind: str
    event_type: str
    message: str


@dataclass(frozen=True)
class CheckResult:
    """Outcome of ``replay --check``."""

    ok: bool
    decisions_checked: int
    events: int
    difference: Difference | None = None
    hash: str = ""
    kinds: tuple[str, ...] = field(default_factory=tuple)
    integrity: Integrity | None = None


def deciding_agent_types(kinds: Iterable[str] | None = None) -> list[type[Agent[Any]]]:
    """Registered agent types that make decisions (optionally only the given kinds)."""
    found = agent_types()
    wanted = sorted(found) if kinds is None else list(kinds)
    out: list[type[Agent[Any]]] = []
    for name in wanted:
        cls = found.get(name)
        if cls is None:
            raise LookupError(f"no agent type {name!r} is registered in kf.agents")
        if isinstance(cls, type) and issubclass(cls, Agent) and cls.decides:
            out.append(cls)
    return out


def _instances(
    types: Sequence[type[Agent[Any]]], run_id: str, config: dict[str, Any]
) -> list[Agent[Any]]:
    return [
        t(AgentContext(run_id=run_id, agent_id=f"{t.kind}@replay", options=dict(config)))
        for t in types
    ]


def _load(elog: EventLog) -> list[Record]:
    """Every committed event, decoded once (envelope and data)."""
    return [_decode(elog, b, n) for n, b in enumerate(elog.read_raw(), 1)]


def _decode(elog: EventLog, body: bytes, n: int) -> Record:
    """The ``n``-th committed event; a body that is not one (a garbled page) is
    :class:`LogError`, one line that names it, never a traceback."""
    try:
        return Record.from_bytes(body)
    except EventError as exc:
        why = str(exc).splitlines()[0][:160]
        raise LogError(
            f"{elog.path}: the log is damaged: committed event {n} cannot be read ({why}); "
            "restore it from a copy"
        ) from None


def fold(elog: EventLog, types: Sequence[type[Agent[Any]]]) -> FoldResult:
    """Fold the whole log into fresh instances of ``types``; hash their snapshots."""
    history = _load(elog)
    snaps = {a.kind: a.snapshot(fold_events(history, a)) for a in _instances(types, "", {})}
    return FoldResult(
        head=elog.head,
        events=len(history),
        snapshots=snaps,
        hash=snapshot_hash(snaps),
        run_id=history[0].envelope.run_id if history else "",
        task_checks=fold_events(history, TaskChecks()),
    )


def check(elog: EventLog, types: Sequence[type[Agent[Any]]]) -> CheckResult:
    """Verify the chain, then recompute every decision from its log prefix; stop at the
    first difference."""
    integrity = elog.verify()
    if not integrity.ok:
        bad = integrity.bad_seq or 0
        return CheckResult(
            ok=False,
            decisions_checked=0,
            events=integrity.events,
            difference=Difference(
                seq=bad,
                kind="integrity",
                event_type=elog.row_type(bad) or "missing row",
                message=integrity.problem,
            ),
            integrity=integrity,
        )
    history = _load(elog)
    run_id = history[0].envelope.run_id if history else ""
    agents = _instances(types, run_id, {})
    kinds = tuple(a.kind for a in agents)
    states = [a.initial_state() for a in agents]
    logged, answered, last_cause_seq = _answers(history, kinds)
    checked = 0
    for rec in history:  # a fold (kf.fold) whose every step is compared with the log
        env = rec.envelope
        for i, a in enumerate(agents):
            if not a.listens_to(env.type):
                continue
            states[i] = a.evolve(states[i], rec)
            if env.event_id not in answered[a.kind] and (env.seq or 0) > last_cause_seq[a.kind]:
                continue  # the run ended before this agent answered; nothing to compare
            equal, problem = _compare(a, states[i], rec, logged[a.kind].get(env.event_id, {}))
            checked += equal
            if problem is not None:
                return CheckResult(
                    ok=False,
                    decisions_checked=checked,
                    events=len(history),
                    difference=Difference(
                        seq=env.seq or 0, kind=a.kind, event_type=env.type, message=problem
                    ),
                    kinds=kinds,
                    integrity=integrity,
                )
    return CheckResult(
        ok=True,
        decisions_checked=checked,
        events=len(history),
        hash=fold(elog, types).hash,
        kinds=kinds,
        integrity=integrity,
    )


def _answers(
    history: Sequence[Record], kinds: Sequence[str]
) -> tuple[dict[str, dict[str, dict[str, Envelope]]], dict[str, set[str]], dict[str, int]]:
    """What each deciding kind answered in the log: its decisions by cause (by id), the
    causes it answered, and the last seq of those causes."""
    logged: dict[str, dict[str, dict[str, Envelope]]] = {k: {} for k in kinds}
    answered: dict[str, set[str]] = {k: set() for k in kinds}
    last_cause_seq: dict[str, int] = dict.fromkeys(kinds, 0)
    seq_of = {r.event_id: r.seq for r in history}
    for r in history:
        env = r.envelope
        k = env.source_kind
        if k in logged and env.caused_by is not None:
            answered[k].add(env.caused_by)
            last_cause_seq[k] = max(last_cause_seq[k], seq_of.get(env.caused_by, 0))
            if isinstance(r.event, Decision):
                logged[k].setdefault(env.caused_by, {})[env.event_id] = env
    return logged, answered, last_cause_seq


def _same_decision(got: Envelope, ev: Decision) -> bool:
    """Whether the logged decision ``got`` is ``ev``: the same bytes, or, for a log
    written before a field was added (a new field has a default, docs/log.md), the same
    event once decoded: its missing field reads as the default the replay wrote."""
    if bytes(got.data) == _ENC.encode(ev):
        return True
    try:
        return bool(decode_event(got) == ev)
    except (EventError, msgspec.DecodeError):  # a body that does not decode is not it
        return False


def _compare(
    a: Agent[Any], state: Any, rec: Record, mine: dict[str, Envelope]
) -> tuple[int, str | None]:
    """Recompute ``a``'s decisions on ``rec`` and compare them with ``mine``, those the
    log holds: (how many were equal, the first difference or None)."""
    out = a.react(state, rec)
    if not isinstance(out, Sequence):
        raise TypeError(f"{a.kind}.react must be synchronous to be replayed")
    env = rec.envelope
    expected_ids: set[str] = set()
    equal = 0
    for j, ev in enumerate(out):
        if not isinstance(ev, Decision):
            continue
        eid = derived_id(a.kind, env.event_id, j)
        expected_ids.add(eid)
        got = mine.get(eid)
        if got is None:
            return equal, f"replay decides {ev.tag} {_show(ev)} but the log has none"
        if got.type != ev.tag or not _same_decision(got, ev):
            return equal, (
                f"decision {eid} (seq {got.seq}) differs: log has {got.type} "
                f"{_show(decode_event(got))}, replay gives {ev.tag} {_show(ev)}"
            )
        if got.based_on != env.seq:
            return equal, f"decision {eid} based_on {got.based_on}, expected {env.seq}"
        equal += 1
    extra = sorted(e.seq or 0 for eid, e in mine.items() if eid not in expected_ids)
    if extra:
        return equal, f"the log has decisions (seq {extra}) replay does not make"
    return equal, None


def _show(ev: Event) -> str:
    text = msgspec.json.encode(ev).decode()
    return text if len(text) < 300 else text[:300] + "…"
