"""The agent base class and the context an agent runs in.

An agent declares its ``kind``, the committed event types it ``listens`` to, a pure
``evolve(state, record) -> state`` and ``react(state, record) -> events`` that *returns*
events (the runtime stamps, records and publishes them). ``react`` may be a coroutine
for agents that observe the world (compile, run, call an LLM); agents whose events are
:class:`~kf.events.Decision` set ``decides = True`` and keep ``react`` a pure, synchronous
function of the state, the record and the run's config, so ``kf replay --check`` can
recompute it.

Constructors must be cheap and side-effect free (replay builds agents to fold logs);
acquire resources in :meth:`Agent.on_start`.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

import msgspec
import structlog

from kf.events import Event, Record

__all__ = [
    "Agent",
    "AgentContext",
    "AgentLoadError",
    "Planned",
    "PlanningAgent",
    "Runnable",
    "agent_types",
    "load_agent_type",
    "make_agent_id",
    "snapshot_hash",
]

S = TypeVar("S")


def make_agent_id(kind: str, suffix: str | None = None) -> str:
    """``kind@host.pid`` (or ``kind@suffix``): unique per process, kind recoverable."""
    import os

    return f"{kind}@{suffix or f'{socket.gethostname()}.{os.getpid()}'}"


@dataclass
class AgentContext:
    """What the runtime gives an agent: identity, run, options and a way to emit events."""

    run_id: str
    agent_id: str
    options: dict[str, Any] = field(default_factory=dict)
    emit: Callable[..., None] | None = None

    @property
    def log(self) -> Any:
        """A structlog logger bound to this agent and run."""
        return structlog.get_logger("kf.agent").bind(agent=self.agent_id, run=self.run_id)


class Agent(Generic[S]):
    """Base class of kf agents. Subclasses set ``kind`` and ``listens`` and override the rest."""

    kind: ClassVar[str] = ""
    listens: ClassVar[tuple[type[Event], ...] | None] = None  # None: every event
    concurrency: ClassVar[int] = 1  # reactions that may run at once
    decides: ClassVar[bool] = False  # emits Decisions; react must be pure and synchronous
    _listen_tags: ClassVar[frozenset[str] | None] = None

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    def initial_state(self) -> S:
        """The state before any event."""
        raise NotImplementedError

    def evolve(self, state: S, rec: Record) -> S:
        """Fold one committed event into the state. Pure: no I/O, no clock, no randomness."""
        return state

    def react(self, state: S, rec: Record) -> Sequence[Event] | Awaitable[Sequence[Event]]:
        """Events this agent produces in response to ``rec`` (state already includes it)."""
        return ()

    def snapshot(self, state: S) -> Any:
        """A msgspec-serialisable view of the state, used for hashes and reports."""
        return state

    async def on_start(self) -> None:
        """Acquire resources, announce yourself (``self.ctx.emit``). Called before catch-up."""

    async def on_drain(self) -> None:
        """The runner stopped taking events and is about to wait for the reactions in
        flight (the run ended, or this agent is being drained): an agent whose queued
        work is optional (nothing waits for its events to decide the run) cuts it short
        here. Not called when the runner is cancelled (``on_stop`` is not, either)."""

    async def on_stop(self) -> None:
        """Release resources. Called after the last reaction finished."""

    def emit(self, ev: Event, *, event_id: str | None = None) -> None:
        """Publish a spontaneous event (one not caused by a committed event)."""
        if self.ctx.emit is None:
            raise RuntimeError(f"{self.kind}: emit() called outside a running agent")
        self.ctx.emit(ev, event_id=event_id)

    @classmethod
    def listens_to(cls, tag: str) -> bool:
        """Whether events with ``tag`` reach evolve/react."""
        if cls.listens is None:
            return True
        tags = cls.__dict__.get("_listen_tags")
        if tags is None:
            tags = frozenset(t.tag for t in cls.listens)
            cls._listen_tags = tags
        return tag in tags


class Planned(Protocol):
    """The state of a :class:`PlanningAgent`: the decisions the last folded event called
    for, with that event's id."""

    plan: tuple[str, list[Event]]


P = TypeVar("P", bound=Planned)


class PlanningAgent(Agent[P]):
    """An agent whose decisions are planned inside its fold (docs/decisions.md): ``fold``
    applies one event to the state and appends the decisions it calls for; evolve keeps
    them in ``state.plan`` with the event's id, react answers that event with them, and the
    snapshot leaves them out. Replaying the log therefore replans the same decisions."""

    def fold(self, state: P, rec: Record, plan: list[Event]) -> None:
        """Apply ``rec`` to ``state`` (in place) and append the decisions it calls for."""
        raise NotImplementedError

    def evolve(self, state: P, rec: Record) -> P:
        plan: list[Event] = []
        self.fold(state, rec, plan)
        state.plan = (rec.event_id, plan)
        return state

    def react(self, state: P, rec: Record) -> Sequence[Event]:
        event_id, decisions = state.plan
        return list(decisions) if event_id == rec.event_id else ()

    def snapshot(self, state: P) -> Any:
        return msgspec.structs.replace(cast(msgspec.Struct, state), plan=("", []))


class Runnable(Protocol):
    """Anything ``kf agent`` can run: the archivist, or an agent wrapped in a runner."""

    async def run(self, stop: Any, ready: Any = None) -> None: ...


_ENC = msgspec.msgpack.Encoder(order="deterministic")


def snapshot_hash(snapshot: Any) -> str:
    """sha256 of a snapshot's canonical MessagePack (maps in sorted key order)."""
    import hashlib

    return hashlib.sha256(_ENC.encode(snapshot)).hexdigest()


class AgentLoadError(LookupError):
    """No agent type is registered under the requested kind."""


def agent_types() -> dict[str, Any]:
    """Registered agent types (entry-point group ``kf.agents``), by name, loaded."""
    found: dict[str, Any] = {}
    for ep in sorted(entry_points(group="kf.agents"), key=lambda e: e.name):
        found[ep.name] = ep.load()
    return found


def load_agent_type(kind: str) -> Any:
    """The agent class registered as ``kind`` in ``kf.agents``; a clear error if none."""
    eps = {ep.name: ep for ep in entry_points(group="kf.agents")}
    if kind not in eps:
        known = ", ".join(sorted(eps)) or "none"
        raise AgentLoadError(f"no agent type {kind!r} is registered (known: {known})")
    return eps[kind].load()
