"""A plugin agent that knows nothing of kf's internals beyond the public Agent API."""

from __future__ import annotations

from collections.abc import Sequence

from kf.agent import Agent
from kf.events import Event, Observation, Record, event


@event("plugin.echoed")
class Echoed(Observation, frozen=True, kw_only=True):
    """The echo agent heard a committed ping."""

    of_seq: int
    of_type: str


class Echo(Agent[int]):
    """Counts committed events and echoes each ``test.pinged``."""

    kind = "echo"
    listens = None

    def initial_state(self) -> int:
        return 0

    def evolve(self, state: int, rec: Record) -> int:
        return state + 1

    def react(self, state: int, rec: Record) -> Sequence[Event]:
        if rec.envelope.type == "test.pinged":
            return [Echoed(of_seq=rec.seq, of_type=rec.envelope.type)]
        return ()
