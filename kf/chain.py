"""The log's hash chain: each committed row carries sha256(previous row's hash ‖ its body).

The writer computes the chain in the appending transaction; anyone can recompute it from
the rows alone. :class:`ChainVerifier` walks rows in ``seq`` order and stops at the first
row that breaks it: a missing ``seq`` (a row deleted), a row without a hash (inserted by
something other than kf's writer), a body whose hash does not chain (rewritten or
inserted), or indexed columns that disagree with the envelope in the body. Logs written
before the chain existed (format ``kf-log/1``) have no hash column: they are *unchained*,
still checked for gapless ``seq`` and consistent columns, and said to be unchained.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kf.events import EventError, decode_envelope

__all__ = ["GENESIS", "ChainVerifier", "Integrity", "Row", "link"]

GENESIS = bytes(32)
"""The "previous hash" of seq 1: 32 zero bytes."""

Row = tuple[int, str, str, str, str | None, int | None, int, float, bytes, str | None]
"""(seq, event_id, type, source, caused_by, based_on, schema, time, body, hash)."""


def link(prev: bytes, body: bytes) -> bytes:
    """The chain hash of a row: sha256 over the previous row's hash and this row's body."""
    return hashlib.sha256(prev + body).digest()


@dataclass(frozen=True)
class Integrity:
    """What verifying a log's chain found."""

    path: str
    chained: bool
    events: int
    head_hash: str = ""
    bad_seq: int | None = None
    problem: str = ""

    @property
    def ok(self) -> bool:
        """True unless a row breaks the chain (an unchained log with gapless rows is ok)."""
        return self.bad_seq is None

    @property
    def status(self) -> str:
        """``verified``, ``unchained`` or ``broken``."""
        if not self.ok:
            return "broken"
        return "verified" if self.chained else "unchained"

    def message(self) -> str:
        """One line for a person."""
        if not self.ok:
            return f"{self.path}: log integrity check failed at seq {self.bad_seq}: {self.problem}"
        if not self.chained:
            return (
                f"{self.path}: unchained log (written before kf chained its logs): "
                f"{self.events} events, seq gapless; rewrites cannot be detected"
            )
        if not self.events:
            return f"{self.path}: empty log (nothing to verify)"
        return (
            f"{self.path}: log chain verified: {self.events} events, "
            f"head sha256 {self.head_hash[:16]}…"
        )

    def as_json(self) -> dict[str, object]:
        """The integrity part of ``kf report --json``."""
        return {
            "status": self.status,
            "chained": self.chained,
            "events": self.events,
            "head_hash": self.head_hash or None,
            "bad_seq": self.bad_seq,
            "problem": self.problem or None,
        }


class ChainVerifier:
    """Checks rows in ``seq`` order, incrementally; remembers the first bad one."""

    def __init__(self, *, chained: bool) -> None:
        self.chained = chained
        self.last_seq = 0
        self.prev = GENESIS
        self.events = 0
        self.bad_seq: int | None = None
        self.problem = ""

    def feed(self, row: Row) -> bool:
        """Check one row; False (and the verifier stays broken) from the first bad row on."""
        if self.bad_seq is not None:
            return False
        seq, event_id, type_, source, caused_by, based_on, schema, time_, body, digest = row
        expected = self.last_seq + 1
        if seq != expected:
            if seq > expected:
                what = "seq " + (str(expected) if seq == expected + 1 else f"{expected}..{seq - 1}")
                return self._fail(expected, f"{what} missing before seq {seq} (a row was deleted)")
            return self._fail(seq, f"seq {seq} after seq {self.last_seq} (out of order)")
        if self.chained and digest is None:
            return self._fail(seq, f"no chain hash ({type_} was not committed by kf's writer)")
        try:
            env = decode_envelope(bytes(body))
        except EventError as exc:
            return self._fail(seq, f"the row's body is not a kf envelope ({exc})")
        fields = (env.seq, env.event_id, env.type, env.source, env.caused_by, env.based_on)
        columns = (seq, event_id, type_, source, caused_by, based_on)
        if fields != columns or env.schema != schema or env.time != time_:
            return self._fail(seq, "the row's columns disagree with the envelope in its body")
        if self.chained:
            h = link(self.prev, bytes(body))
            if digest != h.hex():
                return self._fail(
                    seq, f"chain hash does not match ({type_} rewritten, or inserted by hand)"
                )
            self.prev = h
        self.last_seq = seq
        self.events += 1
        return True

    @property
    def ok_so_far(self) -> bool:
        """No bad row yet."""
        return self.bad_seq is None

    def _fail(self, seq: int, problem: str) -> bool:
        self.bad_seq, self.problem = seq, problem
        return False

    def result(self, path: str) -> Integrity:
        """What was found so far."""
        return Integrity(
            path=path,
            chained=self.chained,
            events=self.events,
            head_hash=self.prev.hex() if self.chained and self.events and self.ok_so_far else "",
            bad_seq=self.bad_seq,
            problem=self.problem,
        )
