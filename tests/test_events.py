"""Events and the envelope: typed, immutable, MessagePack, upcast from old versions."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from kf.events import (
    Envelope,
    EventError,
    UnknownEvent,
    decode_envelope,
    decode_event,
    encode_envelope,
    make_envelope,
    upcaster,
)
from tests.tally import Pinged, Tallied


@upcaster("test.tallied", 1)
def _tallied_v1_to_v2(data: dict[str, object]) -> dict[str, object]:
    # v1 called the running sum "sum"; v2 calls it "total" and adds an optional label
    data = dict(data)
    data["total"] = data.pop("sum")
    return data


def test_event_roundtrip_keeps_type_and_metadata() -> None:
    """An event survives encode → decode with its envelope metadata intact."""
    env = make_envelope(Pinged(producer="a", n=3), run_id="r", source="p@h", caused_by="x")
    back = decode_envelope(encode_envelope(env))
    assert back == env
    assert decode_event(back) == Pinged(producer="a", n=3)
    assert back.source_kind == "p"


def test_event_is_immutable() -> None:
    """Events are frozen value objects."""
    ev = Pinged(producer="a", n=1)
    with pytest.raises(AttributeError):
        ev.n = 2  # type: ignore[misc]


def test_envelope_wire_format_is_plain_messagepack() -> None:
    """Any MessagePack library can read the envelope (the wire format is not msgspec-only)."""
    env = make_envelope(Pinged(producer="a", n=7), run_id="r", source="p@h")
    plain = msgpack.unpackb(encode_envelope(env))
    assert plain["type"] == "test.pinged"
    assert plain["data"] == {"producer": "a", "n": 7}


def written(type_: str, data: dict[str, object]) -> Envelope:
    """An envelope of ``type_`` as a producer wrote it under schema version 1."""
    return Envelope(
        event_id="e",
        run_id="r",
        source="p@h",
        type=type_,
        schema=1,
        time=0.0,
        data=msgspec.Raw(msgpack.packb(data)),
    )


def test_event_old_schema_version_is_upcast() -> None:
    """An event written under schema version 1 still loads under version 2."""
    old = written("test.tallied", {"count": 10, "sum": 45})
    assert decode_event(old) == Tallied(count=10, total=45, label="")


def test_event_newer_schema_version_is_refused() -> None:
    """A version this kf does not know yet is a clear error, not a silent misread."""
    env = make_envelope(Tallied(count=1, total=1), run_id="r", source="t@h")
    future = msgspec.structs.replace(env, schema=99)
    with pytest.raises(EventError, match="newer than this kf knows"):
        decode_event(future)


def test_event_unknown_type_is_kept_as_data() -> None:
    """A plugin's event type this process does not know decodes to UnknownEvent."""
    env = written("plugin.said", {"words": "hi"})
    assert decode_event(env) == UnknownEvent(type="plugin.said", data={"words": "hi"})


@pytest.mark.parametrize(
    "data",
    [b"\xc1garbage", b"", msgpack.packb([1, 2, 3]), msgpack.packb({"event_id": 1})],
)
def test_envelope_garbage_is_rejected_with_reason(data: bytes) -> None:
    """Bytes that are not an envelope raise EventError saying so."""
    with pytest.raises(EventError):
        decode_envelope(data)


def test_event_wrong_schema_data_is_rejected() -> None:
    """A known type whose data does not match its schema raises EventError."""
    env = written("test.pinged", {"producer": 5, "n": "x"})
    with pytest.raises(EventError, match=r"test\.pinged"):
        decode_event(env)
