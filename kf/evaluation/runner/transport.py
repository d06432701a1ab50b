"""How runners hand tensors to each other through the grader: bytes, or CUDA IPC handles.

On a CPU every payload is ``torch.save`` bytes that the grader forwards unopened. On a
GPU that would copy each tensor to the host, serialise it, push it through two sockets
and copy it back: for the 128 MiB tensors of a realistic GPU task that is seconds per
trial. There, tensors travel as CUDA IPC handles instead (what ``torch.multiprocessing``
uses): the payload names a device allocation of the sending runner, and the receiving
runner maps it and **clones it at once**, so it works on a private copy that the sender
can no longer touch, and the comparison happens on the GPU.

A payload is plain msgpack behind a magic prefix, never a pickle: each value is either
an IPC description (sizes, strides, dtype name, the handle bytes) or ``torch.save``
bytes for anything that is not a CUDA tensor. Only ``torch.Tensor`` and the two storage
classes PyTorch itself produces are rebuilt; a forged description fails to open and the
reading side reports it as unreadable.

The sender keeps what it exported alive in a bounded queue until the receiver has had
time to clone it; a receiver that dies holding a mapping keeps that allocation pinned in
the sender (PyTorch's IPC reference count never drops), so the grader retires a reused
reference runner after a candidate crashes on a GPU.
"""

from __future__ import annotations

import io
from collections import deque
from typing import Any

import msgspec

__all__ = ["MAGIC", "Exports", "is_ipc", "pack", "unpack"]

MAGIC = b"KFIPC1\n"
_STORAGES = ("TypedStorage", "UntypedStorage")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[dict[str, Any]])


class Exports:
    """The last ``keep`` exported payloads' tensors, alive until their receivers cloned them."""

    def __init__(self, keep: int = 8) -> None:
        self._held: deque[list[Any]] = deque(maxlen=max(1, keep))

    def hold(self, tensors: list[Any]) -> None:
        self._held.append(tensors)


def is_ipc(data: bytes) -> bool:
    return data[: len(MAGIC)] == MAGIC


def pack(torch: Any, values: list[Any], exports: Exports) -> bytes:
    """``values`` with CUDA tensors as IPC handles and everything else as ``torch.save`` bytes."""
    from torch.multiprocessing.reductions import reduce_tensor

    entries: list[dict[str, Any]] = []
    held: list[Any] = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_cuda:
            tensor = value.detach()
            if type(tensor) is not torch.Tensor:
                tensor = tensor.as_subclass(torch.Tensor)
            _, args = reduce_tensor(tensor)  # type: ignore[no-untyped-call]
            _, size, stride, offset, storage_cls, dtype, device, handle = args[:8]
            nbytes, byte_offset, _, ref_handle, ref_offset, event_handle, event_sync = args[8:15]
            entries.append(
                {
                    "ipc": {
                        "size": list(size),
                        "stride": list(stride),
                        "offset": int(offset),
                        "storage": storage_cls.__name__,
                        "dtype": str(dtype).removeprefix("torch."),
                        "device": int(device),
                        "handle": handle,
                        "nbytes": int(nbytes),
                        "byte_offset": int(byte_offset),
                        "ref_handle": ref_handle,
                        "ref_offset": int(ref_offset),
                        "event_handle": event_handle,
                        "event_sync": bool(event_sync),
                    }
                }
            )
            held.append(tensor)
        else:
            buf = io.BytesIO()
            torch.save(value.detach().cpu() if isinstance(value, torch.Tensor) else value, buf)
            entries.append({"saved": buf.getvalue()})
    exports.hold(held)
    return MAGIC + _encoder.encode(entries)


def unpack(torch: Any, data: bytes) -> list[Any]:
    """The values of a :func:`pack` payload; CUDA tensors are private clones of the sender's."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    out: list[Any] = []
    mapped = False
    for entry in _decoder.decode(data[len(MAGIC) :]):
        if "saved" in entry:
            out.append(torch.load(io.BytesIO(entry["saved"]), weights_only=True))
            continue
        d = entry["ipc"]
        if d["storage"] not in _STORAGES:
            raise ValueError(f"refusing storage class {d['storage']!r}")
        dtype = getattr(torch, str(d["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {d['dtype']!r}")
        storage_cls = getattr(torch, d["storage"], None) or getattr(torch.storage, d["storage"])
        shared = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor,
            torch.Size([int(v) for v in d["size"]]),
            tuple(int(v) for v in d["stride"]),
            int(d["offset"]),
            storage_cls,
            dtype,
            int(d["device"]),
            bytes(d["handle"]),
            int(d["nbytes"]),
            int(d["byte_offset"]),
            False,
            bytes(d["ref_handle"]),
            int(d["ref_offset"]),
            bytes(d["event_handle"]) if d["event_handle"] is not None else None,
            bool(d["event_sync"]),
        )
        out.append(shared.clone())  # a private copy: the sender can no longer change it
        del shared
        mapped = True
    if mapped:
        torch.cuda.synchronize()  # the copies are complete before the sender hears back
    return out
