"""Memory files of any size for a runner whose file size is limited.

A runner's ``RLIMIT_FSIZE`` guards its log on the host's disk, but the kernel counts
memory files (``memfd_create``) against it too: at KernelBench's sizes a candidate's
outputs (6.4 GB) could not be one, and went as bytes through two sockets. The runner
starts a :class:`FileMaker` before it sets the limit; :func:`new_file` makes a file
itself when the limit allows and asks the maker otherwise
(:mod:`kf.evaluation.wire.shared_memory` fills and seals it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import socket
import stat
import struct
import subprocess
import sys
import threading

__all__ = ["FileMaker", "may_write", "new_file", "start_file_maker", "stop_file_maker"]


def available() -> bool:
    """Whether this system has sealable memory files (Linux 3.17 and later)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


def may_write(nbytes: int) -> bool:
    """Whether this process can have a memory file of ``nbytes``: its own file limit
    (``RLIMIT_FSIZE``, which guards a runner's log on the host's disk) counts memory files
    too, and over it only the :class:`FileMaker` can make one; without it, the payload
    goes as bytes."""
    return _maker is not None or _within_limit(nbytes)


def _within_limit(nbytes: int) -> bool:
    """Whether this process's own file limit lets it make a file of ``nbytes``."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return soft == resource.RLIM_INFINITY or nbytes <= soft


def new_file(nbytes: int) -> int | None:
    """A sealable memory file of ``nbytes``, this process's own or the file maker's."""
    if _within_limit(nbytes):
        fd = os.memfd_create("kf-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            _allocate(fd, nbytes)
            return fd
        except OSError as exc:
            os.close(fd)
            if exc.errno != errno.EFBIG:
                raise
    return _maker.make(nbytes) if _maker is not None else None


def _allocate(fd: int, nbytes: int) -> None:
    """Give the file its pages now, in one call (where the system can): filling 2 GiB
    that are faulted in a page at a time took 1.9 s on a 2-core machine, allocated first
    0.9 s. A file that cannot be allocated is filled as it is written."""
    if nbytes and hasattr(os, "posix_fallocate"):
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, nbytes)


#: The file maker's program: it makes empty memory files of the sizes asked, nothing else
#: (their pages allocated, as :func:`_allocate` does, where that takes at most half the
#: host's available memory: anything in the runner's process may ask it for a file).
_MAKER = r"""
import os, socket, struct, sys
sock = socket.socket(fileno=int(sys.argv[1]))
while True:
    data = sock.recv(8)
    if len(data) != 8:
        break
    size = struct.unpack("<Q", data)[0]
    try:
        fd = os.memfd_create("kf-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        try:  # pages now, unless that would take over half the host's available memory
            with open("/proc/meminfo") as f:
                avail = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
            if 0 < size <= avail // 2:
                os.posix_fallocate(fd, 0, size)
        except (OSError, StopIteration, ValueError):
            pass
    except OSError as exc:
        sock.send(struct.pack("<q", -exc.errno))
        continue
    socket.send_fds(sock, [struct.pack("<q", size)], [fd])
    os.close(fd)
"""


class FileMaker:
    """A small process, started before a runner limits its file size, that makes empty
    memory files of any size for it.

    A runner's ``RLIMIT_FSIZE`` guards its log on the host's disk, but the kernel counts
    memory files against it too: at KernelBench's sizes a candidate's outputs (6.4 GB)
    could not be a file, and went as bytes through two sockets. The maker only creates
    and sizes a file (memory, like any allocation; no path, no disk) and hands over its
    descriptor; the runner fills it through a mapping (which the limit does not count)
    and seals it as before. A file of the wrong size or none (the maker gone) means
    bytes for that payload. Candidate code in the runner could ask it for files too,
    which gives it nothing it lacks: it can allocate memory anyway.
    """

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _MAKER, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        ours.settimeout(30.0)
        self.sock = ours
        self._lock = threading.Lock()
        self.broken = False

    def make(self, nbytes: int) -> int | None:
        """A sealable memory file of exactly ``nbytes``, or None."""
        with self._lock:
            if self.broken:
                return None
            try:
                self.sock.send(struct.pack("<Q", nbytes))
                data, fds, _, _ = socket.recv_fds(self.sock, 8, 1)
            except OSError:
                # gone, or late: a reply that comes after this would answer the next
                # request, so the maker is not asked again
                self.broken = True
                return None
        fd = fds[0] if fds else None
        if fd is None:
            return None
        # close-on-exec, as the runner's own files are: a build tool it starts must not
        # inherit the payload (socket.recv_fds drops its flags argument: set it here)
        os.set_inheritable(fd, False)
        info = os.fstat(fd)
        sealable = True
        try:
            sealable = not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL
        except OSError:
            sealable = False
        if (
            len(data) != 8
            or not stat.S_ISREG(info.st_mode)
            or info.st_size != nbytes
            or not sealable
        ):
            os.close(fd)
            return None
        return fd

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


_maker: FileMaker | None = None


def start_file_maker() -> None:
    """Start this process's :class:`FileMaker` (a runner, before it limits its file size)."""
    global _maker
    if _maker is None and available():
        _maker = FileMaker()


def stop_file_maker() -> None:
    global _maker
    if _maker is not None:
        _maker.close()
        _maker = None
