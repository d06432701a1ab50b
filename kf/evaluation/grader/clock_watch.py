"""The GPU's clocks read around every timing request, and a request during which they
dropped timed again (issue 47).

Idle gaps let a GPU's clocks drop (ROCm/vllm #928: 5-15 % on sub-100 µs kernels), and
a card that heats up throttles. The grader reads the SM and memory clocks and the
temperature (:class:`kf.devices.clocks.ClockReader`, outside the candidate's box, so a
candidate cannot forge them) right before and right after each timing request. A
request is *dropped* (:func:`clock_dropped`) when the lower of its two readings of
either clock is more than :data:`DROP` below the highest reading of that clock in the
session so far; its samples are discarded and it is timed again, at most
:data:`RETIMES` times; one still dropped after that is kept, and the profile says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kf.devices.clocks import ClockReader, Clocks

__all__ = ["DROP", "GIVE_UP", "RETIMES", "ClockWatch", "clock_dropped"]

#: a clock this far below the session's highest reading of it makes a timing dropped
DROP = 0.10
#: a dropped timing is timed again at most this many times
RETIMES = 2
#: after this many timings still dropped when retimed, none is retimed (a card that
#: throttles stays slow: retiming would only triple the profile)
GIVE_UP = 2

T = TypeVar("T")


def clock_dropped(before: Clocks | None, after: Clocks | None, peak: Clocks | None) -> str | None:
    """Why a timing between readings ``before`` and ``after`` ran on dropped clocks
    (``peak``: the highest SM and memory clocks of the session, these readings
    included), or None (no drop, or no reading)."""
    if before is None or after is None or peak is None:
        return None
    for name, low, top in (
        ("SM", min(before.sm_mhz, after.sm_mhz), peak.sm_mhz),
        ("memory", min(before.mem_mhz, after.mem_mhz), peak.mem_mhz),
    ):
        if low < (1.0 - DROP) * top:
            return (
                f"{name} clock {low} MHz during the timing, {top} MHz at most in this "
                f"profile (over {DROP:.0%} below; {before.temp_c}-{after.temp_c} °C)"
            )
    return None


class ClockWatch:
    """Every timing request of one profile, with the clocks read around it (``reader``
    None: a CPU, nothing read)."""

    def __init__(self, reader: ClockReader | None) -> None:
        self.reader = reader
        self.peak: Clocks | None = None
        self.readings: list[Clocks] = []
        self.retimed: list[str] = []  # why each discarded timing was dropped
        self.kept_dropped: list[str] = []  # timings still dropped after RETIMES

    @classmethod
    def for_device(cls, device: str) -> ClockWatch:
        return cls(ClockReader(device) if device.startswith("cuda") else None)

    def _read(self) -> Clocks | None:
        reading = self.reader.read() if self.reader is not None else None
        if reading is not None:
            self.readings.append(reading)
            p = self.peak or reading
            self.peak = Clocks(
                max(p.sm_mhz, reading.sm_mhz),
                max(p.mem_mhz, reading.mem_mhz),
                max(p.temp_c, reading.temp_c),
            )
        return reading

    def timed(self, request: Callable[[], T]) -> T:
        """``request()``'s result, timed again while the clocks dropped during it."""
        tries = RETIMES + 1 if len(self.kept_dropped) < GIVE_UP else 1
        for attempt in range(tries):
            before = self._read()
            result = request()
            why = clock_dropped(before, self._read(), self.peak)
            if why is None:
                return result
            if attempt < tries - 1:
                self.retimed.append(why)
        self.kept_dropped.append(str(why))
        return result

    def summary(self) -> dict[str, Any]:
        """What the profile records: the clocks' and temperature's range over every
        reading, how many, how they were read, and the dropped timings."""
        if not self.readings:
            return {}
        r = self.readings
        return {
            "sm_mhz": [min(c.sm_mhz for c in r), max(c.sm_mhz for c in r)],
            "mem_mhz": [min(c.mem_mhz for c in r), max(c.mem_mhz for c in r)],
            "temp_c": [min(c.temp_c for c in r), max(c.temp_c for c in r)],
            "readings": len(r),
            "read_by": self.reader.how if self.reader is not None else "",
            "retimed": len(self.retimed),
            "kept_dropped": len(self.kept_dropped),
        }
