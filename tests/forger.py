"""A hostile outside process that tries to change a finished run's log (for the log tests).

    python -m tests.forger MODE LOG

Modes (each prints one line saying what it did, or exits 1 with the database's refusal):

- ``naive``: inserts a forged ``kernel.candidate_profiled`` row at ``head + 1`` with plain
  SQL, as any sqlite tool would.
- ``insert``: the same row, after defining the function kf's insert trigger calls, with a
  made-up chain hash.
- ``rewrite``: drops the UPDATE trigger and rewrites the best candidate's profile row so
  that it claims 99× (the attack ``kf report`` used to believe).
"""

from __future__ import annotations

import sqlite3
import sys

import msgspec

from kf.events import decode_envelope, encode_envelope, make_envelope
from kf.log import WRITER_FUNCTION
from kf.search_facts import CandidateProfiled

_DEC = msgspec.msgpack.Decoder(CandidateProfiled)
_ENC = msgspec.msgpack.Encoder()


def _best_profile(conn: sqlite3.Connection) -> tuple[int, bytes, CandidateProfiled]:
    rows = conn.execute(
        "SELECT seq, body FROM events WHERE type = 'kernel.candidate_profiled' ORDER BY seq"
    ).fetchall()
    found = [(seq, body, _DEC.decode(decode_envelope(body).data)) for seq, body in rows]
    ok = [f for f in found if f[2].report.ok]
    return max(ok, key=lambda f: f[2].report.speedup)


def _claim_99x(ev: CandidateProfiled) -> CandidateProfiled:
    r = ev.report
    fast = msgspec.structs.replace(r, speedup=99.0, runtime_ms=r.ref_runtime_ms / 99.0)
    return msgspec.structs.replace(ev, report=fast)


def main(mode: str, db: str) -> int:
    conn = sqlite3.connect(db, isolation_level=None)
    seq, body, ev = _best_profile(conn)
    env = decode_envelope(body)
    try:
        if mode == "rewrite":
            forged = msgspec.structs.replace(env, data=msgspec.Raw(_ENC.encode(_claim_99x(ev))))
            conn.execute("DROP TRIGGER events_no_update")
            conn.execute("UPDATE events SET body = ? WHERE seq = ?", [encode_envelope(forged), seq])
            print(f"rewrote seq {seq}")
            return 0
        head = conn.execute("SELECT MAX(seq) FROM events").fetchone()[0]
        new = make_envelope(_claim_99x(ev), run_id=env.run_id, source=env.source)
        new = msgspec.structs.replace(new, seq=head + 1)
        if mode == "insert":
            conn.create_function(WRITER_FUNCTION, 0, lambda: 1)
        conn.execute(
            "INSERT INTO events (seq, event_id, type, source, caused_by, based_on, schema, time,"
            " body, hash) VALUES (?,?,?,?,?,?,?,?,?,?)",
            [new.seq, new.event_id, new.type, new.source, new.caused_by, new.based_on,
             new.schema, new.time, encode_envelope(new), "ab" * 32],
        )  # fmt: skip
        print(f"inserted seq {head + 1}")
        return 0
    except sqlite3.DatabaseError as exc:
        print(f"refused: {exc}")
        return 1
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
