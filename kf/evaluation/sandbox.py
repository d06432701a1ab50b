"""Sandboxed runner processes and a pool of pre-spawned warm ones.

Each runner is ``python -m kf.evaluation.runner`` started inside bubblewrap's box
(:mod:`kf.evaluation.box`: its own user, PID, network and mount namespaces, uid 65534,
an allow-listed environment, nothing writable but a size-limited scratch tmpfs), in its
own session (process group); the runner's audit hook also refuses socket calls once a
candidate is loaded. Where the box cannot be set up kf refuses to evaluate, unless
``$KF_UNSAFE_NO_SANDBOX=1`` asks for the old, unboxed runners (a private scratch
directory as cwd and ``TMPDIR``, a network namespace of their own where the kernel
allows it, ``$KF_EVAL_NETNS=0`` turning that off), whose every report is marked.
Limits (address space, CPU seconds, file size) are applied when a runner is set up for
its one job. A runner serves one candidate (or one task reference) and is then killed;
the pool keeps a few started in advance so the next job's interpreter and torch import
overlap this one's work.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from kf.evaluation import box, shared_memory
from kf.evaluation.protocol import decode, encode
from kf.settings import applied, current

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
]

log = structlog.get_logger("kf.evaluation.sandbox")

_LOG_TAIL = 4000
STARTUP_TIMEOUT_S = 180.0

#: The last requests to any runner of this process, oldest first: where a stage's time
#: goes (``bench/gpu_stage_phases.py`` reads it). Appending to a deque is thread-safe.
REQUESTS: deque[RequestTiming] = deque(maxlen=20_000)


class RequestTiming(NamedTuple):
    """One request to a runner: its op, the grader's wall time around it, the handler's
    own time inside the runner (the rest is transport, queueing and scheduling), when it
    ended (``time.monotonic``), and the runner's pid. ``op`` ``"lease_wait"`` is time
    spent waiting for a leased runner to finish starting."""

    op: str
    wall_s: float
    runner_s: float
    ended: float
    pid: int
    #: the handler's own breakdown where it gives one (``run``: inputs, forward, outputs)
    detail: dict[str, float] | None = None


_netns: bool | None = None


def network_namespace_available() -> bool:
    """Whether runners can start in a fresh network namespace (probed once)."""
    global _netns
    if _netns is None:
        unshare = shutil.which("unshare")
        if not current().eval_netns or unshare is None:
            _netns = False
        else:
            try:
                probe = subprocess.run(
                    [unshare, "-rn", "true"], capture_output=True, timeout=10, check=False
                )
                _netns = probe.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                _netns = False
    return _netns


def default_threads() -> int:
    """Threads for torch and OpenMP in every runner: ``$KF_EVAL_THREADS`` or the usable cores."""
    threads = current().eval_threads
    if threads is not None:
        return threads
    return max(1, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class Limits:
    """Resource limits applied to a runner for its job (0 means no limit)."""

    #: ``$KF_EVAL_MEMORY_MB`` (8192), where an address-space limit applies
    memory_bytes: int = field(default_factory=lambda: current().eval_memory_mb * 2**20)
    cpu_s: int = 0  # derived from the stage's timeout when 0
    #: per file, the runner's own output log included (``$KF_EVAL_FILE_MB``, 256)
    file_bytes: int = field(default_factory=lambda: current().eval_file_mb * 2**20)


class RunnerError(Exception):
    """A request to a runner did not produce a reply."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class RunnerStartError(RuntimeError):
    """No runner process could be started (a broken environment, not a candidate's fault)."""


class RunnerTimeout(RunnerError):
    """The runner did not answer in time and was killed."""


class RunnerCrashed(RunnerError):
    """The runner process died; ``signal_name`` is set when a signal killed it."""

    def __init__(self, message: str, log_tail: str, returncode: int | None) -> None:
        super().__init__(message, log_tail)
        self.returncode = returncode
        self.signal_name: str | None = None
        if returncode is not None and returncode < 0:
            try:
                self.signal_name = signal.Signals(-returncode).name
            except ValueError:
                self.signal_name = f"signal {-returncode}"


class RunnerFailed(RunnerError):
    """The runner answered with an error (``kind`` says which: exception, compile_error…)."""

    def __init__(self, kind: str, message: str, log_tail: str = "") -> None:
        super().__init__(message, log_tail)
        self.kind = kind


class RunnerHandle:
    """The grader's side of one runner process."""

    def __init__(
        self,
        python: str,
        threads: int,
        *,
        wrapper: Sequence[str] = (),
        isolate: bool = True,
        warm: str | None = None,
        ro_paths: Sequence[str] = (),
        rw_paths: Sequence[str] = (),
    ) -> None:
        """Start a runner in the box (:mod:`kf.evaluation.box`); ``wrapper`` (e.g.
        ncu's argv) runs it, inside the box, with ``ro_paths`` and ``rw_paths`` bound in
        besides (the tool, its output folder); ``warm`` names the device whose start-up
        work (a CUDA context, the op tracer) it does before it says it is ready.

        Raises :class:`kf.evaluation.box.SandboxUnavailable` where the box cannot be set
        up and ``$KF_UNSAFE_NO_SANDBOX=1`` does not ask for none. Unboxed runners (that
        mode) start in a network namespace unless ``isolate`` is False.
        """
        #: "bwrap", or "unsafe-no-sandbox": what every report of this runner says
        self.sandbox = box.mode()
        self.scratch = Path(tempfile.mkdtemp(prefix="kf-runner-"))
        self.log_path = self.scratch / "runner.log"
        self.threads = threads
        parent_sock, child_sock = socket.socketpair()
        # the environment with this process's settings (kf.settings.apply: a command's
        # flags), which the runner reads as its own
        env = {**os.environ, **applied()}
        env.update(
            TMPDIR=str(self.scratch),
            # build tools the runner starts add their verdicts to its log (kf.cuda.objcache)
            KF_OBJCACHE_LOG=str(self.log_path),
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
        )
        self.warm = warm
        env.pop("KF_RUNNER_WARM", None)
        if warm:
            env["KF_RUNNER_WARM"] = warm
        # Fair timing on a CPU: idle OpenMP threads of one runner must not spin while the
        # other runner is being timed, and big buffers are reused from the heap rather than
        # mmap'ed afresh (page faults) on every call — which helps eager's temporaries most,
        # so the baseline gets stronger, never weaker. The user's own settings win.
        for key, value in (
            ("OMP_WAIT_POLICY", "PASSIVE"),
            ("MALLOC_MMAP_THRESHOLD_", str(1 << 30)),
            ("MALLOC_TRIM_THRESHOLD_", str(1 << 31)),
        ):
            env.setdefault(key, value)
        self.findings: list[str] = []
        self.builds = 0  # kf.native builds served for this runner (kf.evaluation.builds)
        runner = [python, "-P", "-m", "kf.evaluation.runner", str(child_sock.fileno())]
        if self.sandbox == box.MODE_BWRAP:
            self.isolated_network = True
            # the log must exist before bwrap binds it into the box
            self.log_path.touch()
            prefix = box.command(
                python=python,
                scratch=self.scratch,
                log_path=self.log_path,
                # kf.native builds go through the grader (kf.evaluation.builds)
                env=box.environment(env, self.scratch, {"KF_BUILD_SERVICE": "1"}),
                ro_paths=ro_paths,
                rw_paths=rw_paths,
            )
            # the grader's pid means nothing in the box's PID namespace: 0 says so
            argv = [*prefix, "--", *wrapper, *runner, "0"]
            env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"}
        else:
            self.isolated_network = isolate and network_namespace_available()
            unshare = [str(shutil.which("unshare")), "-rn"] if self.isolated_network else []
            argv = [*wrapper, *unshare, *runner, str(os.getpid())]
        # appending: the runner and the build tools it starts write to it side by side
        with open(self.log_path, "ab") as logf:
            self.proc = (
                _spawner()
                .submit(
                    subprocess.Popen,
                    argv,
                    pass_fds=(child_sock.fileno(),),
                    cwd=self.scratch,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                .result()
            )
        child_sock.close()
        # descriptors of shared-memory payloads go beside the messages, on the same socket
        self.fd_sock = socket.socket(fileno=os.dup(parent_sock.fileno()))
        self.conn = Connection(parent_sock.detach())
        self.ready = False
        self.closed = False
        # set by the grader: do not keep this (reference) runner for reuse
        self.discard = False
        self._ready_lock = threading.Lock()
        self.spawned_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-_LOG_TAIL:].decode("utf-8", "replace")

    def _receive(self, timeout_s: float, what: str) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            msg = self._receive_one(max(0.0, end - time.monotonic()), timeout_s, what)
            if msg.get("op") != "build" or self.sandbox != box.MODE_BWRAP:
                return msg
            self._serve_build(msg, max(1.0, end - time.monotonic()))

    def _serve_build(self, msg: dict[str, Any], left_s: float) -> None:
        """Build a boxed runner's ``kf.native`` library (:mod:`kf.evaluation.builds`)."""
        from kf.evaluation.buildlimits import build_timeout_s
        from kf.evaluation.builds import MAX_BUILDS_PER_RUNNER, build_inline, build_native

        self.builds += 1
        try:
            if self.builds > MAX_BUILDS_PER_RUNNER:
                reply: dict[str, Any] = {
                    "ok": False,
                    "error": f"more than {MAX_BUILDS_PER_RUNNER} builds asked for by one runner",
                }
            elif msg.get("kind") == "cuda_inline":
                reply = build_inline(
                    dict(msg["arguments"]),
                    dict(msg["environment"]),
                    min(build_timeout_s(), left_s),  # the grader's build limit
                )
            else:
                reply = build_native(
                    str(msg["source"]),
                    [str(f) for f in msg.get("flags") or []],
                    {str(k): str(v) for k, v in dict(msg.get("defines") or {}).items()},
                    min(float(msg.get("timeout_s") or 120.0), left_s),
                )
        except (KeyError, TypeError, ValueError) as exc:
            reply = {"ok": False, "error": f"malformed build request: {exc}"}
        with contextlib.suppress(OSError):
            self.conn.send_bytes(encode({"op": "built", **reply}))

    def _receive_one(self, left_s: float, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            has_reply = self.conn.poll(left_s)
        except OSError:
            has_reply = True
        if not has_reply:
            tail = self.log_tail()
            self.kill()
            raise RunnerTimeout(f"no answer after {timeout_s:.1f}s during {what}", tail)
        try:
            reply = shared_memory.receive_message(
                self.conn.recv_bytes, self.fd_sock, self.conn.poll, decode, 10.0
            )
        except (EOFError, OSError) as exc:
            returncode = self._wait_exit()
            tail = self.log_tail()
            self.kill()
            if returncode is not None and returncode < 0:
                name = RunnerCrashed("", "", returncode).signal_name
                why = f"process killed by {name} during {what}"
            else:
                why = f"process exited with status {returncode} during {what}"
            raise RunnerCrashed(why, tail, returncode) from exc
        except Exception as exc:  # undecodable bytes: the process wrote garbage on the socket
            tail = self.log_tail()
            self.kill()
            raise RunnerCrashed(f"garbled reply during {what}: {exc}", tail, None) from exc
        return reply

    def _wait_exit(self) -> int | None:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None
        if self.sandbox == box.MODE_BWRAP and 128 < code < 128 + signal.NSIG:
            return 128 - code  # bwrap exits 128 + N for a runner killed by signal N
        return code

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Block until the runner has imported torch (raises RunnerError if it cannot)."""
        with self._ready_lock:
            if self.ready:
                return
            reply = self._receive(timeout_s, "start-up")
            if reply.get("op") != "ready":
                self.kill()
                raise RunnerCrashed(f"unexpected start-up message {reply!r}", self.log_tail(), None)
            self.ready = True

    def poll_ready(self) -> bool:
        """True once the ready message has arrived (does not block)."""
        with contextlib.suppress(OSError):
            if not self.ready and self.conn.poll(0):
                self.wait_ready(1.0)
        return self.ready

    def request(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raise RunnerError on any failure."""
        self.wait_ready()
        what = op if "what" not in fields else str(fields.pop("what"))
        request_id = secrets.randbits(62)
        began = time.monotonic()
        try:
            shared_memory.send_message(
                self.conn.send_bytes, self.fd_sock, encode, {"op": op, "id": request_id, **fields}
            )
        except OSError as exc:
            returncode = self._wait_exit()
            tail = self.log_tail()
            self.kill()
            raise RunnerCrashed(f"process gone before {what}", tail, returncode) from exc
        reply = self._receive(timeout_s, what)
        ended = time.monotonic()
        took = reply.get("took_ns")
        runner_s = took / 1e9 if isinstance(took, int) else 0.0
        phases = reply.get("phases_ns")
        detail = (
            {str(k): v / 1e9 for k, v in phases.items() if isinstance(v, int)}
            if isinstance(phases, dict)
            else None
        )
        REQUESTS.append(RequestTiming(op, ended - began, runner_s, ended, self.pid, detail))
        forged = reply.get("id") != request_id
        with contextlib.suppress(OSError):
            forged = forged or self.conn.poll(0)  # a second message nobody asked for
        if forged:
            tail = self.log_tail()
            self.kill()
            raise RunnerFailed(
                "tampering",
                f"the runner's reply during {what} did not answer the grader's request "
                "(a message forged or injected on the grading socket)",
                tail,
            )
        findings = reply.get("findings")
        if isinstance(findings, list):
            self.findings.extend(str(f) for f in findings if str(f) not in self.findings)
        if not reply.get("ok"):
            raise RunnerFailed(
                str(reply.get("kind", "exception")),
                str(reply.get("error", "unknown error")),
                str(reply.get("log", "")),
            )
        return reply

    def finish(self, timeout_s: float) -> int | None:
        """Ask the runner to exit and wait for it (and any wrapper, e.g. ncu) to end."""
        with contextlib.suppress(OSError):
            self.conn.send_bytes(encode({"op": "exit"}))
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Kill the runner's whole process group and remove its scratch directory."""
        if self.closed:
            return
        self.closed = True
        if self.sandbox == box.MODE_BWRAP and self.proc.poll() is None:
            # (not reaped yet: its pid is still bwrap's) bwrap's init in the box first: the
            # kernel then kills everything in the box's PID namespace, and bwrap exits
            # once it is empty, so nothing is left when the wait below returns
            for child in _children(self.proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            self.conn.close()
        with contextlib.suppress(OSError):
            self.fd_sock.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


_spawn_thread: ThreadPoolExecutor | None = None
_spawn_lock = threading.Lock()


def _spawner() -> ThreadPoolExecutor:
    """The one thread that starts every runner, alive as long as this process.

    bwrap's ``--die-with-parent`` is the kernel's parent-death signal, which fires when
    the *thread* that started bwrap ends, not the process: a runner started from a
    short-lived worker thread would be killed with that thread.
    """
    global _spawn_thread
    with _spawn_lock:
        if _spawn_thread is None:
            _spawn_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kf-spawner")
        return _spawn_thread


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (empty when /proc cannot say)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


class RunnerPool:
    """A thread-safe pool of warm runners; each leased runner is used once and killed."""

    def __init__(
        self,
        size: int = 2,
        *,
        threads: int | None = None,
        python: str | None = None,
        warm: str | None = None,
    ):
        """``warm``: the device (``cuda:N``) whose start-up work runners do while idle."""
        self.size = max(0, size)
        self.warm = warm
        self.threads = threads or default_threads()
        self.python = python or sys.executable
        self._idle: list[RunnerHandle] = []
        self._leased: set[RunnerHandle] = set()
        self._refs: dict[str, list[RunnerHandle]] = {}  # warm reference runners per task
        self.max_references = 4
        self._lock = threading.Lock()
        self._closed = False

    def _spawn(self) -> RunnerHandle:
        handle = RunnerHandle(self.python, self.threads, warm=self.warm)
        log.debug("runner_spawned", pid=handle.pid)
        return handle

    def _fill(self) -> None:
        # Caller holds the lock.
        while not self._closed and len(self._idle) < self.size:
            self._idle.append(self._spawn())

    def configure(self, *, size: int, warm: str | None) -> None:
        """Change the number of idle runners kept and what they warm up for; idle
        runners started for another warm-up are replaced."""
        with self._lock:
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
    def lease(self) -> Iterator[RunnerHandle]:
        """A started runner for one job, killed when the block ends."""
        handle = self.acquire_ready()
        try:
            yield handle
        finally:
            self.release(handle)

    @contextlib.contextmanager
    def reference_lease(self, key: str) -> Iterator[RunnerHandle]:
        """A candidate-free runner for the reference side of one job, reused per ``key``.

        No candidate code ever runs in a reference runner (it only imports the task,
        makes inputs, runs the reference and compares), so it can serve many candidates
        of the same task: that saves a Python + torch start-up per stage. Any error
        discards it; at most ``max_references`` are kept, the oldest killed first.
        """
        handle: RunnerHandle | None = None
        with self._lock:
            idle = self._refs.get(key, [])
            while idle and handle is None:
                h = idle.pop()
                if h.proc.poll() is None:
                    handle = h
                    self._leased.add(h)
                else:
                    h.kill()
        if handle is None:
            handle = self.acquire_ready()
        ok = False
        try:
            yield handle
            ok = True
        finally:
            if not ok or handle.discard or handle.proc.poll() is not None:
                self.release(handle)
            else:
                evicted: list[RunnerHandle] = []
                with self._lock:
                    self._leased.discard(handle)
                    if self._closed:
                        evicted.append(handle)
                    else:
                        self._refs.setdefault(key, []).append(handle)
                        kept = [(k, h) for k, hs in self._refs.items() for h in hs]
                        while len(kept) > self.max_references:
                            k, h = kept.pop(0)
                            self._refs[k].remove(h)
                            evicted.append(h)
                for h in evicted:
                    h.kill()

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
        with self._lock:
            self._closed = True
            handles = [*self._idle, *self._leased, *(h for hs in self._refs.values() for h in hs)]
            self._idle.clear()
            self._leased.clear()
            self._refs.clear()
        for handle in handles:
            handle.kill()


_default: RunnerPool | None = None
_default_lock = threading.Lock()


#: what the process's worker asked of its pool (:func:`configure_default_pool`)
_configured: tuple[int, str | None] | None = None


def _pool_settings() -> tuple[int, str | None]:
    if _configured is not None:
        return _configured
    settings = current()
    size = settings.eval_pool
    return (2 if size is None else size), settings.runner_warm


def default_pool() -> RunnerPool:
    """The process-wide pool (size ``$KF_EVAL_POOL``, default 2, runners warmed for
    ``$KF_RUNNER_WARM``, unless :func:`configure_default_pool` said otherwise), closed
    at exit."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            size, warm = _pool_settings()
            _default = RunnerPool(size=size, warm=warm)
            atexit.register(_default.close)
        return _default


def configure_default_pool(*, size: int | None = None, warm: str | None) -> None:
    """Give the process-wide pool ``size`` idle runners (None: ``$KF_EVAL_POOL``, 2)
    warmed for ``warm`` (a worker's choice for its device): now if the pool exists
    already (a task check made it before the worker started; see
    :meth:`RunnerPool.configure`), else when it is made."""
    global _configured
    if size is None:
        size = _pool_settings()[0]
    with _default_lock:
        _configured = (size, warm)
        pool = _default if _default is not None and not _default._closed else None
    if pool is not None:
        pool.configure(size=size, warm=warm)
