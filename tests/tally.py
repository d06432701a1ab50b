"""A small decision agent for runtime tests: it tallies ``test.pinged`` events and decides
a ``test.tallied`` milestone every ``every`` pings, based on the folded prefix."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kf.agent import Agent
from kf.events import Decision, Event, Observation, Record, event


@event("test.pinged")
class Pinged(Observation, frozen=True, kw_only=True):
    """A producer pinged with a number."""

    producer: str
    n: int


@event("test.tallied", version=2)
class Tallied(Decision, frozen=True, kw_only=True):
    """The tally reached a milestone."""

    count: int
    total: int
    label: str = ""


class TallyState(msgspec.Struct, frozen=True, kw_only=True):
    """How many pings, their sum, and the milestones decided."""

    count: int = 0
    total: int = 0
    milestones: tuple[int, ...] = ()
    by_producer: dict[str, int] = {}


class Tally(Agent[TallyState]):
    """Folds pings; every 10th ping decides a milestone."""

    kind = "tally"
    listens = (Pinged, Tallied)
    decides = True
    every = 10

    def initial_state(self) -> TallyState:
        return TallyState()

    def evolve(self, state: TallyState, rec: Record) -> TallyState:
        ev = rec.event
        if isinstance(ev, Pinged):
            by = dict(state.by_producer)
            by[ev.producer] = by.get(ev.producer, 0) + 1
            return msgspec.structs.replace(
                state, count=state.count + 1, total=state.total + ev.n, by_producer=by
            )
        if isinstance(ev, Tallied):
            return msgspec.structs.replace(state, milestones=(*state.milestones, ev.count))
        return state

    def react(self, state: TallyState, rec: Record) -> Sequence[Event]:
        if isinstance(rec.event, Pinged) and state.count % self.every == 0:
            return [Tallied(count=state.count, total=state.total, label=f"m{state.count}")]
        return ()
