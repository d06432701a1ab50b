"""State as a fold over the committed log: the one loop that makes it.

Every piece of kf's state is a fold of committed events (DESIGN.md): an agent's
``evolve(state, record) -> state`` from its ``initial_state()``, taking only the event
types it ``listens_to``. :func:`fold` is that loop, for anything shaped so
(:class:`Projection`: every :class:`~kf.agent.Agent`, and small read-side projections
such as :class:`kf.search_facts.TaskChecks`). An envelope is decoded only when the
projection listens to its type; a :class:`~kf.events.Record` (already decoded, e.g. by a
caller that folds one event into several projections) is used as it is.

What folds its own way, and why: a running agent (:class:`kf.runtime.AgentRunner`) logs
and skips an event it cannot decode and turns a failing ``evolve`` into a supervised
restart; the archivist's hosted agents react inside the same step. ``kf replay --check``
interleaves each step with a comparison of the decisions the log holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from kf.events import Envelope, Record, decode_event

__all__ = ["Projection", "fold"]

S = TypeVar("S")


class Projection(Protocol[S]):
    """Anything state is folded by: an initial state, the event types it takes, a step."""

    def initial_state(self) -> S:
        """The state before any event."""
        ...

    def listens_to(self, tag: str) -> bool:
        """Whether events of type ``tag`` reach :meth:`evolve`."""
        ...

    def evolve(self, state: S, rec: Record) -> S:
        """The state after one more committed event. Pure: no I/O, clock or randomness."""
        ...


def fold(
    events: Iterable[Envelope | Record], projection: Projection[S], state: S | None = None
) -> S:
    """``projection``'s state after ``events`` (committed, in ``seq`` order), starting from
    ``state`` (default: its initial state), so a caller that folds as the log grows passes
    the state it has."""
    out = projection.initial_state() if state is None else state
    for item in events:
        env = item.envelope if isinstance(item, Record) else item
        if projection.listens_to(env.type):
            rec = item if isinstance(item, Record) else Record(env, decode_event(env))
            out = projection.evolve(out, rec)
    return out
