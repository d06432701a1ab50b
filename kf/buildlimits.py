"""How long a build may take, and how many run at once: build time is not run time.

A candidate's compile stage (importing it, building its native code, constructing
``ModelNew``) gets its own limit, :func:`build_timeout_s`: ``$KF_BUILD_TIMEOUT_S``, or the
``--build-timeout`` of ``kf run``, ``kf worker`` and ``kf eval``, by default 600 s (a
``load_inline`` build took 57–92 s on an H200 host with every core busy; the verify and
profile stages keep ``--timeout``). And a build waiting for cores is not timed: builds
take one of :func:`build_jobs` slots of this process first (``$KF_BUILD_JOBS``, by
default one per core this process may use), and the stage's clock starts once the slot
is held; the wait is reported as the compile report's ``build_queue`` phase.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

from kf.settings import current

__all__ = ["DEFAULT_BUILD_TIMEOUT_S", "build_jobs", "build_slot", "build_timeout_s", "waiting"]

DEFAULT_BUILD_TIMEOUT_S = 600.0

_guard = threading.Lock()
_slots: threading.BoundedSemaphore | None = None
_size = 0
_waiting = 0


def build_timeout_s(given: float | None = None) -> float:
    """``given`` when set, else ``$KF_BUILD_TIMEOUT_S``, else 600 s."""
    if given is not None and given > 0:
        return float(given)
    return current().build_timeout_s or DEFAULT_BUILD_TIMEOUT_S


def build_jobs() -> int:
    """Builds at once in this process: ``$KF_BUILD_JOBS``, else the cores it may use."""
    jobs = current().build_jobs
    if jobs is not None:
        return jobs
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def waiting() -> int:
    """Builds of this process waiting for a slot now."""
    return _waiting


@contextlib.contextmanager
def build_slot() -> Iterator[float]:
    """Hold one build slot meanwhile; yields the seconds spent waiting for it."""
    global _slots, _size, _waiting
    with _guard:
        jobs = build_jobs()
        if _slots is None or jobs != _size:
            _slots, _size = threading.BoundedSemaphore(jobs), jobs
        slots = _slots
        _waiting += 1
    began = time.monotonic()
    try:
        slots.acquire()
    finally:
        with _guard:
            _waiting -= 1
    try:
        yield time.monotonic() - began
    finally:
        slots.release()
