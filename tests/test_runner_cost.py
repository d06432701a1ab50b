"""The output check's arithmetic, made cheaper (issue 31): the same figures as the plain
formula it replaced, on every kind of output, and the kept outputs left untouched."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kf.evaluation.runner import compare
from kf.evaluation.runner.compare import compare_outputs


def _plain(have: Any, want: Any, atol: float, rtol: float) -> tuple[Any, ...]:
    """The figures as kf computed them before: every pass masked by the finite elements."""
    have64, want64 = have.reshape(-1).double(), want.reshape(-1).double()
    finite = torch.isfinite(want64)
    nonfinite = int((~torch.isfinite(have64) & finite).sum())
    if nonfinite:
        return (0.0, 0.0, 0.0, 0, nonfinite)
    diff = (have64 - want64).abs()[finite]
    ref = want64.abs()[finite]
    if not diff.numel():
        return (0.0, 0.0, 0.0, 0, 0)
    return (
        float(diff.max()),
        float((diff / ref.clamp_min(1e-12)).max()),
        float((diff / (1.0 + ref)).max()),
        int((diff > atol + rtol * ref).sum()),
        0,
    )


def _cases() -> list[tuple[str, Any, Any]]:
    g = torch.Generator().manual_seed(0)
    want = torch.randn(300, 257, generator=g)
    close = want + 1e-6 * torch.randn(300, 257, generator=g)
    holes = want.clone()
    holes[3, 4], holes[5, 6] = float("nan"), float("inf")
    holes_got = close.clone()
    holes_got[3, 4], holes_got[5, 6] = float("nan"), float("inf")
    half = want.half()
    return [
        ("close", close, want),
        ("off", want * 1.001 + 1e-3, want),
        ("equal", want.clone(), want),
        ("zeros", torch.zeros(7), torch.zeros(7)),
        ("non-finite reference", holes_got, holes),
        ("float64", close.double(), want.double()),
        ("float16", (half.float() * 1.01).half(), half),
        ("non-finite candidate", torch.where(want > 2, float("nan"), close), want),
    ]


@pytest.mark.parametrize("chunk", [1 << 30, 1000])
@pytest.mark.parametrize(("name", "have", "want"), _cases(), ids=[c[0] for c in _cases()])
def test_the_float_check_gives_the_plain_formulas_figures(
    name: str, have: Any, want: Any, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole or a chunk at a time (1000 elements: chunks with and without non-finite
    values), the errors, the count outside the tolerance and the NaN/Inf count are the
    plain formula's, bit for bit; neither tensor is written (a float64 output's chunk is
    the output itself)."""
    monkeypatch.setattr(compare, "CHUNK_ELEMENTS", chunk)
    kept_have, kept_want = have.clone(), want.clone()
    found = compare._float_errors(torch, have, want, 1e-4, 1e-4)
    assert torch.equal(have.nan_to_num(), kept_have.nan_to_num())
    assert torch.equal(want.nan_to_num(), kept_want.nan_to_num())
    abs_err, rel_err, min_tol, over, nonfinite = found[:5]
    got = (abs_err, rel_err, min_tol, over, nonfinite)
    if chunk > have.numel():
        assert got == _plain(have, want, 1e-4, 1e-4)
    else:  # chunks: the largest of the chunks' figures, the sum of their counts
        pieces = [
            _plain(h, w, 1e-4, 1e-4)
            for h, w in zip(
                have.reshape(-1).split(chunk), want.reshape(-1).split(chunk), strict=True
            )
        ]
        if any(p[4] for p in pieces):
            assert nonfinite == sum(p[4] for p in pieces)
        else:
            assert got == (
                max(p[0] for p in pieces),
                max(p[1] for p in pieces),
                max(p[2] for p in pieces),
                sum(p[3] for p in pieces),
                0,
            )


def test_a_check_still_fails_what_it_failed() -> None:
    """End to end through compare_outputs: a wrong output fails with its figures."""
    want = torch.randn(64, 64)
    verdict = compare_outputs(torch, [want], [want * 1.01])
    assert not verdict["ok"] and verdict["kind"] == "mismatch"
    assert "elements outside" in verdict["reason"]
    assert compare_outputs(torch, [want], [want.clone()])["ok"]
