"""Events: immutable typed facts, an envelope for their metadata, MessagePack on the wire.

Every event class is a frozen ``msgspec.Struct`` registered with :func:`event` under a
tag (``kernel.candidate_proposed``) and a schema version. The envelope carries the
metadata (``event_id``, ``run_id``, ``source``, ``caused_by``, ``schema``, the producer's
``time``, ``based_on`` for decisions and, once committed, ``seq``); the event itself
travels inside it as MessagePack bytes, decoded only by those who need it.

Schema evolution (see ``docs/events.md``): a new field gets a default; a breaking change
bumps the version and registers an upcaster from the old version, so old logs load
forever.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgspec

__all__ = [
    "DEVICE_ID_SPACE",
    "Decision",
    "Envelope",
    "Event",
    "EventError",
    "Observation",
    "Record",
    "UnknownEvent",
    "decode_envelope",
    "decode_event",
    "derived_id",
    "device_event_id",
    "device_id_prefix",
    "encode_envelope",
    "event",
    "event_class",
    "make_envelope",
    "new_id",
    "registry",
    "upcaster",
]


class EventError(ValueError):
    """Bytes or data that are not a valid kf event; the message says what is wrong."""


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every event: a fact, named in the past tense. Metadata lives in the envelope."""

    tag: ClassVar[str] = ""
    version: ClassVar[int] = 1


class Observation(Event, frozen=True, kw_only=True):
    """Something the world decided (an LLM's answer, a compiler's output, a timing).

    Recorded verbatim; replay never redoes it.
    """


class Decision(Event, frozen=True, kw_only=True):
    """Something kf decided; a pure function of the log prefix up to ``based_on``."""


class UnknownEvent(Event, frozen=True, kw_only=True):
    """An event of a type this process does not know (e.g. from a plugin); kept as data."""

    type: str
    data: dict[str, Any]


_REGISTRY: dict[str, type[Event]] = {}
_UPCASTERS: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {}

E = TypeVar("E", bound=type[Event])


def event(tag: str, *, version: int = 1) -> Callable[[E], E]:
    """Register an event class under ``tag`` at schema ``version``."""

    def register(cls: E) -> E:
        if tag in _REGISTRY and _REGISTRY[tag] is not cls:
            raise ValueError(f"event tag {tag!r} registered twice ({_REGISTRY[tag]!r}, {cls!r})")
        cls.tag = tag
        cls.version = version
        _REGISTRY[tag] = cls
        return cls

    return register


def upcaster(
    tag: str, from_version: int
) -> Callable[
    [Callable[[dict[str, Any]], dict[str, Any]]], Callable[[dict[str, Any]], dict[str, Any]]
]:
    """Register a function turning ``tag``'s data at ``from_version`` into ``from_version + 1``."""

    def register(
        fn: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> Callable[[dict[str, Any]], dict[str, Any]]:
        _UPCASTERS[(tag, from_version)] = fn
        return fn

    return register


def registry() -> dict[str, type[Event]]:
    """All registered event classes by tag (a copy, sorted by tag)."""
    return dict(sorted(_REGISTRY.items()))


def event_class(tag: str) -> type[Event] | None:
    """The class registered under ``tag``, or None."""
    return _REGISTRY.get(tag)


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """Metadata around one event, as it travels and as it is stored."""

    event_id: str
    run_id: str
    source: str
    type: str
    schema: int
    time: float
    data: msgspec.Raw
    caused_by: str | None = None
    based_on: int | None = None
    seq: int | None = None

    @property
    def source_kind(self) -> str:
        """The agent kind part of ``source`` (``compiler@host.123`` → ``compiler``)."""
        return self.source.partition("@")[0]


_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)
_ANY_DECODER = msgspec.msgpack.Decoder()
_TYPED_DECODERS: dict[type[Event], msgspec.msgpack.Decoder[Any]] = {}


def new_id() -> str:
    """A fresh random event id, for events no other event caused."""
    return uuid.uuid4().hex


def derived_id(*parts: object) -> str:
    """A deterministic event id from its causes (so a retried reaction reuses its id)."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:32]


def device_id_prefix(device_id: str) -> str:
    """What every event id sent on ``device_id``'s intake begins with.

    Ids derived from their causes are predictable, and the log keeps the first event of
    an id; so, without this, a worker could commit an event it is entitled to under the id
    another device's coming result will have, and that result would be dropped as a
    duplicate. The archivist accepts on a device's intake only ids in that device's space
    (:class:`kf.auth.Entitlements`), and on the general intake none in any device's."""
    return "d" + hashlib.sha256(device_id.encode()).hexdigest()[:12] + "-"


def device_event_id(device_id: str, event_id: str | None = None) -> str:
    """``event_id`` (a fresh one if None) in ``device_id``'s id space."""
    return device_id_prefix(device_id) + (event_id or new_id())


#: the shape of an id in some device's space (:func:`device_id_prefix`)
DEVICE_ID_SPACE = re.compile(r"d[0-9a-f]{12}-")


def make_envelope(
    ev: Event,
    *,
    run_id: str,
    source: str,
    event_id: str | None = None,
    caused_by: str | None = None,
    based_on: int | None = None,
    seq: int | None = None,
    at: float | None = None,
) -> Envelope:
    """Wrap ``ev`` in an envelope; the producer's wall clock is recorded, never folded."""
    if not ev.tag:
        raise EventError(f"{type(ev).__name__} is not registered with @event")
    return Envelope(
        event_id=event_id or new_id(),
        run_id=run_id,
        source=source,
        type=ev.tag,
        schema=ev.version,
        time=time.time() if at is None else at,
        data=msgspec.Raw(_ENCODER.encode(ev)),
        caused_by=caused_by,
        based_on=based_on,
        seq=seq,
    )


def encode_envelope(env: Envelope) -> bytes:
    """MessagePack bytes of an envelope."""
    return _ENCODER.encode(env)


def decode_envelope(data: bytes) -> Envelope:
    """Parse an envelope; raise :class:`EventError` naming the problem for bad bytes."""
    try:
        env = _ENVELOPE_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventError(f"not a kf event envelope: {exc}") from None
    if not env.event_id or not env.type or env.schema < 1:
        raise EventError(
            f"envelope fields invalid: event_id={env.event_id!r} type={env.type!r} "
            f"schema={env.schema!r}"
        )
    return env


def decode_event(env: Envelope) -> Event:
    """Decode the event inside ``env``, upcasting old schema versions.

    An unknown type decodes to :class:`UnknownEvent` when its data is a map; a known
    type whose data does not match its schema raises :class:`EventError`.
    """
    cls = _REGISTRY.get(env.type)
    if cls is None and _load_builtin_events():
        cls = _REGISTRY.get(env.type)
    if cls is None:
        try:
            raw = _ANY_DECODER.decode(env.data)
        except msgspec.DecodeError as exc:
            raise EventError(f"{env.type}: data is not MessagePack: {exc}") from None
        if not isinstance(raw, dict):
            raise EventError(f"{env.type}: data must be a map, got {type(raw).__name__}")
        return UnknownEvent(type=env.type, data=raw)
    try:
        if env.schema == cls.version:
            dec = _TYPED_DECODERS.get(cls)
            if dec is None:
                dec = _TYPED_DECODERS[cls] = msgspec.msgpack.Decoder(cls)
            return dec.decode(env.data)  # type: ignore[no-any-return]
        if env.schema > cls.version:
            raise EventError(
                f"{env.type}: schema version {env.schema} is newer than this kf knows "
                f"({cls.version}); upgrade kf to read it"
            )
        data = _ANY_DECODER.decode(env.data)
        for v in range(env.schema, cls.version):
            up = _UPCASTERS.get((env.type, v))
            if up is None:
                raise EventError(f"{env.type}: no upcaster from schema version {v} to {v + 1}")
            data = up(data)
        return msgspec.convert(data, cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventError(f"{env.type} (schema {env.schema}): {exc}") from None


BUILTIN_EVENT_MODULES = ("kf.facts", "kf.search_facts", "kf.llm_facts")
_builtin_loaded = False


def _load_builtin_events() -> bool:
    """Import kf's own event modules once, so any process can decode any kf event."""
    global _builtin_loaded
    if _builtin_loaded:
        return False
    _builtin_loaded = True
    import importlib

    for mod in BUILTIN_EVENT_MODULES:
        importlib.import_module(mod)
    return True


@dataclass(frozen=True, slots=True)
class Record:
    """A committed event as agents see it: the envelope (with ``seq``) and the decoded event."""

    envelope: Envelope
    event: Event
    raw: bytes = field(default=b"", repr=False, compare=False)

    @property
    def seq(self) -> int:
        """The log position; committed records always have one."""
        assert self.envelope.seq is not None
        return self.envelope.seq

    @property
    def event_id(self) -> str:
        """The producer-chosen id."""
        return self.envelope.event_id

    @classmethod
    def from_bytes(cls, data: bytes) -> Record:
        """Decode a committed envelope and its event."""
        env = decode_envelope(data)
        if env.seq is None:
            raise EventError(f"{env.type} {env.event_id}: committed event without seq")
        return cls(env, decode_event(env), data)

    @classmethod
    def of(cls, env: Envelope) -> Record:
        """Wrap an already-decoded committed envelope."""
        return cls(env, decode_event(env))
