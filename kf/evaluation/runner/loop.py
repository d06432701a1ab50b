"""The sandboxed runner process's request loop: ``python -m kf.evaluation.runner FD
PARENT_PID`` (the package's ``__main__``) runs :func:`main`.

It binds its clock, imports torch, says it is ready and then serves requests from the
grader on the socket ``FD``. One runner serves one candidate (or one task reference)
and is then discarded. Candidate code runs here, so the clock is bound in :func:`main`
before anything else is imported, and is never stored where the candidate can reach
it by name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import threading
import time
from typing import Any

from kf.evaluation.runner.candidate import CandidateRole, remote_build, remote_inline_build
from kf.evaluation.runner.common import RequestFailure, describe_exception, traceback_tail
from kf.evaluation.runner.guard import Integrity, OpRecorder, Watch
from kf.evaluation.runner.reference import ReferenceRole
from kf.evaluation.wire import shared_memory
from kf.settings import current

__all__ = ["Runner", "main"]


class Runner(ReferenceRole, CandidateRole):
    """Request handlers; ``self.model`` is either the task's Model or the candidate's ModelNew.
    One runner process serves one role: the reference (:mod:`~kf.evaluation.runner.reference`)
    or the candidate (:mod:`~kf.evaluation.runner.candidate`)."""


def _watch_parent(parent_pid: int) -> None:
    """Exit when the grader goes away, so a runner is never left behind.

    The runner's parent is the grader, or a wrapper the grader started (ncu): either
    way, being re-parented means that parent died, and the grader's pid vanishing
    means the grader did. In the box (``parent_pid`` 0) the parent is bwrap's init,
    which dies with the grader (``--die-with-parent``) and takes the box with it.
    """
    first = os.getppid()
    while True:
        if os.getppid() != first:
            os._exit(70)
        if parent_pid and first != parent_pid:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(70)
            except OSError:
                pass  # exists, just not ours to signal
        time.sleep(0.5)


class StartUp:
    """What each step of a runner's start-up cost, for the one line it logs before it says
    it is ready (``bench/runner_cost.py`` reads it): CPU-seconds of this process (every
    thread) and wall seconds. The first step is everything before :func:`main` ran: the
    interpreter's start and kf's imports."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, float, float]] = []
        self._cpu = time.process_time()
        self._wall = time.perf_counter()
        self.steps.append(("interpreter and kf", self._cpu, _process_age_s()))

    def mark(self, step: str) -> None:
        """``step`` has just ended (it began where the last one did)."""
        cpu, wall = time.process_time(), time.perf_counter()
        self.steps.append((step, cpu - self._cpu, wall - self._wall))
        self._cpu, self._wall = cpu, wall

    def line(self) -> str:
        cpu = sum(s[1] for s in self.steps)
        parts = "; ".join(f"{name} {c:.3f} CPU-s {w:.3f} s" for name, c, w in self.steps)
        dynamo = "yes" if "torch._dynamo" in sys.modules else "no"
        return (
            f"kf runner: started in {cpu:.3f} CPU-s ({parts}); "
            f"{len(sys.modules)} modules, torch._dynamo loaded: {dynamo}"
        )


def _process_age_s() -> float:
    """Wall seconds since this process started (0.0 where /proc cannot say)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _warm(torch: Any, device: str, startup: StartUp) -> None:
    """Start-up work that a GPU stage would otherwise wait for (``$KF_RUNNER_WARM``).

    A pooled runner starts while earlier candidates are graded, so what it does before
    it says it is ready costs no stage any time: the CUDA context on ``device`` (about
    0.6 s on an H200), and the op tracer's first entry into a dispatch mode (which no
    longer imports ``torch._dynamo``: :class:`~kf.evaluation.runner.guard.OpRecorder`).
    Nothing of a candidate exists yet. A failure is only logged: set-up reports it
    properly.
    """
    start = time.perf_counter()
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
            torch.empty(1, device=device)
            startup.mark("CUDA context")
        with OpRecorder(torch):
            torch.zeros(1).add_(1)
        startup.mark("op tracer")
    except Exception as exc:  # set-up raises the real error with its context
        print(f"kf runner: warm-up for {device} failed: {describe_exception(exc)}", flush=True)
    else:
        print(
            f"kf runner: warmed up for {device} in {time.perf_counter() - start:.2f}s", flush=True
        )


def main(argv: list[str]) -> int:
    clock_ns = time.perf_counter_ns  # bound before any candidate code is imported
    startup = StartUp()
    watch = Watch()
    sys.addaudithook(watch.hook)  # cannot be removed; inert until a candidate is loaded
    import faulthandler
    from multiprocessing.connection import Connection

    import msgspec

    from kf.evaluation.wire import protocol

    faulthandler.enable()  # a crashing candidate leaves a Python traceback in the log
    fd, parent_pid = int(argv[0]), int(argv[1])
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    conn = Connection(fd)
    # bound before any candidate code runs: the socket's bytes, and the descriptors of
    # shared-memory payloads beside them (kf.evaluation.wire.shared_memory)
    send, recv = conn.send_bytes, conn.recv_bytes
    encode, decode = protocol.encode, protocol.decode_from_grader
    fd_sock = socket.socket(fileno=os.dup(fd))
    watch.grading = fd_sock
    send_message = functools.partial(shared_memory.send_message, send, fd_sock, encode)
    receive_message = functools.partial(
        shared_memory.receive_message, recv, fd_sock, conn.poll, decode, 60.0
    )
    settings = current()  # this runner's, from the environment its pool gave it
    if settings.build_service:  # in the box: the grader builds
        _builds_by_grader(send, recv, encode, decode)
    runner = _started(startup, Runner, clock_ns, watch, settings.runner_warm, send)
    del startup
    guard: Integrity | None = None
    while True:
        try:
            msg = receive_message()
        except EOFError:
            return 0
        except ValueError as exc:  # protocol.ProtocolError, or descriptors not as announced
            print(f"kf runner: exiting on a message it cannot read: {exc}", flush=True)
            return 2
        if isinstance(msg, protocol.Exit):
            return 0
        if isinstance(msg, protocol.LoadCandidate) and guard is None:
            # before any candidate code runs
            guard = Integrity(runner, clock_ns, send, recv, send_message, receive_message)
        handler = (
            getattr(runner, f"op_{msg.op}", None) if isinstance(msg, protocol.Request) else None
        )
        began = clock_ns()
        cuda = _cuda_of(runner)
        if cuda is not None:
            with contextlib.suppress(Exception):
                cuda.reset_peak_memory_stats()
        reply: protocol.Reply
        try:
            if handler is None:
                raise RequestFailure("protocol", f"unexpected message {msg.op!r}")
            reply = handler(msg)
        except RequestFailure as failure:
            reply = protocol.Failed(kind=failure.kind, error=failure.error, log=failure.log)
        except BaseException as exc:
            reply = protocol.Failed(
                kind="exception", error=describe_exception(exc), log=traceback_tail()
            )
        if guard is not None:
            tampered = guard.check(runner, clock_ns)
            if tampered:
                reply = protocol.Failed(
                    kind="tampering",
                    error=f"the candidate altered the runner that grades it: {tampered}",
                )
        reply = msgspec.structs.replace(
            reply,
            id=msg.id if isinstance(msg, protocol.Request) else 0,
            took_ns=clock_ns() - began,  # the handler's time, for the grader's request log
            findings=tuple(watch.drain()),
            **_memory(cuda),
        )
        sys.stdout.flush()
        send_message(reply)
        del reply


def _started(
    startup: StartUp, make: Any, clock_ns: Any, watch: Any, warm: str | None, send: Any
) -> Any:
    """Import torch, make the runner (``make``: :class:`Runner`), warm it up, log what the
    start cost and say it is ready; no candidate code exists yet."""
    from kf.evaluation.wire import protocol

    startup.mark("runner's own imports")
    import torch

    startup.mark("import torch")
    runner = make(clock_ns, watch)
    startup.mark("runner set-up")
    if warm:
        _warm(torch, warm, startup)
    print(startup.line(), flush=True)
    send(protocol.encode(protocol.Ready(pid=os.getpid(), torch=str(torch.__version__))))
    return runner


def _builds_by_grader(send: Any, recv: Any, encode: Any, decode: Any) -> None:
    """In the box, kf.native and ``load_inline`` builds are asked of the grader."""
    import kf.native

    kf.native.remote_builder = functools.partial(remote_build, send, recv, encode, decode)
    import kf.cuda.inline

    kf.cuda.inline.remote_builder = functools.partial(
        remote_inline_build, send, recv, encode, decode
    )


def _cuda_of(runner: Any) -> Any:
    """``torch.cuda`` once the runner's backend is a GPU's, else None."""
    backend = getattr(runner, "backend", None)
    return runner.torch.cuda if getattr(backend, "name", "") == "cuda" else None


def _memory(cuda: Any) -> dict[str, int]:
    """The reply's device-memory fields: the caching allocator's reserved and allocated
    bytes, at most during the request and at its end (none off a GPU)."""
    if cuda is None:
        return {}
    try:
        return {
            "peak_bytes": int(cuda.max_memory_reserved()),
            "held_bytes": int(cuda.memory_reserved()),
            "peak_allocated_bytes": int(cuda.max_memory_allocated()),
            "allocated_bytes": int(cuda.memory_allocated()),
        }
    except Exception:  # a device lost mid-request: the reply says so already
        return {}
