"""Sandboxed runner processes and a pool of pre-spawned warm ones.

A runner (``python -m kf.evaluation.runner``) is started in bubblewrap's box by
:mod:`kf.evaluation.grader.spawn` and talked to through its :class:`RunnerHandle`
(:mod:`kf.evaluation.grader.runner_handle`, typed messages of :mod:`kf.evaluation.wire.protocol`).
Where the box cannot be set up kf refuses to evaluate, unless
``$KF_UNSAFE_NO_SANDBOX=1`` asks for the old, unboxed runners, whose every report is
marked. Limits (address space, CPU seconds, file size) are applied when a runner is set
up for its one job. A runner serves one candidate (or one task reference) and is then
killed: a candidate's runner may be kept from one of its stages to the next (its build's
runner verifies it, and that one profiles it), never given another candidate. The pool
here keeps a few started in advance so the next job's interpreter and torch import
overlap this one's work. This module also names what the stages use of
the other two, so that they import one place.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import structlog

from kf.evaluation.grader.runner_handle import (
    REQUESTS,
    STARTUP_TIMEOUT_S,
    RequestTiming,
    RunnerCrashed,
    RunnerError,
    RunnerFailed,
    RunnerHandle,
    RunnerStartError,
    RunnerTimeout,
    quiet_others,
)
from kf.evaluation.grader.spawn import Limits, default_threads, network_namespace_available
from kf.settings import current

__all__ = [
    "REQUESTS",
    "Limits",
    "RequestTiming",
    "RunnerCrashed",
    "RunnerError",
    "RunnerFailed",
    "RunnerHandle",
    "RunnerPool",
    "RunnerStartError",
    "RunnerTimeout",
    "configure_default_pool",
    "default_pool",
    "default_threads",
    "network_namespace_available",
    "quiet_others",
]

log = structlog.get_logger("kf.evaluation.grader.sandbox")

#: seconds a candidate runner stays kept for its candidate's next stage at most (a
#: candidate whose next stage never comes here: its profile was not wanted, say)
KEPT_MAX_AGE_S = 900.0


class RunnerPool:
    """A thread-safe pool of warm runners; each leased runner serves one candidate (or a
    task's reference side) and is killed."""

    def __init__(
        self,
        size: int = 2,
        *,
        threads: int | None = None,
        python: str | None = None,
        warm: str | None = None,
        references: int = 4,
        kept: int | None = None,
    ):
        """``warm``: the device (``cuda:N``) whose start-up work runners do while idle;
        ``references``: the idle reference runners kept, over all tasks; ``kept``: the
        candidate runners kept between a candidate's stages (None: ``$KF_KEPT_RUNNERS``)."""
        self.size = max(0, size)
        self.warm = warm
        self.threads = threads or default_threads()
        self.python = python or sys.executable
        self._idle: list[RunnerHandle] = []
        self._leased: set[RunnerHandle] = set()
        self._refs: dict[str, list[RunnerHandle]] = {}  # warm reference runners per task
        self.max_references = max(1, references)
        #: candidate runners kept for the next stage of their one candidate, by its key
        self._kept: OrderedDict[str, tuple[RunnerHandle, float]] = OrderedDict()
        self.max_kept = current().kept_runners if kept is None else max(0, kept)
        self._lock = threading.Lock()
        #: reference runners leased now, per key; notified when one comes back or goes
        self._refs_busy: dict[str, set[RunnerHandle]] = {}
        self._returned = threading.Condition(self._lock)
        self._closed = False

    def _spawn(self) -> RunnerHandle:
        handle = RunnerHandle(self.python, self.threads, warm=self.warm)
        log.debug("runner_spawned", pid=handle.pid)
        return handle

    def _fill(self) -> None:
        # Caller holds the lock.
        while not self._closed and len(self._idle) < self.size:
            self._idle.append(self._spawn())

    def configure(
        self,
        *,
        size: int,
        warm: str | None,
        references: int | None = None,
        kept: int | None = None,
    ) -> None:
        """Change the number of idle runners kept and what they warm up for (idle
        runners started for another warm-up are replaced), and the idle reference
        runners and candidate runners kept (None: as it is)."""
        with self._lock:
            if references is not None:
                self.max_references = max(1, references)
            if kept is not None:
                self.max_kept = max(0, kept)
            stale = [h for h in self._idle if h.warm != warm]
            self._idle = [h for h in self._idle if h.warm == warm]
            self.size, self.warm = max(0, size), warm
            self._fill()
        for handle in stale:
            handle.kill()

    def start(self) -> None:
        """Spawn the warm runners now (otherwise they are spawned on first use)."""
        with self._lock:
            self._fill()

    def acquire(self) -> RunnerHandle:
        """Take a runner (started earlier when possible) and spawn its replacement."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the runner pool is closed")
            handle = self._idle.pop(0) if self._idle else self._spawn()
            self._leased.add(handle)
            self._fill()
        return handle

    def release(self, handle: RunnerHandle) -> None:
        """Discard a leased runner (runners are never reused)."""
        handle.kill()
        with self._lock:
            self._leased.discard(handle)

    def acquire_ready(self, attempts: int = 3) -> RunnerHandle:
        """A leased runner that has started; a runner that fails to start is replaced."""
        for attempt in range(1, attempts + 1):
            handle = self.acquire()
            began = time.monotonic()
            try:
                handle.wait_ready()
                ended = time.monotonic()
                REQUESTS.append(RequestTiming("lease_wait", ended - began, 0.0, ended, handle.pid))
            except RunnerError as exc:
                self.release(handle)
                log.warning(
                    "runner_start_failed",
                    attempt=attempt,
                    error=str(exc),
                    log_tail=exc.log_tail[-1000:],
                )
                if attempt == attempts:
                    raise RunnerStartError(
                        f"no runner could start ({exc}); its output ends with:\n"
                        f"{exc.log_tail[-1500:]}"
                    ) from exc
                continue
            return handle
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.contextmanager
    def lease(self, key: str | None = None) -> Iterator[RunnerHandle]:
        """A started runner for one job, killed when the block ends; with ``key`` (one
        candidate's, :attr:`GradingSession.candidate_key`), the runner an earlier stage
        of that candidate kept, if it is still there and alive.

        The block keeps the runner for its candidate's next stage by setting the
        handle's ``keep_as`` to the key; only a block that ends without an exception,
        with the runner alive and not marked ``discard``, keeps it."""
        handle = self._take_kept(key) if key else None
        if handle is None:
            handle = self.acquire_ready()
        handle.keep_as = None
        ended = False
        try:
            yield handle
            ended = True
        finally:
            alive = handle.proc.poll() is None and not handle.discard
            if ended and alive and handle.keep_as and self.max_kept > 0:
                self._keep(handle, handle.keep_as)
            else:
                self.release(handle)

    def _take_kept(self, key: str) -> RunnerHandle | None:
        """The runner kept for ``key`` (leased now), or None; the seconds it waited
        kept are its ``kept_s``."""
        with self._lock:
            found = self._kept.pop(key, None)
            if found is not None and not self._closed:
                self._leased.add(found[0])
        if found is None:
            return None
        handle, since = found
        handle.unquiet()  # stopped while kept
        if self._closed or handle.proc.poll() is not None:
            self.release(handle)
            return None
        handle.kept_s = time.monotonic() - since
        log.debug("runner_reused", pid=handle.pid, kept_s=round(handle.kept_s, 3))
        return handle

    def _keep(self, handle: RunnerHandle, key: str) -> None:
        """Keep ``handle`` for ``key``'s next stage. Runners kept longer than
        :data:`KEPT_MAX_AGE_S` go first; when ``max_kept`` are still kept, ``handle`` is
        killed instead: the stages take candidates about in the order they came (a
        profile queue on a GPU), so the oldest kept are the next to be taken."""
        evicted: list[RunnerHandle] = []
        # stopped while kept, spinner children and all: nothing of a candidate runs while
        # it waits for its next stage (before it is kept: a stage may take it at once)
        handle.quiet()
        now = time.monotonic()
        with self._lock:
            self._leased.discard(handle)
            old = self._kept.pop(key, None)
            if old is not None:
                evicted.append(old[0])
            while self._kept and now - next(iter(self._kept.values()))[1] > KEPT_MAX_AGE_S:
                evicted.append(self._kept.popitem(last=False)[1][0])
            full = not self._closed and len(self._kept) >= self.max_kept
            if self._closed or full:
                evicted.append(handle)
            else:
                self._kept[key] = (handle, now)
        if full:  # its next stage starts a runner again: a sign the cap is too low
            log.info("candidate_runner_not_kept", pid=handle.pid, kept=self.max_kept)
        for h in evicted:
            h.kill()

    def drop_kept(self, key: str) -> None:
        """Kill the runner kept for ``key`` (its candidate needs no more stages here)."""
        with self._lock:
            found = self._kept.pop(key, None)
        if found is not None:
            found[0].kill()

    @contextlib.contextmanager
    def reference_lease(
        self,
        key: str,
        prefer: Callable[[RunnerHandle], bool] | None = None,
        wait_s: float = 0.0,
        only_preferred: bool = False,
    ) -> Iterator[RunnerHandle]:
        """A candidate-free runner for the reference side of one job, reused per ``key``.

        No candidate code ever runs in a reference runner (it only imports the task,
        makes inputs, runs the reference and compares), so it can serve many candidates
        of the same task: that saves a Python + torch start-up per stage. Any error
        discards it; at most ``max_references`` are kept, the oldest killed first.
        ``prefer``: an idle runner it holds true of is taken first (one that has
        compiled the task's baseline, say); only a preference, unless ``only_preferred``:
        then a fresh runner rather than an idle one it holds false of (counters hold
        theirs through a turn that lets every timing go first, and must not keep the
        runner holding the task's compiled baseline from a profile meanwhile).
        ``wait_s``: when none idle is preferred but one leased for ``key`` is, how long to
        wait for it to come back first (a profile waits for the verification that holds
        its task's compiled baseline rather than compile it again, 10-15 s on an H200,
        while holding the device's shared side, which every timing then waits on).

        It is dropped when it died, was marked ``discard``, or one of its own requests
        failed (an answer of the runner is then in doubt); an error of another runner
        of the job (a candidate's, say, which the caller handles) leaves it as good as
        it was: its requests and answers went one at a time and all were answered.
        """
        handle = self._take_reference(key, prefer, wait_s, only_preferred)
        if handle is None:
            handle = self.acquire_ready()
            log.info("reference_runner_started", task_key=key[:16], pid=handle.pid)
        with self._lock:
            busy = self._refs_busy.setdefault(key, set())
            busy.add(handle)
        failed: str | None = "its job was interrupted"
        try:
            yield handle
            failed = None
        except RunnerError as exc:
            failed = "its request failed" if exc.runner_pid == handle.pid else None
            raise
        except Exception:
            failed = None  # not the runner's: it answered every request it was sent
            raise
        finally:
            with self._returned:
                busy.discard(handle)
            if failed or handle.discard or handle.proc.poll() is not None:
                why = failed or ("discarded" if handle.discard else "it died")
                _dropped(handle, key, why)
                self.release(handle)
                with self._returned:
                    self._returned.notify_all()
            else:
                evicted: list[tuple[str, RunnerHandle, str]] = []
                with self._returned:
                    self._returned.notify_all()
                    self._leased.discard(handle)
                    if self._closed:
                        evicted.append((key, handle, "the pool is closed"))
                    else:
                        self._refs.setdefault(key, []).append(handle)
                        kept = [(k, h) for k, hs in self._refs.items() for h in hs]
                        # runners holding a compiled baseline go last (minutes of
                        # compiling over a run's tasks); the oldest of each kind first
                        kept.sort(key=lambda kh: bool(kh[1].baselines))
                        while len(kept) > self.max_references:
                            k, h = kept.pop(0)
                            self._refs[k].remove(h)
                            evicted.append((k, h, "evicted: more idle reference runners than kept"))
                for k, h, why in evicted:
                    _dropped(h, k, why)
                    h.kill()

    def wait_for_reference(
        self, key: str, prefer: Callable[[RunnerHandle], bool], wait_s: float
    ) -> bool:
        """Wait up to ``wait_s`` while no idle reference runner of ``key`` is preferred
        but one leased elsewhere is; True: a preferred one is idle now. Nothing is
        leased: a profile waits here before it takes its share of the device, so that no
        timing waits on its wait (:meth:`reference_lease` may still wait, if another stage
        takes that runner first)."""
        with self._returned:
            return self._wait_preferred(key, prefer, time.monotonic() + wait_s)

    def _wait_preferred(
        self, key: str, prefer: Callable[[RunnerHandle], bool] | None, deadline: float
    ) -> bool:
        """(Holding ``_returned``) :meth:`wait_for_reference` until ``deadline``."""
        while True:
            idle = self._refs.get(key, [])
            if prefer is None or any(prefer(h) for h in idle):
                return True
            left = deadline - time.monotonic()
            wanted = any(prefer(h) for h in self._refs_busy.get(key, ()))
            if self._closed or left <= 0 or not wanted:
                return False
            self._returned.wait(left)

    def _take_reference(
        self,
        key: str,
        prefer: Callable[[RunnerHandle], bool] | None,
        wait_s: float,
        only_preferred: bool = False,
    ) -> RunnerHandle | None:
        """An idle reference runner of ``key``, leased now (a preferred one first, after
        waiting up to ``wait_s`` for a preferred one leased elsewhere; ``only_preferred``:
        no other); None: none idle."""
        with self._returned:
            self._wait_preferred(key, prefer, time.monotonic() + wait_s)
            idle = self._refs.get(key, [])
            if prefer is not None:
                # the preferred ones last, so the loop below pops them first
                idle.sort(key=lambda h: bool(prefer(h)))
            while idle:
                if only_preferred and prefer is not None and not prefer(idle[-1]):
                    break  # sorted: none left is preferred
                h = idle.pop()
                if h.proc.poll() is None:
                    self._leased.add(h)
                    return h
                _dropped(h, key, "it died while idle")
                h.kill()
        return None

    def wait_warm(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until every idle runner has finished starting (quiet machine for timing)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            idle = list(self._idle)
        for handle in idle:
            try:
                handle.wait_ready(max(0.0, deadline - time.monotonic()))
            except RunnerError:
                with self._lock:
                    if handle in self._idle:
                        self._idle.remove(handle)

    def close(self) -> None:
        """Kill every runner, idle or leased; later acquires fail."""
        with self._returned:
            self._closed = True
            self._returned.notify_all()
            handles = [*self._idle, *self._leased, *(h for hs in self._refs.values() for h in hs)]
            handles += [h for h, _ in self._kept.values()]
            self._idle.clear()
            self._leased.clear()
            self._refs.clear()
            self._kept.clear()
        for handle in handles:
            handle.kill()


def _dropped(handle: RunnerHandle, key: str, why: str) -> None:
    """Say in the log that a reference runner is gone and what it held (a compiled
    baseline lost is a compile again in some profile's timing turn)."""
    log.info(
        "reference_runner_dropped", task_key=key[:16], pid=handle.pid, why=why,
        baselines=sorted(handle.baselines),
    )  # fmt: skip


_default: RunnerPool | None = None
_default_lock = threading.Lock()


#: what the process's worker asked of its pool (:func:`configure_default_pool`): its
#: size, warm-up, reference runners and kept candidate runners (None: the setting's)
_configured: tuple[int, str | None, int, int | None] | None = None


def _pool_settings() -> tuple[int, str | None, int, int | None]:
    if _configured is not None:
        return _configured
    settings = current()
    size, references = settings.eval_pool, settings.reference_runners
    return (2 if size is None else size), settings.runner_warm, references or 4, None


def default_pool() -> RunnerPool:
    """The process-wide pool (size ``$KF_EVAL_POOL``, default 2, runners warmed for
    ``$KF_RUNNER_WARM``, unless :func:`configure_default_pool` said otherwise), closed
    at exit."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            size, warm, references, kept = _pool_settings()
            _default = RunnerPool(size=size, warm=warm, references=references, kept=kept)
            atexit.register(_default.close)
        return _default


def configure_default_pool(
    *,
    size: int | None = None,
    warm: str | None,
    references: int | None = None,
    kept: int | None = None,
) -> None:
    """Give the process-wide pool ``size`` idle runners (None: ``$KF_EVAL_POOL``, 2)
    warmed for ``warm`` (a worker's choice for its device), ``references`` idle
    reference runners (None: ``$KF_REFERENCE_RUNNERS``, 4) and ``kept`` candidate
    runners kept between stages (None: ``$KF_KEPT_RUNNERS``, 8): now if the pool exists
    already (a task check made it before the worker started; see
    :meth:`RunnerPool.configure`), else when it is made."""
    global _configured
    asked = _pool_settings()
    size = asked[0] if size is None else size
    references = asked[2] if references is None else references
    kept = asked[3] if kept is None else kept
    with _default_lock:
        _configured = (size, warm, references, kept)
        pool = _default if _default is not None and not _default._closed else None
    if pool is not None:
        pool.configure(size=size, warm=warm, references=references, kept=kept)
