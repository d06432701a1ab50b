"""The checksums a GPU candidate runner keeps of a large input instead of a copy
(kf.evaluation.runner.compare.fingerprint): equal for the same bytes, different after the kinds
of change a kernel makes to its inputs by mistake, exact at any size."""

from __future__ import annotations

import pytest
import torch

from kf.evaluation.runner import compare
from kf.evaluation.runner.compare import Fingerprint, compare_inputs, fingerprint


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(1000, 37),
        lambda: torch.randn(333, dtype=torch.float16),  # 666 bytes: not whole 32-bit words
        lambda: torch.randint(-(2**62), 2**62, (4097,), dtype=torch.int64),
        lambda: torch.rand(513) > 0.5,
        lambda: torch.randn(64, 64)[:, ::2],  # not contiguous
        lambda: torch.randn(65, dtype=torch.float16)[1:],  # a storage offset of 2 bytes
        lambda: torch.tensor(3.5),
    ],
)
def test_fingerprint_sees_every_kind_of_change(make) -> None:  # type: ignore[no-untyped-def]
    t = make()
    before = fingerprint(torch, t)
    assert fingerprint(torch, t.clone()) == before
    flat = t.reshape(-1)
    if t.numel() > 1:
        swapped = flat.clone()
        i, j = 0, flat.numel() - 1
        swapped[i], swapped[j] = flat[j].clone(), flat[i].clone()
        if not torch.equal(swapped, flat):
            assert fingerprint(torch, swapped.view(t.shape)) != before, "a swap"
    changed = flat.clone()
    changed[changed.numel() // 2] = (
        ~changed[changed.numel() // 2]
        if t.dtype == torch.bool
        else (changed[changed.numel() // 2] + 1)
    )
    assert fingerprint(torch, changed.view(t.shape)) != before, "one element"


def test_fingerprint_is_exact_across_rows_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With rows and chunks made tiny, a tensor spans many of each (and a padded tail):
    the checksums equal a plain Python computation of the same sums."""
    monkeypatch.setattr(compare, "_ROW", 16)
    monkeypatch.setattr(compare, "_ROWS", 3)
    t = torch.randint(-(2**31), 2**31 - 1, (1001,), dtype=torch.int32)
    words = t.tolist()
    want = [sum(words)] + [
        sum(w * (k % m + 1) for k, w in enumerate(words)) for m in compare._MODULI
    ]
    assert fingerprint(torch, t).sums == tuple(want)
    t[700] += 1
    assert fingerprint(torch, t).sums[0] == want[0] + 1


def test_compare_inputs_against_a_fingerprint() -> None:
    x = torch.randn(300, 7)
    kept = [fingerprint(torch, x), 5]
    assert isinstance(kept[0], Fingerprint)
    assert compare_inputs(torch, kept, [x.clone(), 5]) is None
    relu = x.clone().relu_()
    assert (
        compare_inputs(torch, kept, [relu, 5]) == "input 0 was modified by the candidate's forward"
    )
    assert compare_inputs(torch, kept, [x.reshape(7, 300), 5]) is not None  # same bytes, new shape
    assert compare_inputs(torch, kept, [x.double(), 5]) is not None
