"""A child process's output, capped: :func:`run_capped` keeps the head and the tail of what
a build tool prints (a compiler can print gigabytes) and kills the process at its time
limit, or as soon as the one who wanted it is gone (:func:`while_wanted`). The grader's
builds (:mod:`kf.evaluation.grader.builds`) and kf's in-process builds
(:mod:`kf.native`) both run their compilers through it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence

__all__ = ["OUTPUT_CAP_BYTES", "run_capped", "while_wanted"]

#: the most of a build's output the grader keeps (head and tail, half each): 1.5 GB of
#: compiler output once took ``kf run`` from 30 MB to 4.4 GB of memory
OUTPUT_CAP_BYTES = 1 << 20


class _Capture:
    """The head and tail of a stream, at most ``limit`` bytes, and how much was dropped."""

    def __init__(self, limit: int) -> None:
        self.half = max(1, limit // 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        if len(self.tail) > 2 * self.half:  # trimmed in batches: no copy per chunk
            cut = len(self.tail) - self.half
            self.dropped += cut
            del self.tail[:cut]

    def text(self) -> str:
        if len(self.tail) > self.half:
            cut = len(self.tail) - self.half
            self.dropped += cut
            del self.tail[:cut]
        head = self.head.decode("utf-8", "replace")
        tail = self.tail.decode("utf-8", "replace")
        if not self.dropped:
            return head + tail
        return f"{head}\n[... {self.dropped} bytes of output dropped ...]\n{tail}"


def run_capped(
    argv: Sequence[str],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    input_text: str | None = None,
    limit: int = OUTPUT_CAP_BYTES,
) -> tuple[int | None, str]:
    """Run ``argv`` with its stdout and stderr read into at most ``limit`` bytes (the
    head and the tail, and a line saying how much was dropped between them): its exit
    status (None when it ran past ``timeout_s`` and was killed) and that output."""
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    capture = _Capture(limit)
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:
        while chunk := os.read(stdout.fileno(), 1 << 20):
            capture.add(chunk)

    reader = threading.Thread(target=read, name="kf-build-output", daemon=True)
    reader.start()
    try:
        if input_text is not None and proc.stdin is not None:
            with proc.stdin:
                proc.stdin.write(input_text.encode())
        code: int | None = _wait(proc, timeout_s)
    except (subprocess.TimeoutExpired, BrokenPipeError):
        code = proc.poll()
        if code is None:
            proc.kill()
            proc.wait()
    reader.join()
    stdout.close()
    return code, capture.text()


_wanted = threading.local()


@contextlib.contextmanager
def while_wanted(wanted: Callable[[], bool]) -> Iterator[None]:
    """Builds this thread starts in the block are killed as soon as ``wanted()`` is False
    (the runner that asked for one died: its stage must not wait for the build)."""
    _wanted.check = wanted
    try:
        yield
    finally:
        _wanted.check = None


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """``proc.wait(timeout_s)``, the build killed (TimeoutExpired) once it is not wanted."""
    check: Callable[[], bool] | None = getattr(_wanted, "check", None)
    end = time.monotonic() + timeout_s
    while True:
        try:
            return proc.wait(max(0.0, min(0.5, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= end or (check is not None and not check()):
                raise
