"""What a search is asked to do, as data: ``kf run``'s flags without argparse."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kf.shutdown import BUS_LOST_S

__all__ = ["RunRefused", "RunRequest"]


class RunRefused(ValueError):
    """The run cannot start as asked (bad input or settings); the message is one line.

    ``skipped`` holds the ``(file or task, reason)`` of tasks left out before the refusal
    (a folder whose every task failed), for the caller to show first."""

    def __init__(self, message: str, skipped: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.skipped = list(skipped)


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    """One search, as ``kf run`` would be asked for it; each field is the flag it names.

    Converted options come as ``kf run``'s converters give them: ``llm`` as
    :func:`kf.llm.cli.llm_config`'s run-config keys, ``tolerance`` as
    ``Tolerance.config()``, ``bus_options`` as a :class:`kf.bus.BusOptions`."""

    tasks: Path  # a task file, a task folder (package, robust-kbench), or a folder of them
    shape_cap: int | None = None  # --shape-cap: robust-kbench config integers at most this
    select: str | None = None  # --tasks: of a folder, only these (kf.app.task_select)
    budget: int = 20
    seed: int = 0
    db: Path | None = None  # default runs/<run_id>.db
    resume: bool = False  # continue the log's run even if these settings differ
    device: str = "cpu"  # --device: one device, a list or cuda:all
    islands: int = 2
    max_in_flight: int | None = None  # default: kf.devices.slots.default_in_flight
    timeout_s: float = 180.0
    build_timeout_s: float | None = None
    tune_budget: int = 12
    lessons: Path | None = None  # --lessons: a lesson library recorded in the run (issue 48)
    llm_url: str | None = None
    llm: dict[str, Any] = field(default_factory=dict)
    tolerance: dict[str, Any] = field(default_factory=dict)
    compile_mode: str | None = None
    tf32: str | None = None
    unsafe_no_sandbox: bool = False
    serve: tuple[str, int] | None = None  # (host, port) of the dashboard beside the run
    run_id: str | None = None
    join: bool = False
    local_worker: bool = True  # not --no-worker
    heartbeat_s: float = 10.0
    heartbeat_timeout_s: float = 30.0
    # --assignment-timeout: a device answering none of its candidates for this long is lost
    # (None: the longest an honest device may take, assignment_deadline_s; 0: never)
    assignment_timeout_s: float | None = None
    trust: tuple[str, ...] = ()  # --trust: remote devices whose results are taken as given
    nats_url: str | None = None
    bus_options: Any = None
    allow_shared_token: bool = False
    bus_timeout_s: float = BUS_LOST_S

    def assignment_deadline_s(self) -> float:
        """How long a device may hold candidates without answering any before it is lost
        (``--assignment-timeout``; 0: never). Unless told: the longest an honest device
        can go without an answer, one build's limit or one stage's, whichever is longer,
        and two minutes for a fresh worker's first imports (issue 43, NX9)."""
        if self.assignment_timeout_s is not None:
            return max(0.0, self.assignment_timeout_s)
        from kf.buildlimits import build_timeout_s

        return max(build_timeout_s(self.build_timeout_s), self.timeout_s) + 120.0
