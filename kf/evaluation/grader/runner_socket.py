"""What the grader reads from a runner's socket: one message at a time, never more than
:func:`message_limit` bytes. A runner's socket carries
:class:`multiprocessing.connection.Connection` frames (a 4-byte big-endian length, or -1
and an 8-byte one, then the bytes); ``Connection.recv_bytes`` reads whatever length a
frame announces, so a hostile runner could make the grader hold gigabytes (a frame of
16 GiB, streamed from one small buffer, costs the runner nothing). :func:`read_message`
reads the length first and refuses one over the limit before reading any of it;
:class:`kf.evaluation.grader.runner_handle.RunnerHandle` then kills the runner and fails
the stage with the reason.
"""

from __future__ import annotations

import os
import select
import struct
import typing

from kf.evaluation.wire import shared_memory
from kf.settings import current

__all__ = ["IDLE_S", "MessageStalled", "MessageTooLarge", "message_limit", "read_message"]

#: seconds a message that has begun may go without a byte before the grader gives up on it
#: (a runner that sends a length and then nothing would otherwise hold the grader forever)
IDLE_S = 30.0


class MessageTooLarge(ValueError):
    """A runner's message announced more bytes than the grader reads (:func:`message_limit`)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a message of {size} bytes, over the limit of {limit}")
        self.size = size
        self.limit = limit


def message_limit() -> int:
    """The most bytes the grader reads as one message from a runner's socket:
    ``$KF_RUNNER_MESSAGE_MB`` MiB, by default 1024. Tensors of 1 MiB or more travel as
    sealed memory files beside a message (:mod:`kf.evaluation.wire.shared_memory`), so a
    message holds descriptions, small tensors, builds' sources and logs: kf's runner never
    comes near it. Where tensors travel as bytes (``$KF_TENSOR_TRANSPORT=bytes``, or a
    system without memory files) a message holds the outputs themselves: there the
    default is a quarter of the host's memory."""
    settings = current()
    if settings.runner_message_mb is not None:
        return settings.runner_message_mb << 20
    if settings.tensor_transport == "bytes" or not shared_memory.available():
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return max(1 << 30, memory // 4)
    return 1 << 30


class MessageStalled(Exception):
    """A runner's message stopped coming part-way (:data:`IDLE_S` without a byte)."""


def _read_exactly(fd: int, buf: memoryview, idle_s: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    got = 0
    while got < len(buf):
        if not poller.poll(int(idle_s * 1000)):
            raise MessageStalled(f"{got} of {len(buf)} bytes came, then none for {idle_s:g}s")
        n = os.readv(fd, [buf[got:]])
        if n == 0:
            raise EOFError("the runner's socket closed")
        got += n


def read_message(fd: int, limit: int, idle_s: float = IDLE_S) -> bytes:
    """The next message on a runner's socket ``fd``, framed as
    :class:`multiprocessing.connection.Connection` frames it (a 4-byte length, or -1 and an
    8-byte one); :class:`MessageTooLarge`, before any of it is read, when it announces more
    than ``limit`` bytes (the grader's memory is not the runner's to fill);
    :class:`MessageStalled` when it stops coming for ``idle_s`` seconds; ``EOFError`` when
    the socket closes."""
    head = bytearray(4)
    _read_exactly(fd, memoryview(head), idle_s)
    (size,) = struct.unpack("!i", head)
    if size == -1:
        longer = bytearray(8)
        _read_exactly(fd, memoryview(longer), idle_s)
        (size,) = struct.unpack("!Q", longer)
    if size < 0 or size > limit:
        raise MessageTooLarge(size, limit)
    body = bytearray(size)
    _read_exactly(fd, memoryview(body), idle_s)
    # msgspec decodes any buffer; no copy of what may be a gigabyte of bytes payloads
    return typing.cast(bytes, memoryview(body))
