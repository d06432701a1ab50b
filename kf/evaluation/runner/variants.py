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
   all of them together, then each alone, to about one half (variant 0), or each alone to
   about one and a half (variant 1), odd sizes. A set of :data:`GROW_CAP_ABOVE` bytes or
   more grows by less, to at most :data:`GROW_CAP` of its bytes (sized on PyTorch's meta
   device first, where the task's ``get_inputs()`` can run there);
3. only for a task with no such constant (shapes written into ``get_inputs``): the
   leading dimension of every input that shares the first input's, sliced or extended.

Whatever is derived, a variant the reference itself rejects (raises on) is not used;
the runner tries the next one (:meth:`kf.evaluation.runner.reference.ReferenceRole._make_inputs`).

**Distributions**: the grader's :data:`kf.evaluation.grader.grading.SCALES`, as
KernelBench-Verified checks: every floating-point
input tensor multiplied by the factor, integer inputs (indices, sizes) left alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

from kf.evaluation.runner.compare import tensor_bytes

__all__ = ["derived_shapes", "scale_inputs", "size_constants"]


def _odd(size: int) -> int:
    return size + 1 - size % 2  # odd sizes catch kernels that assume a multiple of 2, 4, 8…


def _rescaled(size: int, variant: int) -> int:
    return _odd(size // 2 + 1 if variant == 0 else size + size // 2 + 1)


#: a set of at least this many bytes grows (variant 1) by at most :data:`GROW_CAP` in bytes
GROW_CAP_ABOVE = 1 << 30
GROW_CAP = 1.125


def _growths(size: int) -> list[int]:
    """Odd sizes above ``size``, largest first: about 1.5×, 1.25×, 1.125×, … down to
    the next odd size."""
    out: list[int] = []
    step = size // 2
    while step >= 1:
        out.append(_odd(size + step + 1))
        step //= 2
    out.append(_odd(size + 1))
    return [g for i, g in enumerate(out) if g > size and g not in out[:i]]


def _on_meta(torch: Any, module: Any, values: dict[str, int]) -> list[Any] | None:
    """The task's ``get_inputs()`` with its size constants set to ``values``, made on
    PyTorch's meta device: shapes and dtypes, no memory. None when the task cannot make
    its inputs there (a ``.item()``, an explicit ``.cuda()``)."""
    try:
        with torch.device("meta"):
            made = _with_constants(module, values, module.get_inputs)
        return list(made)
    except Exception:
        return None


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
    # the task's own sizes, from a set made on the meta device where it can be (at
    # KernelBench's sizes a real one is gigabytes, made only to be measured)
    probe = _on_meta(torch, module, {})
    base = probe if probe is not None else get_inputs(seed)
    names = size_constants(torch, module, base)
    base_shapes = _shapes(torch, base)
    base_bytes = tensor_bytes(torch, base)
    found = False
    if names:
        del base  # the sets below are made afresh; at these sizes the base is gigabytes
        groups = [names] + ([[n] for n in names] if len(names) > 1 else [])
        if variant == 1:  # growing every size at once can multiply memory: one at a time
            groups = [[n] for n in names]
        capped = variant == 1 and probe is not None and base_bytes >= GROW_CAP_ABOVE
        for group in groups:
            if capped:  # a large set grows by at most GROW_CAP of its bytes
                values = {group[0]: _capped_growth(torch, module, group[0], base_bytes)}
            else:
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
    elif probe is not None:
        base = get_inputs(seed)  # the leading dimension's sets are cut from a real one
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


def _capped_growth(torch: Any, module: Any, name: str, base_bytes: int) -> int:
    """The largest of :func:`_growths` for constant ``name`` whose set (sized on the meta
    device) stays within :data:`GROW_CAP` × ``base_bytes``; the smallest when none does.
    At KernelBench's sizes a 1.5× mat-vec matrix is 12.9 GB against the task's 8.6 GB,
    held by the reference and the candidate at once; 1.125× of it still is a size no
    kernel was written for, odd, and larger than the task's."""
    sizes = _growths(int(getattr(module, name)))
    for size in sizes:
        made = _on_meta(torch, module, {name: size})
        if made is not None and tensor_bytes(torch, made) <= GROW_CAP * base_bytes:
            return size
    return sizes[-1]


def scale_inputs(torch: Any, values: list[Any], factor: float) -> list[Any] | None:
    """``values`` with every floating-point tensor multiplied by ``factor``; None when
    there is no floating-point input to scale.

    ``values`` is a set the caller has just made and lets go of (``get_inputs()``'s), so
    a tensor that nothing else holds (no other reference to it or to its storage, not a
    view) is scaled in place: at KernelBench's sizes a scaled copy beside the original is
    one more set of device memory (8 GiB for the mat-vec task's matrix). A tensor the
    task keeps elsewhere (a module-level input it returns each time) is copied, so later
    sets are not scaled too; in place or not, the values are the same."""
    floats = [isinstance(v, torch.Tensor) and v.is_floating_point() for v in values]
    if not any(floats):
        return None
    alone = _unshared(torch, values)
    return [
        (v.mul_(factor) if own else v * factor) if is_float else v
        for v, is_float, own in zip(values, floats, alone, strict=True)
    ]


def _unshared(torch: Any, values: list[Any]) -> list[bool]:
    """For each of ``values``: whether it is a tensor held only by ``values`` (one
    reference, one user of its storage, not a view, not needing grad), judged against a
    tensor made here and held the same way, since the counts differ by Python and
    PyTorch version."""
    uses = getattr(torch._C, "_storage_Use_Count", None)
    if uses is None:  # no way to see who shares a storage: copy every one
        return [False] * len(values)
    probe = [torch.empty(1)]
    (refs_alone,) = _references(probe)
    uses_alone = uses(probe[0].untyped_storage()._cdata)
    refs = _references(values)
    return [
        isinstance(v, torch.Tensor)
        and not v.requires_grad  # an in-place product of a leaf that needs grad raises
        and v._base is None
        and n <= refs_alone
        and uses(v.untyped_storage()._cdata) <= uses_alone
        for v, n in zip(values, refs, strict=True)
    ]


def _references(values: list[Any]) -> list[int]:
    """``sys.getrefcount`` of each of ``values``, each counted the same way."""
    return [sys.getrefcount(v) for v in values]
