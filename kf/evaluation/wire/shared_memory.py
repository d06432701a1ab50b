"""Tensors between runners as sealed memory files: one copy out, none on the way.

Boxed runners cannot hand each other CUDA IPC handles (docs/sandbox.md), and bytes
through the grader cost a dozen copies of every tensor: ``torch.save`` into a growing
buffer, msgpack on each side of each of two sockets, ``torch.load`` at the end. On the
H200 a verification of one 256 MB task took 30 s that way, and KernelBench's 6.4 GB
tensors did not finish. Here a payload whose tensors hold at least :data:`MIN_BYTES`
travels as **one anonymous memory file** (``memfd_create``):

- the sender copies each tensor into it once (from the GPU, that is the copy to the
  host), unmaps it and **seals** it (``F_SEAL_WRITE``, ``SHRINK``, ``GROW`` and ``SEAL``):
  from then on nobody, the sender included, can change a byte of it;
- the file's descriptor passes over the runner's socket (``SCM_RIGHTS``); the grader
  forwards the descriptor, never the bytes;
- the receiver refuses a descriptor that is not a sealed memory file of the size its
  description needs, and maps it copy-on-write: its tensors are the file's pages until
  something writes to them, and what is written stays private to that process.

The description (dtypes, shapes, offsets, a transposed tensor's strides) is plain
msgpack; a tensor that is not contiguous travels in the file too (a permuted one as its
block of storage with its strides, a sliced one as its values); values that are not
tensors, and expanded views, still travel as ``torch.save`` bytes inside it. Nothing is
unpickled.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import mmap
import os
import socket
import stat
import typing
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from kf.evaluation.wire import file_maker

__all__ = [
    "MIN_BYTES",
    "Payload",
    "attach",
    "available",
    "detach",
    "pack",
    "receive_fds",
    "receive_message",
    "send_message",
    "unpack",
]

#: Below this many bytes of tensors a payload goes as bytes by default: a file costs more
#: than it saves (the grader's ``$KF_SHM_MIN_BYTES`` sets another threshold).
MIN_BYTES = 1 << 20
#: The most descriptors one message may carry (a payload has one).
MAX_FDS = 16
MAGIC = b"KFSHM1\n"
_ALIGN = 256
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[dict[str, Any]])
_M = TypeVar("_M", bound=msgspec.Struct)


def _seals() -> int:
    return int(fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)


def available() -> bool:
    """Whether this system has sealable memory files (Linux 3.17 and later)."""
    return file_maker.available()


class Payload(msgspec.Struct, frozen=True, weakref=True):
    """A payload in a sealed memory file: its description and the file's descriptor.

    In a message on the wire ``fd`` is the position of the descriptor among those sent
    beside it (:func:`detach`); in a process it is the descriptor itself, owned by the
    payload that :func:`pack` or :func:`attach` made (closed with it, or by :meth:`close`).
    """

    header: bytes
    fd: int
    nbytes: int = 0

    @classmethod
    def owning(cls, header: bytes, fd: int, nbytes: int = 0) -> Payload:
        """A payload that owns ``fd``: closed when it is collected or closed."""
        payload = cls(header, fd, nbytes)
        key = id(payload)
        _owned[key] = weakref.finalize(payload, _release, key, fd)
        return payload

    def close(self) -> None:
        """Close the descriptor, if this payload owns it."""
        owner = _owned.get(id(self))
        if owner is not None:
            owner()

    def __repr__(self) -> str:
        return f"Payload(fd={self.fd}, {self.nbytes} bytes)"


#: the finalizers of the payloads that own their descriptors, by ``id``
_owned: dict[int, weakref.finalize[Any, Any]] = {}


def _release(key: int, fd: int) -> None:
    _owned.pop(key, None)
    _close_quietly(fd)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _plain(torch: Any, value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and not value.requires_grad
        and not value.is_sparse
        and not value.is_quantized
        and value.dtype.itemsize > 0
        and (value.is_contiguous() or _layout(value.shape, value.stride()) is not None)
    )


def _layout(shape: Any, stride: Any) -> str | None:
    """How a tensor of ``shape`` and ``stride`` that is not contiguous travels in a file:
    ``"dense"``, a permutation of one block of its storage (a transpose: that block, and
    its strides, which the receiver keeps); ``"values"``, a view with gaps (a slice: its
    values, contiguous); None where its elements may overlap (an expanded view, whose
    storage is smaller than its values: ``torch.save`` bytes). Large tensors of the first
    two kinds never travel inside a message, whose size the grader limits."""
    dims = sorted((int(st), int(sz)) for st, sz in zip(stride, shape, strict=True) if sz != 1)
    span, dense = 1, True
    for st, sz in dims:
        if st < span:
            return None
        dense = dense and st == span
        span = st * sz
    return "dense" if dense else "values"


def pack(torch: Any, values: list[Any], min_bytes: int = MIN_BYTES) -> Payload | None:
    """``values`` in one sealed memory file, or None where that does not pay (fewer than
    ``min_bytes`` of plain contiguous tensors) or the system has no such files."""
    if not available():
        return None
    tensors = [v for v in values if _plain(torch, v)]
    if not tensors or sum(t.numel() * t.element_size() for t in tensors) < min_bytes:
        return None
    if not file_maker.may_write(
        sum(-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors)
    ):
        return None  # over this process's file limit, and no file maker to ask
    entries: list[dict[str, Any]] = []
    placed: list[tuple[Any, int, int]] = []
    offset = 0
    for value in values:
        if _plain(torch, value):
            nbytes = value.numel() * value.element_size()
            spec = {
                "dtype": str(value.dtype).removeprefix("torch."),
                "size": list(value.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
            source = value.detach()
            if not value.is_contiguous() and _layout(value.shape, value.stride()) == "dense":
                # the block of storage it permutes, as it lies there, and how to read it
                spec["stride"] = list(value.stride())
                source = source.as_strided((value.numel(),), (1,), value.storage_offset())
            entries.append({"t": spec})
            placed.append((source, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        else:
            buf = io.BytesIO()
            torch.save(value.detach().cpu() if isinstance(value, torch.Tensor) else value, buf)
            entries.append({"saved": buf.getvalue()})
    if offset == 0:  # only empty tensors (a threshold of 0): nothing for a file to hold
        return None
    fd = file_maker.new_file(offset)
    if fd is None:
        return None
    try:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        # the file's pages were allocated when it was made (file_maker._allocate): mapping
        # it populated as well was slower than faulting the page tables in on the copy
        with mmap.mmap(fd, offset, flags=mmap.MAP_SHARED, prot=prot) as mm:
            for tensor, start, nbytes in placed:
                if nbytes:  # from a GPU, this is the copy to the host
                    target = _view(torch, mm, start, nbytes, tensor.dtype, tensor.shape)
                    target.copy_(tensor)
                    del target  # the mapping closes only once no tensor holds it
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _seals())
    except BaseException:
        os.close(fd)
        raise
    return Payload.owning(MAGIC + _encoder.encode(entries), fd, offset)


def _view(torch: Any, mm: Any, start: int, nbytes: int, dtype: Any, shape: Any) -> Any:
    """The tensor of ``dtype`` and ``shape`` held at ``start`` of the mapping ``mm``."""
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=start)
    return raw.view(dtype).view(shape)


def _check(fd: int, needed: int) -> int:
    """The file's size, once it is known to be a sealed memory file of at least ``needed``
    bytes; else ValueError."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("the payload's descriptor is not a memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ValueError("the payload's descriptor is not a sealable memory file") from exc
    if seals & _seals() != _seals():
        raise ValueError("the payload's memory file is not sealed against writes")
    if info.st_size < needed:
        raise ValueError(f"the payload's memory file holds {info.st_size} bytes, not {needed}")
    return int(info.st_size)


def unpack(torch: Any, payload: Payload) -> list[Any]:
    """The values of a :func:`pack` payload. Tensors are copy-on-write views of the file:
    what this process writes to them stays its own."""
    if payload.header[: len(MAGIC)] != MAGIC:
        raise ValueError("not a shared-memory payload")
    entries = _decoder.decode(payload.header[len(MAGIC) :])
    specs = [e["t"] for e in entries if "t" in e]
    needed = max((int(s["offset"]) + int(s["nbytes"]) for s in specs), default=0)
    size = _check(payload.fd, needed)
    mm = (
        mmap.mmap(payload.fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if size
        else None
    )
    out: list[Any] = []
    for entry in entries:
        if "saved" in entry:
            out.append(torch.load(io.BytesIO(entry["saved"]), weights_only=True))
            continue
        spec = entry["t"]
        dtype = getattr(torch, str(spec["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {spec['dtype']!r}")
        shape = [int(v) for v in spec["size"]]
        start, nbytes = int(spec["offset"]), int(spec["nbytes"])
        numel = 1
        for v in shape:
            if v < 0:
                raise ValueError(f"negative size in {shape}")
            numel *= v
        if start < 0 or start % _ALIGN or nbytes != numel * dtype.itemsize:
            raise ValueError(f"malformed tensor description {spec}")
        stride = spec.get("stride")
        if stride is not None and (
            not isinstance(stride, list)
            or len(stride) != len(shape)
            or not all(isinstance(v, int) and v >= 0 for v in stride)
            or _layout(shape, stride) != "dense"
        ):
            raise ValueError(f"malformed tensor description {spec}")
        if nbytes == 0 or mm is None:
            out.append(torch.empty(shape, dtype=dtype))
        elif stride is not None:  # a permuted block: read it as the sender's tensor lay
            flat = _view(torch, mm, start, nbytes, dtype, [numel])
            out.append(flat.as_strided(shape, stride))
        else:
            out.append(_view(torch, mm, start, nbytes, dtype, shape))
    return out


def detach(message: _M) -> tuple[_M, list[int]]:
    """``message`` with each :class:`Payload` in it naming the position of its descriptor
    instead, its ``fds`` saying how many, and the descriptors in that order (what goes
    beside it)."""
    fds: list[int] = []

    def wire(payload: Payload) -> Payload:
        fds.append(payload.fd)
        return Payload(payload.header, len(fds) - 1, payload.nbytes)

    out = _each_payload(message, wire)
    if fds:
        out = msgspec.structs.replace(out, fds=len(fds))
    return out, fds


def attach(message: _M, fds: list[int]) -> _M:
    """The inverse of :func:`detach` on the receiving side: each :class:`Payload` in
    ``message`` owns the descriptor it names. Descriptors no payload names are closed; a
    payload naming none (or one another payload names) raises ValueError: a forged
    message, which must not make this process pass on descriptors of its own."""
    used: set[int] = set()

    def bind(payload: Payload) -> Payload:
        index = payload.fd
        if not 0 <= index < len(fds) or index in used:
            raise ValueError("a shared-memory payload names no descriptor sent with it")
        used.add(index)
        return Payload.owning(payload.header, fds[index], payload.nbytes)

    try:
        return _each_payload(message, bind)
    finally:
        for i, fd in enumerate(fds):
            if i not in used:
                _close_quietly(fd)


def _each_payload(message: _M, change: Callable[[Payload], Payload]) -> _M:
    """``message`` with ``change`` applied to every :class:`Payload` in its fields (and
    in lists and structs in them), in field order: the order both sides agree on."""

    def walk(value: Any) -> Any:
        if isinstance(value, Payload):
            return change(value)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, msgspec.Struct):
            changed = {}
            for name in value.__struct_fields__:
                old = getattr(value, name)
                new = walk(old)
                if new is not old:
                    changed[name] = new
            return msgspec.structs.replace(value, **changed) if changed else value
        return value

    return typing.cast(_M, walk(message))


def receive_fds(
    sock: socket.socket, count: Any, poll: Callable[[float], bool], timeout_s: float
) -> list[int]:
    """The ``count`` descriptors that follow a message whose ``fds`` says so, within
    ``timeout_s``; ValueError where they do not come as announced."""
    if not isinstance(count, int) or not 0 < count <= MAX_FDS:
        raise ValueError(f"a message announced {count!r} descriptors")
    if not poll(timeout_s):
        raise ValueError(f"the {count} descriptors announced did not come")
    data, fds, flags, _ = socket.recv_fds(sock, 1, count)
    for fd in fds:  # close-on-exec (socket.recv_fds drops a flags argument)
        os.set_inheritable(fd, False)
    if data != b"\0" or len(fds) != count or flags & socket.MSG_CTRUNC:
        for fd in fds:
            _close_quietly(fd)
        raise ValueError(f"{len(fds)} descriptors came where {count} were announced")
    return list(fds)


def send_fds(sock: socket.socket, fds: list[int]) -> None:
    """The descriptors of a message just sent (after it, on its socket)."""
    if fds:
        socket.send_fds(sock, [b"\0"], fds)


def send_message(
    send_bytes: Callable[[bytes], None],
    sock: socket.socket,
    encode: Callable[[_M], bytes],
    message: _M,
) -> None:
    """``message`` on a runner socket: its :class:`Payload` descriptors right after it."""
    wire, fds = detach(message)
    send_bytes(encode(wire))
    send_fds(sock, fds)


def receive_message(
    recv_bytes: Callable[[], bytes],
    sock: socket.socket,
    poll: Callable[[float], bool],
    decode: Callable[[bytes], _M],
    timeout_s: float,
) -> _M:
    """The next message of a runner socket, its payloads' descriptors attached (the
    ``fds`` it announces must follow within ``timeout_s``; else ValueError)."""
    message = decode(recv_bytes())
    count = getattr(message, "fds", 0)
    return attach(message, receive_fds(sock, count, poll, timeout_s) if count else [])
