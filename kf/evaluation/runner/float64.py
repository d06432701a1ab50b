"""The reference run in float64, for the float64 rule (:mod:`kf.evaluation.wire.tolerance`).

Only where a candidate's outputs fail allclose: the reference runner copies its Model,
casts the copy's parameters and the trial's floating-point inputs to float64 (exact),
runs it once and hands its outputs to :func:`kf.evaluation.runner.compare.judge_float64`; the
copy and the outputs are dropped after that one check. What a task cannot do in float64
(an op without a float64 kernel, a forward that casts to a dtype of its own, a set too
large to hold twice more) is said in the verdict's ``fp64_skipped``, and allclose's
verdict stands. Runs in the candidate-free reference runner only; ``torch`` is passed in
so that this module can be imported without it.
"""

from __future__ import annotations

import copy
import os
from typing import Any

__all__ = ["check_with_float64", "reference_in_float64"]

#: the share of the free memory (the device's, or the host's for a CPU task) a float64
#: run may need: its inputs, outputs and parameters at twice their fp32 size, and the
#: forward's temporaries
FREE_SHARE = 0.4


def _free_bytes(torch: Any, device: Any) -> int:
    """Free bytes where the reference lives: the GPU's, else the host's available memory."""
    if getattr(device, "type", "cpu") == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import resource

    try:
        page = os.sysconf("SC_PAGE_SIZE")
        free = int(os.sysconf("SC_AVPHYS_PAGES") * page)
        limit, _ = resource.getrlimit(resource.RLIMIT_AS)
        if limit != resource.RLIM_INFINITY:  # the runner's own limit (Setup.memory_bytes)
            with open("/proc/self/statm") as statm:
                held = int(statm.read().split()[0]) * page
            free = min(free, max(0, limit - held))
        return free
    except (ValueError, OSError):  # pragma: no cover - not Linux
        return 0


def _wide(torch: Any, value: Any) -> Any:
    """An input as the float64 run gets it: a floating-point tensor cast to float64 (a
    copy), any other tensor copied (the forward may write to it), anything else as is."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return value.detach().to(torch.float64, copy=True)
    return value.detach().clone()


def _float_outputs(torch: Any, expected: list[Any]) -> list[int]:
    """The outputs the float64 rule can judge: floating-point and narrower than float64."""
    return [
        i
        for i, t in enumerate(expected)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
    ]


def reference_in_float64(
    torch: Any, model: Any, pristine: list[Any], expected: list[Any]
) -> list[Any] | str:
    """The reference's outputs on ``pristine`` with the Model and its inputs in float64,
    or why there are none. ``expected``: eager's outputs (their count, shapes, dtypes)."""
    if not _float_outputs(torch, expected):
        return "no output narrower than float64"
    if any(isinstance(v, torch.Tensor) and v.is_complex() for v in [*pristine, *expected]):
        return "complex tensors"
    params = [*model.parameters(), *model.buffers()]
    tensors = [v for v in (*pristine, *expected, *params) if isinstance(v, torch.Tensor)]
    # the float64 copies of the inputs and parameters, and the float64 outputs
    need = sum(8 * t.numel() if t.is_floating_point() else t.nbytes for t in tensors)
    device = next((t.device for t in expected if isinstance(t, torch.Tensor)), None)
    free = _free_bytes(torch, device)
    if need > FREE_SHARE * free:
        return (
            f"too large for a float64 run: about {need / 1e9:.1f} GB of float64 tensors, "
            f"{free / 1e9:.1f} GB free"
        )
    try:
        wide = copy.deepcopy(model).to(torch.float64)
        args = [_wide(torch, v) for v in pristine]
        with torch.no_grad():
            out = wide(*args)
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
        del wide, args, out
    except Exception as exc:  # an op without float64, out of memory: allclose decides
        if getattr(device, "type", "cpu") == "cuda":
            torch.cuda.empty_cache()
        return f"the reference does not run in float64: {type(exc).__name__}: {exc}"[:300]
    if len(outs) != len(expected):
        return f"the float64 run returned {len(outs)} outputs, eager {len(expected)}"
    for i in _float_outputs(torch, expected):
        got = outs[i]
        if not isinstance(got, torch.Tensor) or got.dtype != torch.float64:
            what = getattr(got, "dtype", type(got).__name__)
            return f"the float64 run's output {i} is {what} (the forward casts it)"
        if tuple(got.shape) != tuple(expected[i].shape):
            return f"the float64 run's output {i} has shape {list(got.shape)}"
    return outs


def check_with_float64(
    torch: Any,
    model: Any,
    pristine: list[Any],
    expected: list[Any],
    got: Any,
    tol: dict[str, Any] | None,
    verdict: dict[str, Any],
) -> dict[str, Any]:
    """``verdict`` (allclose's, failed) judged again by the float64 rule where it applies:
    the float64 rule's verdict, or ``verdict`` saying why it did not apply."""
    from kf.evaluation.runner.compare import judge_float64
    from kf.evaluation.wire.tolerance import Tolerance, float64_rule

    if verdict["ok"] or verdict["kind"] != "mismatch":
        return verdict
    if not float64_rule(Tolerance(**tol) if tol else Tolerance()):
        return {**verdict, "fp64_skipped": "a plain-allclose tolerance preset"}
    if not isinstance(got, list | tuple) or len(got) != len(expected):
        return verdict
    exact = reference_in_float64(torch, model, pristine, expected)
    if isinstance(exact, str):
        return {**verdict, "fp64_skipped": exact}
    try:
        return judge_float64(torch, expected, list(got), exact, tol)
    finally:
        del exact
