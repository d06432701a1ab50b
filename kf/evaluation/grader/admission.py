"""Device-memory admission: a task whose trial cannot fit twice in the device's memory
is refused before any trial, with the estimate (:func:`too_large`); tasks above
``$KF_BIG_TASK_MB`` are verified one at a time per device (``BIG_LOCKS``)."""

from __future__ import annotations

import threading

from kf.evaluation.wire.protocol import InputsMade

BIG_LOCKS: dict[str, threading.Lock] = {}


def set_footprint(made: InputsMade) -> int:
    """Bytes of one input set and its outputs, from a ``make_inputs`` reply."""
    sizes = {"float64": 8, "int64": 8, "complex64": 8, "float16": 2, "bfloat16": 2, "int16": 2}
    total = 0
    for shapes, dtypes in (
        (made.input_shapes, made.input_dtypes),
        (made.output_shapes, made.output_dtypes),
    ):
        for shape, dtype in zip(shapes, dtypes, strict=False):
            n = 1
            for d in shape:
                n *= int(d)
            total += n * sizes.get(str(dtype), 1 if str(dtype) in ("int8", "uint8", "bool") else 4)
    return total


def too_large(made: InputsMade, device: str) -> str | None:
    """Why a task cannot be evaluated on ``device`` at all, from its first ``make_inputs``
    reply, or None. A GPU evaluation holds the task's inputs and outputs twice (the
    reference's set, the candidate's own), measured on the H200 at 2.05× their size
    (bench/kernelbench_memory.py); past the device's whole memory no schedule can fit it,
    so the candidate is refused before any trial with the estimate and the reason."""
    total = made.device_total_bytes
    if not device.startswith("cuda") or total <= 0:
        return None
    footprint = set_footprint(made)
    need = 2 * footprint
    if need <= total:
        return None
    gb = 1e9
    return (
        f"the task needs about {need / gb:.1f} GB of device memory (its inputs and outputs, "
        f"{footprint / gb:.1f} GB, held by the reference runner and by the candidate's) and "
        f"{device} has {total / gb:.1f} GB"
    )
