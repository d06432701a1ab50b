"""Inputs a candidate never saw: unseen shapes for the generalisation gate, and the
task's inputs under other distributions (scaled by 3, by 0.01, by -1).

Runs in the candidate-free reference runner; ``torch`` and the task's module are passed in.

**Shapes** must be shapes the task itself can produce, or an honest kernel is rejected
for breaking a contract the task never offered (a square ``A @ B`` task is N × N by
N × N; rescaling only A's rows gives a product the reference accepts and the task never
asks for). In order of preference:

1. the task's ``get_extra_inputs()`` (a list of input lists), when it defines one;
2. the task's module-level size constants (``N = 2048``, ``batch_size = 16``: ints whose
   values appear in the input shapes), scaled, with ``get_inputs()`` called again: first
   all of them together, then each alone, to about one half (variant 0) or one and a half
   (variant 1), odd sizes;
3. only for a task with no such constant (shapes written into ``get_inputs``): the
   leading dimension of every input that shares the first input's, sliced or extended.

Whatever is derived, a variant the reference itself rejects (raises on) is not used;
the runner tries the next one (:meth:`kf.evaluation.runner_reference.ReferenceRole._make_inputs`).

**Distributions**: :data:`SCALES`, as KernelBench-Verified checks: every floating-point
input tensor multiplied by the factor, integer inputs (indices, sizes) left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["SCALES", "derived_shapes", "scale_inputs", "size_constants"]

#: hidden input distributions: factors applied to the task's floating-point inputs
SCALES: tuple[float, ...] = (3.0, 0.01, -1.0)


def _odd(size: int) -> int:
    return size + 1 - size % 2  # odd sizes catch kernels that assume a multiple of 2, 4, 8…


def _rescaled(size: int, variant: int) -> int:
    return _odd(size // 2 + 1 if variant == 0 else size + size // 2 + 1)


def _shapes(torch: Any, values: list[Any]) -> list[tuple[int, ...]]:
    return [tuple(v.shape) for v in values if isinstance(v, torch.Tensor)]


def size_constants(torch: Any, module: Any, base: list[Any]) -> list[str]:
    """Module-level int constants of the task whose values are sizes of its inputs
    (a dimension of an input tensor, or an int input), in definition order."""
    dims = {d for shape in _shapes(torch, base) for d in shape}
    dims |= {v for v in base if type(v) is int}
    out = []
    for name, value in vars(module).items():
        if name.startswith(("_", "KF_")) or type(value) is not int:
            continue
        if value > 1 and value in dims:
            out.append(name)
    return out


def _with_constants(module: Any, values: dict[str, int], call: Callable[[], list[Any]]) -> Any:
    saved = {n: getattr(module, n) for n in values}
    try:
        for n, v in values.items():
            setattr(module, n, v)
        return call()
    finally:
        for n, v in saved.items():
            setattr(module, n, v)


def derived_shapes(
    torch: Any,
    module: Any,
    get_inputs: Callable[[int], list[Any]],
    seed: int,
    variant: int,
) -> Iterator[tuple[str, list[Any]]]:
    """Input sets for generalisation variant ``variant`` (0 or 1), most preferred first,
    without ``get_extra_inputs()`` (the runner reads that itself); none when there is none.

    ``get_inputs(seed)`` seeds torch and calls the task's ``get_inputs()``. The sets are
    made one at a time, as they are asked for: at KernelBench's sizes each is several GB
    of device memory, and the runner uses the first its reference accepts.
    """
    if variant > 1:
        return
    base = get_inputs(seed)
    names = size_constants(torch, module, base)
    base_shapes = _shapes(torch, base)
    found = False
    if names:
        del base  # the sets below are made afresh; at these sizes the base is gigabytes
        groups = [names] + ([[n] for n in names] if len(names) > 1 else [])
        if variant == 1:  # growing every size at once can multiply memory: one at a time
            groups = [[n] for n in names]
        for group in groups:
            values = {n: _rescaled(int(getattr(module, n)), variant) for n in group}
            values = {n: v for n, v in values.items() if v != getattr(module, n)}
            if not values:
                continue
            try:
                made = _with_constants(module, values, lambda: get_inputs(seed))
            except Exception:  # the task cannot make inputs of that size
                continue
            if _shapes(torch, made) == base_shapes:
                continue  # get_inputs() does not read the constants
            what = ", ".join(f"{n}={getattr(module, n)}→{v}" for n, v in values.items())
            found = True
            yield f"task size constants {what}", made
            del made
        if found:
            return
        base = get_inputs(seed)
    tensors = [i for i, v in enumerate(base) if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not tensors:
        return
    lead = int(base[tensors[0]].shape[0])
    size = _rescaled(lead, variant)
    if size == lead:
        return
    more = get_inputs(seed ^ 0x5EED) if size > lead else None
    out = list(base)
    for i in tensors:
        if int(base[i].shape[0]) != lead:
            continue
        both = torch.cat([base[i], more[i]]) if more is not None else base[i]
        out[i] = both[:size].clone()
    del base, more
    yield "leading dimension", out


def scale_inputs(torch: Any, values: list[Any], factor: float) -> list[Any] | None:
    """``values`` with every floating-point tensor multiplied by ``factor``; None when
    there is no floating-point input to scale."""
    floats = [isinstance(v, torch.Tensor) and v.is_floating_point() for v in values]
    if not any(floats):
        return None
    return [v * factor if is_float else v for v, is_float in zip(values, floats, strict=True)]
