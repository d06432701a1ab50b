"""The grader's side of one runner process: its start-up message, typed requests and
their replies (:mod:`kf.evaluation.wire.protocol`), the builds a boxed runner asks for, and
its end.

Bytes that are not MessagePack are a garbled reply (the runner is killed,
:class:`RunnerCrashed`); a message longer than
:func:`~kf.evaluation.grader.runner_socket.message_limit` is not read at all (the runner
is killed, :class:`RunnerFailed` ``tampering``: kf's runner never sends one); a message
that is not one of the protocol's, or does not answer the request sent (another
request's id, another request's reply type, a second message nobody asked for) is
tampering (:class:`RunnerFailed`, the runner killed); a
:class:`~kf.evaluation.wire.protocol.Failed` reply raises :class:`RunnerFailed` with its kind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any, NamedTuple, TypeVar

import msgspec

from kf.capture import while_wanted
from kf.evaluation.grader import box, box_quiet, spawn
from kf.evaluation.grader.runner_socket import (
    MessageStalled,
    MessageTooLarge,
    message_limit,
    read_message,
)
from kf.evaluation.wire import protocol, shared_memory
from kf.evaluation.wire.protocol import decode_from_runner, encode

__all__ = [
    "REQUESTS",
    "STARTUP_TIMEOUT_S",
    "RequestTiming",
    "RunnerCrashed",
    "RunnerError",
    "RunnerFailed",
    "RunnerHandle",
    "RunnerStartError",
    "RunnerTimeout",
    "quiet_others",
]

_LOG_TAIL = 4000
STARTUP_TIMEOUT_S = 180.0
_R = TypeVar("_R", bound=protocol.Reply)

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
    #: device memory the runner's allocator reserved at most during the request, and held
    #: at its end, as the runner states them (:class:`kf.evaluation.wire.protocol.Reply`)
    peak_bytes: int = 0
    held_bytes: int = 0
    #: of those, the bytes in live tensors, most and last
    peak_allocated_bytes: int = 0
    allocated_bytes: int = 0


class RunnerError(Exception):
    """A request to a runner did not produce a reply."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail
        #: the pid of the runner whose request (or start-up) failed, once the handle
        #: that raised has said so: a reused reference runner is dropped for its own
        #: failures, not for another runner's (:meth:`RunnerPool.reference_lease`)
        self.runner_pid: int | None = None


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
        """Start a runner in the box (:mod:`kf.evaluation.grader.box`,
        :func:`kf.evaluation.grader.spawn.start`);
        ``wrapper`` (e.g. ncu's argv) runs it, inside the box, with ``ro_paths`` and
        ``rw_paths`` bound in besides (the tool, its output folder); ``warm`` names the
        device whose start-up work (a CUDA context, the op tracer) it does before it says
        it is ready.

        Raises :class:`kf.evaluation.grader.box.SandboxUnavailable` where the box cannot be set
        up and ``$KF_UNSAFE_NO_SANDBOX=1`` does not ask for none. Unboxed runners (that
        mode) start in a network namespace unless ``isolate`` is False.
        """
        started = spawn.start(
            python,
            threads,
            wrapper=wrapper,
            isolate=isolate,
            warm=warm,
            ro_paths=ro_paths,
            rw_paths=rw_paths,
        )
        #: "bwrap", or "unsafe-no-sandbox": what every report of this runner says
        self.sandbox = started.sandbox
        self.isolated_network = started.isolated_network
        self.scratch = started.scratch
        self.log_path = started.log_path
        self.proc = started.proc
        self.threads = threads
        self.warm = warm
        self.findings: list[str] = []
        self.builds = 0  # kf.native builds served for this runner (kf.evaluation.grader.builds)
        self.build_s = 0.0  # seconds spent serving them (not counted against a request)
        #: compile modes a reference runner has compiled its task's baseline in (the
        #: runner's own cache decides; this only steers which idle runner a stage takes)
        self.baselines: set[str] = set()
        # descriptors of shared-memory payloads go beside the messages, on the same socket
        self.fd_sock = socket.socket(fileno=os.dup(started.sock.fileno()))
        self.conn = Connection(started.sock.detach())
        self.ready = False
        self.closed = False
        # set by the grader: do not keep this (reference) runner for reuse
        self.discard = False
        #: set by a stage: keep this candidate runner for the candidate's next stage, under
        #: this key (:meth:`kf.evaluation.grader.sandbox.RunnerPool.lease`)
        self.keep_as: str | None = None
        #: seconds this runner waited, kept, for the stage that took it (0: a fresh one)
        self.kept_s = 0.0
        self._ready_lock = threading.Lock()
        self.spawned_at = time.monotonic()
        #: the box's processes just before its first candidate was loaded (None: none yet)
        self._own: frozenset[int] | None = None
        #: :meth:`quiet`'s holds: the box is stopped while there is one
        self._holds = 0
        self._quiet_lock = threading.Lock()
        self._stopped_since: float | None = None
        self._stopped_s = 0.0
        #: why kf killed the runner itself (said in the error of the request it broke)
        self.killed_why: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> str:
        try:  # only the tail is read: the log may hold up to $KF_EVAL_FILE_MB
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - _LOG_TAIL))
                data = f.read(_LOG_TAIL)
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    def _receive(self, timeout_s: float, what: str) -> protocol.ToGrader:
        end = time.monotonic() + timeout_s
        while True:
            msg = self._receive_one(max(0.0, end - time.monotonic()), timeout_s, what)
            if self.sandbox != box.MODE_BWRAP:
                return msg
            if isinstance(msg, protocol.BuildNative | protocol.BuildInline):
                began = time.monotonic()
                # a build for a runner that died (its box killed) is killed, not waited for
                with while_wanted(lambda: self.proc.poll() is None):
                    self._serve_build(msg)
                spent = time.monotonic() - began
                # a build has the build limit, not the request's: its time is not the request's
                self.build_s += spent
                end += spent
            else:
                return msg

    def _serve_build(self, msg: protocol.BuildNative | protocol.BuildInline) -> None:
        """Build a boxed runner's ``kf.native`` library or ``load_inline`` extension
        (:mod:`kf.evaluation.grader.builds`)."""
        from kf.buildlimits import build_timeout_s
        from kf.evaluation.grader.builds import MAX_BUILDS_PER_RUNNER, build_inline, build_native

        self.builds += 1
        result: dict[str, Any]
        try:
            if self.builds > MAX_BUILDS_PER_RUNNER:
                result = {
                    "ok": False,
                    "error": f"more than {MAX_BUILDS_PER_RUNNER} builds asked for by one runner",
                }
            elif isinstance(msg, protocol.BuildInline):
                # the grader's build limit
                result = build_inline(dict(msg.arguments), dict(msg.environment), build_timeout_s())
            else:
                timeout_s = min(msg.timeout_s, build_timeout_s())
                result = build_native(msg.source, msg.flags, msg.defines, timeout_s)
            reply = msgspec.convert(result, protocol.Built)
        except (KeyError, TypeError, ValueError) as exc:  # msgspec.ValidationError included
            reply = protocol.Built(ok=False, error=f"malformed build request: {exc}")
        with contextlib.suppress(OSError):
            self.conn.send_bytes(encode(reply))

    def _poll(self, left_s: float) -> bool:
        """Whether a message came within ``left_s`` seconds, not counting the seconds the
        box was stopped meanwhile (:meth:`quiet`: another runner was timed)."""
        end = time.monotonic() + left_s
        mark = self.stopped_s()
        while True:
            try:
                if self.conn.poll(max(0.0, end - time.monotonic())):
                    return True
            except OSError:
                return True
            stopped = self.stopped_s()
            if stopped <= mark:
                return False
            end, mark = end + stopped - mark, stopped

    def _receive_one(self, left_s: float, timeout_s: float, what: str) -> protocol.ToGrader:
        if not self._poll(left_s):
            tail = self.log_tail()
            self.kill()
            raise RunnerTimeout(f"no answer after {timeout_s:.1f}s during {what}", tail)
        limit = message_limit()
        try:
            reply = shared_memory.receive_message(
                lambda: read_message(self.conn.fileno(), limit),
                self.fd_sock,
                self.conn.poll,
                decode_from_runner,
                10.0,
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
            if self.killed_why:
                why = f"{why}: {self.killed_why}"
            raise RunnerCrashed(why, tail, returncode) from exc
        except MessageStalled as exc:
            tail = self.log_tail()
            self.kill()
            raise RunnerTimeout(f"the runner's message during {what} stopped: {exc}", tail) from exc
        except MessageTooLarge as exc:  # not read: the runner's own code sends none
            tail = self.log_tail()
            self.kill()
            raise RunnerFailed(
                "tampering",
                f"the runner's message during {what} announced {exc.size} bytes, over the "
                f"{exc.limit >> 20} MiB the grader reads as one message (KF_RUNNER_MESSAGE_MB): "
                "kf's runner sends tensors of 1 MiB or more as memory files beside its "
                "messages, so a message this large was written onto the grading socket by "
                "something else, or holds outputs too large to travel as bytes",
                tail,
            ) from exc
        except protocol.ForeignMessage as exc:  # the runner's own code sends none
            tail = self.log_tail()
            self.kill()
            raise RunnerFailed(
                "tampering",
                f"the runner's message during {what} is not one of kf's runner protocol (a "
                f"message forged or injected on the grading socket): {exc}",
                tail,
            ) from exc
        except Exception as exc:  # not MessagePack, descriptors not as announced: garbage
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
        with self._own_errors(), self._ready_lock:
            if self.ready:
                return
            reply = self._receive(timeout_s, "start-up")
            if not isinstance(reply, protocol.Ready):
                self.kill()
                raise RunnerCrashed(f"unexpected start-up message {reply!r}", self.log_tail(), None)
            self.ready = True

    def poll_ready(self) -> bool:
        """True once the ready message has arrived (does not block)."""
        with contextlib.suppress(OSError):
            if not self.ready and self.conn.poll(0):
                self.wait_ready(1.0)
        return self.ready

    def request(
        self, message: protocol.Request[_R], timeout_s: float, *, what: str | None = None
    ) -> _R:
        """Send one request and wait for its reply; raise RunnerError on any failure
        (:class:`RunnerFailed` for a :class:`~kf.evaluation.wire.protocol.Failed` reply).
        ``what`` names the request in errors (its op by default)."""
        with self._own_errors():
            return self._request(message, timeout_s, what)

    @contextlib.contextmanager
    def _own_errors(self) -> Iterator[None]:
        """A RunnerError raised inside names this runner (``runner_pid``)."""
        try:
            yield
        except RunnerError as exc:
            if exc.runner_pid is None:
                exc.runner_pid = self.pid
            raise

    def _request(self, message: protocol.Request[_R], timeout_s: float, what: str | None) -> _R:
        self.wait_ready()
        if isinstance(message, protocol.LoadCandidate) and self._own is None:
            # the box's own processes (the runner, its file maker), before any candidate
            # code runs in it; from now on it is quiet while others are timed
            self._own = frozenset(box_quiet.box_processes(self.proc.pid))
            with _candidates_lock:
                _candidates.add(self)
        with quiet_others(self) if isinstance(message, _TIMED) else contextlib.nullcontext():
            return self._exchange(message, timeout_s, what)

    def _exchange(self, message: protocol.Request[_R], timeout_s: float, what: str | None) -> _R:
        """Send ``message`` and receive its reply (:meth:`request`)."""
        # an empty call (the timing loop's own cost) is told apart in the request log
        op = "time_empty" if isinstance(message, protocol.Time) and message.empty else message.op
        what = what or op
        request_id = secrets.randbits(62)
        began = time.monotonic()
        try:
            shared_memory.send_message(
                self.conn.send_bytes,
                self.fd_sock,
                encode,
                msgspec.structs.replace(message, id=request_id),
            )
        except OSError as exc:
            returncode = self._wait_exit()
            tail = self.log_tail()
            self.kill()
            why = f"process gone before {what}"
            why += f": {self.killed_why}" if self.killed_why else ""
            raise RunnerCrashed(why, tail, returncode) from exc
        reply = self._receive(timeout_s, what)
        ended = time.monotonic()
        answer = reply if isinstance(reply, protocol.Reply) else None
        runner_s = answer.took_ns / 1e9 if answer is not None else 0.0
        phases = reply.phases_ns if isinstance(reply, protocol.Ran) else None
        detail = {k: v / 1e9 for k, v in phases.items()} if phases else None
        memory = (
            (answer.peak_bytes, answer.held_bytes, answer.peak_allocated_bytes,
             answer.allocated_bytes)
            if answer is not None
            else (0, 0, 0, 0)
        )  # fmt: skip
        timing = RequestTiming(op, ended - began, runner_s, ended, self.pid, detail, *memory)
        REQUESTS.append(timing)
        expected = protocol.reply_type(message)
        forged = answer is None or answer.id != request_id
        forged = forged or not isinstance(reply, expected | protocol.Failed)
        with contextlib.suppress(OSError):
            forged = forged or self.conn.poll(0)  # a second message nobody asked for
        if forged or answer is None:
            tail = self.log_tail()
            self.kill()
            raise RunnerFailed(
                "tampering",
                f"the runner's reply during {what} did not answer the grader's request "
                "(a message forged or injected on the grading socket)",
                tail,
            )
        self.findings.extend(f for f in answer.findings if f not in self.findings)
        if isinstance(answer, protocol.Failed):
            raise RunnerFailed(answer.kind, answer.error, answer.log)
        assert isinstance(answer, expected)
        return answer

    def finish(self, timeout_s: float) -> int | None:
        """Ask the runner to exit and wait for it (and any wrapper, e.g. ncu) to end."""
        with contextlib.suppress(OSError):
            self.conn.send_bytes(encode(protocol.Exit()))
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stopped_s(self) -> float:
        """Seconds the box has been stopped so far (:meth:`quiet`)."""
        with self._quiet_lock:
            since = self._stopped_since
            return self._stopped_s + (time.monotonic() - since if since is not None else 0.0)

    def quiet(self) -> None:
        """Hold the box quiet: every process in it stopped, and a process the candidate
        started that holds a GPU killed (:mod:`kf.evaluation.grader.box_quiet`), until
        each hold is given back (:meth:`unquiet`). A box that cannot be stopped is killed;
        its request then fails saying why. An unboxed runner is left as it is (its
        processes may leave its process tree: that mode is marked unsafe)."""
        with self._quiet_lock:
            self._holds += 1
            if self._holds > 1 or self.closed or self.sandbox != box.MODE_BWRAP:
                return
            try:
                found = box_quiet.stop(self.proc.pid, self._own)
            except box_quiet.StopFailed as exc:
                self.killed_why = (
                    f"its box could not be stopped while another runner was timed ({exc})"
                )
            else:
                self._stopped_since = time.monotonic()
                self._found(found)
                return
        self.kill()

    def _found(self, found: box_quiet.Stopped) -> None:
        """Say in the runner's findings (its candidate's flags) what :meth:`quiet` found
        of the processes the candidate started."""
        said = []
        if found.busy:
            said.append(
                f"{_BUSY_CHILD}: a process it started was running while another runner was "
                "timed (its baseline, say); kf stopped it"
            )
        if found.killed:
            said.append(
                f"{_GPU_CHILD_KILLED}: a process it started held a GPU while another runner "
                "was timed; kf killed it"
            )
        self.findings.extend(f for f in said if f not in self.findings)

    def unquiet(self) -> None:
        """Give back one :meth:`quiet` hold; the box runs again when none is left."""
        with self._quiet_lock:
            self._holds = max(0, self._holds - 1)
            since = self._stopped_since
            if self._holds or since is None:
                return
            self._stopped_since = None
            self._stopped_s += time.monotonic() - since
            if not self.closed:
                box_quiet.resume(self.proc.pid)

    @contextlib.contextmanager
    def quieted(self) -> Iterator[None]:
        """The box held quiet inside the block (:meth:`quiet`)."""
        self.quiet()
        try:
            yield
        finally:
            self.unquiet()

    def kill(self) -> None:
        """Kill the runner's whole process group and remove its scratch directory."""
        if self.closed:
            return
        self.closed = True
        with _candidates_lock:
            _candidates.discard(self)
        if self.sandbox == box.MODE_BWRAP and self.proc.poll() is None:
            # (not reaped yet: its pid is still bwrap's) bwrap's init in the box first: the
            # kernel then kills everything in the box's PID namespace, and bwrap exits
            # once it is empty, so nothing is left when the wait below returns. Looked for
            # again while waiting: a runner killed as it starts (a pool closed just after
            # spawning its replacement) may not have made its box's init yet, and bwrap
            # then waited out the whole 10 s for a box nobody had killed
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                for child in spawn.children(self.proc.pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(child, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            self.conn.close()
        with contextlib.suppress(OSError):
            self.fd_sock.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


#: the flags of a candidate whose processes :meth:`RunnerHandle.quiet` found running, or
#: holding a GPU (then killed)
_BUSY_CHILD = "busy_child"
_GPU_CHILD_KILLED = "gpu_child_killed"
#: the requests that time something: every other candidate's box is quiet meanwhile
_TIMED = (protocol.Time, protocol.Batch, protocol.TimeInputs, protocol.Counters)
#: the runners a candidate was loaded in, alive
_candidates: weakref.WeakSet[RunnerHandle] = weakref.WeakSet()
_candidates_lock = threading.Lock()


@contextlib.contextmanager
def quiet_others(*mine: RunnerHandle | None) -> Iterator[None]:
    """Every runner a candidate was loaded in, but ``mine``, held quiet inside the block
    (:meth:`RunnerHandle.quiet`): nothing a candidate started runs while another runner is
    timed (issue 43, NK2). Holds are counted: a box already quiet costs nothing more."""
    with _candidates_lock:
        others = [h for h in _candidates if h not in mine and not h.closed]
    held: list[RunnerHandle] = []
    try:
        for handle in others:
            handle.quiet()
            held.append(handle)
        yield
    finally:
        for handle in held:
            handle.unquiet()
