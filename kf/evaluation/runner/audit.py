"""The task audit's runner side (``op_audit`` of a reference runner): the task's
reference outputs on the trial seeds' inputs and on scaled copies of the first set, and
whether a constant answer would pass them all. The grader's side, and what the audit is
for, is :mod:`kf.evaluation.grader.audit`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from kf.evaluation.runner.compare import CHUNK_ELEMENTS, compact, compare_outputs
from kf.evaluation.runner.variants import scale_inputs
from kf.evaluation.wire.protocol import Audit, Audited

__all__ = ["audit_reference"]


def _num(t: Any) -> Any:
    """A tensor that subtraction works on (bool outputs become float)."""
    return t if t.is_floating_point() or t.is_complex() else t.float()


def audit_reference(runner: Any, msg: Audit) -> Audited:
    """The reference runner's side (``op_audit``): run ``Model`` on each seed's inputs
    and scaled copies of the first, and judge whether a constant would pass."""
    torch = runner.torch
    tol = None if msg.tol is None else msgspec.to_builtins(msg.tol)
    first: list[Any] | None = None
    used = passes = 0
    constant_all = zeros_all = True  # the first set's output as a constant; all zeros
    spread = scale = 0.0
    for raw in _input_sets(runner, msg.seeds, msg.scales):
        inputs = [runner.backend.to_device(v) for v in raw]
        del raw
        try:
            with torch.no_grad():
                out = runner.model(*inputs)
        except Exception:  # a distribution the reference rejects is not part of the audit
            continue
        finally:
            del inputs  # before the next set is made
        flat = [out] if isinstance(out, torch.Tensor) else list(out)
        # compact: a loss's 0-d result can hold its full-size buffer (compare.oversized)
        other = [compact(torch, o) for o in flat if isinstance(o, torch.Tensor)]
        del out, flat
        used += 1
        zeros_all = zeros_all and _zeros_pass(torch, other, tol)
        if first is None:
            first = other
            scale = max((float(o.abs().max()) for o in first if o.numel()), default=0.0)
            continue
        same_shape = [tuple(a.shape) for a in first] == [tuple(b.shape) for b in other]
        constant = same_shape and bool(compare_outputs(torch, other, first, tol)["ok"])
        constant_all = constant_all and constant
        passes += int(constant)
        if same_shape:
            moved = max(
                (_gap(a, b) for a, b in zip(first, other, strict=True) if a.numel()),
                default=0.0,
            )
            spread = max(
                spread, moved / scale if scale > 0 else (0.0 if moved == 0 else float("inf"))
            )
        del other
        runner._trim_device_cache()  # what a set took goes back to the other runners
    if used < 2:
        return Audited(degenerate=False, input_sets=used, reason="too few input sets")
    return _audited(used, passes, constant_all, zeros_all, spread, msg.scales)


def _input_sets(runner: Any, seeds: list[int], scales: list[float]) -> Iterator[list[Any]]:
    """The input sets, one at a time (at KernelBench's sizes a set is gigabytes): none
    is held here while the next is made (a set kept in a local across the ``yield``
    was a second one on the device)."""
    for s in seeds:
        yield runner._get_inputs(s)
    for factor in scales:
        scaled = [scale_inputs(runner.torch, runner._get_inputs(seeds[0]), factor) or []]
        if scaled[0]:
            yield scaled.pop()


def _zeros_pass(torch: Any, expected: list[Any], tol: dict[str, Any] | None) -> bool:
    """Whether all zeros pass against ``expected``: compared a chunk at a time, since
    a whole tensor of zeros is one more output's worth of device memory."""
    for o in expected:
        flat = o.reshape(-1)
        for start in range(0, max(flat.numel(), 1), CHUNK_ELEMENTS):
            part = flat[start : start + CHUNK_ELEMENTS]
            zero = torch.zeros_like(part)
            if not compare_outputs(torch, [part], [zero], tol)["ok"]:
                return False
            del zero
    return True


def _gap(a: Any, b: Any) -> float:
    """max |a − b|, a chunk at a time (no whole-size temporaries)."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    worst = 0.0
    for start in range(0, fa.numel(), CHUNK_ELEMENTS):
        part = (
            _num(fa[start : start + CHUNK_ELEMENTS]) - _num(fb[start : start + CHUNK_ELEMENTS])
        ).abs()
        worst = max(worst, float(part.max()))
    return worst


def _audited(
    used: int,
    passes: int,
    constant_all: bool,
    zeros_all: bool,
    spread: float,
    scales: list[float],
) -> Audited:
    """The audit's answer from what the input sets showed."""
    degenerate = constant_all or zeros_all
    if zeros_all:
        answer = f"all zeros pass on all {used} input sets"
    elif constant_all:
        answer = f"the first set's output, returned as a constant, passes on all {used}"
    else:
        answer = f"a constant answer passes on {passes + 1} of {used} input sets"
    reason = (
        f"{answer} (trial seeds, and inputs scaled by {', '.join(f'{s:g}' for s in scales)}); "
        f"outputs move by at most {spread:.3g} of their size between sets"
    )
    return Audited(
        degenerate=degenerate,
        reason=reason,
        input_sets=used,
        spread=spread,
        constant_passes=passes + 1,
    )
