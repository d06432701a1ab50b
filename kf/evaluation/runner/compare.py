"""Output and input comparison, run inside the candidate-free reference runner.

Tensors are compared on the reference's device (the GPU for a GPU task).

``torch`` is passed in so that this module can be imported without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

__all__ = [
    "Fingerprint",
    "checkable",
    "compare_inputs",
    "compare_outputs",
    "fingerprint",
    "float64_errors",
    "is_large",
    "judge_float64",
    "tolerance",
]

_HALF = ("float16", "bfloat16")


def tolerance(dtype_name: str) -> float:
    """atol = rtol for a dtype, as KernelBench: 1e-2 for half types, 1e-4 otherwise."""
    return 1e-2 if dtype_name in _HALF else 1e-4


CHUNK_ELEMENTS = 1 << 25  # elements compared at once (256 MiB per float64 temporary)


def _name(torch: Any, dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def compare_outputs(
    torch: Any, expected: list[Any], got: Any, tol: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A verdict ``{ok, kind, reason, max_abs_err, max_rel_err, min_tol}`` for one trial's
    outputs; ``tol`` is a :class:`kf.evaluation.wire.tolerance.Tolerance` as a dict (None:
    KernelBench's). ``min_tol`` is the smallest atol = rtol at which the outputs pass."""
    from kf.evaluation.wire.tolerance import Tolerance, describe, for_dtype

    choice = Tolerance(**tol) if tol else Tolerance()
    verdict: dict[str, Any] = {
        "ok": True,
        "kind": None,
        "reason": None,
        "max_abs_err": 0.0,
        "max_rel_err": 0.0,
        "min_tol": 0.0,
        "rule": "allclose",
    }

    def fail(kind: str, reason: str) -> dict[str, Any]:
        return {**verdict, "ok": False, "kind": kind, "reason": reason}

    if not isinstance(got, list | tuple) or len(got) != len(expected):
        count = len(got) if isinstance(got, list | tuple) else "?"
        return fail("shape_mismatch", f"returned {count} outputs, expected {len(expected)}")
    for i, (want, given) in enumerate(zip(expected, got, strict=True)):
        label = f"output {i}" if len(expected) > 1 else "output"
        wrong = _form_problem(torch, label, want, given)
        if wrong is not None:
            return fail(*wrong)
        # compared where the reference lives (on a GPU for a GPU task), in float64, a chunk
        # at a time; outputs that arrived on the host (a memory file) move there a chunk at
        # a time too, so that no whole second copy of them is made on the device
        want_c = want.detach()
        have = given.detach()
        if not (want_c.is_floating_point() or want_c.is_complex()):
            have = have.to(want_c.device)
            if not torch.equal(have, want_c):
                bad = int((have != want_c).sum())
                return fail("mismatch", f"{label}: {bad} of {want_c.numel()} elements differ")
            continue
        atol, rtol = for_dtype(choice, _name(torch, want.dtype))
        found = _float_errors(torch, have, want_c, atol, rtol)
        if found.differs_non_finite:
            return fail("mismatch", f"{label} differs from the reference's non-finite values")
        abs_err, rel_err, min_tol, over_count, nonfinite, total = found[:6]
        if nonfinite:
            return fail(
                "nan_inf",
                f"{label} holds {nonfinite} NaN/Inf values where the reference is finite",
            )
        verdict["max_abs_err"] = max(verdict["max_abs_err"], abs_err)
        verdict["max_rel_err"] = max(verdict["max_rel_err"], rel_err)
        verdict["min_tol"] = max(verdict["min_tol"], min_tol)
        if over_count:
            return fail(
                "mismatch",
                f"{label}: {over_count} of {total} elements outside "
                f"{describe(atol, rtol)} (max abs err {abs_err:.3g}, max rel err "
                f"{rel_err:.3g}; would pass at atol=rtol={min_tol:.2g})",
            )
    return verdict


def _form_problem(torch: Any, label: str, want: Any, given: Any) -> tuple[str, str] | None:
    """(kind, why) when ``given`` is not a tensor of ``want``'s shape and dtype."""
    if not isinstance(given, torch.Tensor):
        return "exception", f"{label} is a {type(given).__name__}, not a tensor"
    if tuple(given.shape) != tuple(want.shape):
        return (
            "shape_mismatch",
            f"{label} has shape {list(given.shape)}, expected {list(want.shape)}",
        )
    if given.dtype != want.dtype:
        return (
            "dtype_mismatch",
            f"{label} has dtype {_name(torch, given.dtype)}, expected {_name(torch, want.dtype)}",
        )
    return None


class _FloatErrors(NamedTuple):
    """One floating-point output against the reference's: the largest absolute and relative
    errors, the smallest atol = rtol that passes, the elements outside (atol, rtol), the
    NaN/Inf values where the reference is finite, the elements, and whether a non-finite
    value of the reference differs (the comparison stops there)."""

    abs_err: float
    rel_err: float
    min_tol: float
    over_count: int
    nonfinite: int
    total: int
    differs_non_finite: bool = False


def _float_errors(torch: Any, have: Any, want_c: Any, atol: float, rtol: float) -> _FloatErrors:
    """Compared where the reference lives, in float64, a chunk at a time: at KernelBench's
    sizes (1.6e9 elements) a whole float64 copy of both tensors would take 26 GB on top of
    them."""
    flat_have, flat_want = have.reshape(-1), want_c.reshape(-1)
    total = flat_want.numel()
    over_count = nonfinite = 0
    abs_err = rel_err = min_tol = 0.0
    for start in range(0, total, CHUNK_ELEMENTS):
        have64 = flat_have[start : start + CHUNK_ELEMENTS].to(want_c.device).double()
        want64 = flat_want[start : start + CHUNK_ELEMENTS].double()
        finite = torch.isfinite(want64)
        nonfinite += int((~torch.isfinite(have64) & finite).sum())
        if nonfinite:
            continue
        all_finite = bool(finite.all())
        if not all_finite and not bool(
            torch.equal(have64[~finite].nan_to_num(0.0), want64[~finite].nan_to_num(0.0))
        ):
            return _FloatErrors(abs_err, rel_err, min_tol, over_count, nonfinite, total, True)
        # the same figures as before, with fewer passes: no mask where every element is
        # finite (the usual case; a mask is a copy, and on a GPU a synchronisation), and
        # the quotients in one scratch tensor (have64/want64 may be the outputs
        # themselves, so only fresh tensors are written in place)
        diff = (have64 - want64).abs_()
        ref = want64.abs()
        if not all_finite:
            diff, ref = diff[finite], ref[finite]
        if diff.numel():
            abs_err = max(abs_err, float(diff.max()))
            scratch = ref.clamp_min(1e-12)
            rel_err = max(rel_err, float(torch.div(diff, scratch, out=scratch).max()))
            over_count += int((diff > torch.mul(ref, rtol, out=scratch).add_(atol)).sum())
            min_tol = max(
                min_tol, float(torch.div(diff, torch.add(ref, 1.0, out=scratch), out=scratch).max())
            )
        del have64, want64, finite, diff, ref
    return _FloatErrors(abs_err, rel_err, min_tol, over_count, nonfinite, total)


class Errors(NamedTuple):
    """One output's errors against a float64 run of the reference: the candidate's and
    eager fp32's root-mean-square and largest absolute errors (finite elements only)."""

    rmse: float
    eager_rmse: float
    max_err: float
    eager_max_err: float


def float64_errors(torch: Any, want: Any, given: Any, exact: Any) -> Errors:
    """:class:`Errors` of ``given`` (the candidate's) and ``want`` (eager's) against
    ``exact`` (the float64 run's), in float64 a chunk at a time on ``exact``'s device;
    elements where eager or the float64 run is not finite are left out."""
    flat_g, flat_w, flat_x = (t.detach().reshape(-1) for t in (given, want, exact))
    device = flat_x.device
    sq_c = sq_e = 0.0
    max_c = max_e = 0.0
    counted = 0
    for start in range(0, flat_x.numel(), CHUNK_ELEMENTS):
        x = flat_x[start : start + CHUNK_ELEMENTS].double()
        c = flat_g[start : start + CHUNK_ELEMENTS].to(device).double()
        e = flat_w[start : start + CHUNK_ELEMENTS].to(device).double()
        keep = torch.isfinite(x) & torch.isfinite(e) & torch.isfinite(c)
        dc, de = (c - x)[keep], (e - x)[keep]
        counted += int(keep.sum())
        if dc.numel():
            sq_c += float((dc * dc).sum())
            sq_e += float((de * de).sum())
            max_c = max(max_c, float(dc.abs().max()))
            max_e = max(max_e, float(de.abs().max()))
        del x, c, e, keep, dc, de
    n = max(counted, 1)
    return Errors((sq_c / n) ** 0.5, (sq_e / n) ** 0.5, max_c, max_e)


def judge_float64(
    torch: Any, expected: list[Any], got: list[Any], exact: list[Any], tol: dict[str, Any] | None
) -> dict[str, Any]:
    """The verdict of the float64 rule (:mod:`kf.evaluation.wire.tolerance`) on outputs that
    failed allclose: each output is judged by allclose first, and one that fails it only
    by its values (``mismatch``) passes when its :func:`float64_errors` are within the
    rule's budget. Shapes, dtypes, NaN/Inf and integer outputs are judged as before.
    ``exact``: the reference's outputs in float64, in the same order."""
    from kf.evaluation.wire.tolerance import Tolerance, float64_budget

    choice = Tolerance(**tol) if tol else Tolerance()
    verdict: dict[str, Any] = {"ok": True, "kind": None, "reason": None, "rule": "float64"}
    worst = -1.0
    notes: list[str] = []
    for i, (want, given, ref64) in enumerate(zip(expected, got, exact, strict=True)):
        label = f"output {i}" if len(expected) > 1 else "output"
        one = compare_outputs(torch, [want], [given], tol)
        for key in ("max_abs_err", "max_rel_err", "min_tol"):
            verdict[key] = max(verdict.get(key, 0.0), one[key])
        if one["ok"]:
            continue
        if one["kind"] != "mismatch":
            reason = one["reason"].replace("output", label, 1)
            return {**verdict, "ok": False, "kind": one["kind"], "reason": reason}
        m, big, floor = float64_budget(choice, _name(torch, want.dtype))
        err = float64_errors(torch, want, given, ref64)
        rmse_bound, max_bound = m * err.eager_rmse + floor, big * err.eager_max_err + floor
        share = max(err.rmse / rmse_bound, err.max_err / max_bound)
        if share > worst:
            worst = share
            verdict.update(
                rmse_fp64=err.rmse,
                eager_rmse_fp64=err.eager_rmse,
                max_err_fp64=err.max_err,
                eager_max_err_fp64=err.eager_max_err,
            )
        against = (
            f"against a float64 run of the reference, rmse {err.rmse:.3g} "
            f"{'<=' if err.rmse <= rmse_bound else '>'} {m:g} x eager fp32's {err.eager_rmse:.3g}"
            f" + {floor:.3g}, largest error {err.max_err:.3g} "
            f"{'<=' if err.max_err <= max_bound else '>'} {big:g} x eager's "
            f"{err.eager_max_err:.3g} + {floor:.3g}"
        )
        if share > 1.0:
            reason = one["reason"].replace("output", label, 1)
            return {**verdict, "ok": False, "kind": "mismatch", "reason": f"{reason}; {against}"}
        notes.append(f"{one['reason'].replace('output', label, 1)}, but {against}")
    if notes:
        verdict["reason"] = "passed by the float64 rule: " + "; ".join(notes)
    else:
        verdict["rule"] = "allclose"
    return verdict


class Fingerprint(NamedTuple):
    """What :func:`compare_inputs` keeps of a large input instead of a copy: its shape,
    dtype and checksums of its bytes (:func:`fingerprint`)."""

    shape: tuple[int, ...]
    dtype: Any
    sums: tuple[int, ...]


_ROW = 1 << 18  # words a partial sum covers: |word × weight| < 2**44, so a row's sum < 2**62
_ROWS = 1 << 6  # rows reduced at once on the device (64 Mi words, 512 MiB of int64 temporaries)
_MODULI = (8191, 8179)  # position weights (index mod a prime) + 1


def fingerprint(torch: Any, tensor: Any) -> Fingerprint:
    """Checksums of a tensor's bytes, computed where it lives a bounded chunk at a time:
    the sum of its 32-bit words (bytes where its size is not a multiple of 4) and two
    sums weighted by position. Exact integer arithmetic: each row's partial sum fits in
    int64 on the device, the rows are added in Python. Any change to one word changes
    the first; a reordering changes the others unless the words it swaps lie a multiple
    of 8191 × 8179 apart. A checksum, not a copy: a candidate that means to mutate its
    inputs unseen could defeat it, as it could overwrite a copy kept in its own process
    (docs/threat-model.md)."""
    t = tensor.detach()
    flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
    if flat.numel() % 4 == 0:
        try:
            words = flat.view(torch.int32)
        except RuntimeError:  # a storage offset that is not a multiple of 4 bytes: a copy
            words = flat.clone().view(torch.int32)
    else:
        words = flat
    n = words.numel()
    sums = [0] * (1 + len(_MODULI))
    step = _ROW * _ROWS
    for start in range(0, n, step):
        chunk = words[start : start + step].to(torch.int64)
        pad = (-chunk.numel()) % _ROW
        if pad:
            chunk = torch.nn.functional.pad(chunk, (0, pad))
        rows = chunk.view(-1, _ROW)
        index = torch.arange(start, start + rows.numel(), device=chunk.device).view(-1, _ROW)
        parts = [rows.sum(dim=1)]
        for m in _MODULI:
            parts.append((rows * (index % m + 1)).sum(dim=1))
        for k, part in enumerate(torch.stack(parts).cpu().tolist()):
            sums[k] += sum(part)
        del chunk, rows, index, parts
    return Fingerprint(tuple(t.shape), t.dtype, tuple(sums))


def tensor_bytes(torch: Any, values: Iterable[Any]) -> int:
    """The bytes of the tensors among ``values`` (anything else counts nothing)."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def aliases(torch: Any, a: Any, b: Any) -> bool:
    """Whether two tensors share storage."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return True


def oversized(torch: Any, value: Any) -> bool:
    """Whether ``value`` is a tensor whose storage is much larger than its elements: a
    reduction PyTorch computed in a full-size buffer (``smooth_l1_loss``'s 0-d result
    keeps the elementwise loss's storage, 4.3 GB at KernelBench's size). Kept as it is,
    the buffer stays on the device as long as the result does."""
    if not isinstance(value, torch.Tensor):
        return False
    try:
        held = value.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    return bool(held > 2 * tensor_bytes(torch, [value]) + (64 << 10))


def compact(torch: Any, value: Any) -> Any:
    """A tensor to keep: ``value`` detached, copied when it is :func:`oversized`."""
    return value.detach().clone() if oversized(torch, value) else value.detach()


def is_large(torch: Any, value: Any, above: int) -> bool:
    """Whether ``value`` is a tensor of ``above`` bytes or more (checked by checksums)."""
    return isinstance(value, torch.Tensor) and tensor_bytes(torch, [value]) >= above


def checkable(torch: Any, inputs: list[Any], above: int) -> list[Any]:
    """What ``inputs`` are checked against after a call (:func:`compare_inputs`): a copy
    of each tensor, or its :func:`fingerprint` when it has ``above`` bytes or more."""
    return [
        (fingerprint(torch, v) if is_large(torch, v, above) else v.detach().clone())
        if isinstance(v, torch.Tensor)
        else v
        for v in inputs
    ]


def compare_inputs(torch: Any, pristine: list[Any], after: Any) -> str | None:
    """Why the candidate's inputs changed during its call, or None when they did not.

    ``pristine`` holds copies of the inputs, or :class:`Fingerprint` s of the large ones."""
    if not isinstance(after, list | tuple) or len(after) != len(pristine):
        return "the candidate's inputs could not be read back"
    for i, (before, now) in enumerate(zip(pristine, after, strict=True)):
        if isinstance(before, Fingerprint):
            same = (
                isinstance(now, torch.Tensor)
                and tuple(now.shape) == before.shape
                and now.dtype == before.dtype
                and fingerprint(torch, now) == before
            )
            if not same:
                return f"input {i} was modified by the candidate's forward"
        elif isinstance(before, torch.Tensor):
            same = (
                isinstance(now, torch.Tensor)
                and now.shape == before.shape
                and now.dtype == before.dtype
                and torch.equal(now.detach().to(before.device), before.detach())
            )
            if not same:
                return f"input {i} was modified by the candidate's forward"
        elif before != now:
            return f"input {i} was modified by the candidate's forward"
    return None
