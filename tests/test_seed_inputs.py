"""Candidates that make their own trial inputs from the seed (``KF_TENSOR_TRANSPORT=seed``).

Boxed GPU runners cannot share CUDA IPC handles, so there the candidate runner makes each
trial's inputs itself, as the reference runner does, and the grader moves only outputs.
These tests run that path on the CPU: the runner's protocol directly, then whole
evaluations whose verdicts must be those of the default path (an honest kernel passes and
is profiled, a kernel writing into its input, a stale one and a caching one are caught).
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch

from kf.evaluation import RunnerPool
from kf.evaluation.runner.loop import Runner
from kf.evaluation.wire.protocol import Check, MakeInputs, Run
from tests.runner_cases import FIXTURES, check_default_verdict, pool_under, runner_pair


def _dump(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _pair(candidate: str) -> tuple[Runner, Runner]:
    return runner_pair(candidate, {}, {"own_inputs": True})


def test_runner_makes_the_reference_inputs_from_the_seed_and_moves_only_outputs() -> None:
    ref, cand = _pair((FIXTURES / "honest_cpp.py").read_text())
    made = ref.op_make_inputs(MakeInputs(seed=11, send=False))
    assert made.inputs is None  # nothing to move
    ran = cand.op_run(Run(seed=11))
    assert ran.inputs_after is None and ran.inputs_problem is None
    # the candidate's inputs are the reference's, bit for bit
    expected_inputs = ref.trials[11][0]
    assert all(torch.equal(a, b) for a, b in zip(cand.inputs, expected_inputs, strict=True))
    verdict = ref.op_check(Check.of(ran, 11)).verdict
    assert verdict.ok, verdict
    # another seed gives other inputs, and the check follows the seed it is told
    other = cand.op_run(Run(seed=12))
    ref.op_make_inputs(MakeInputs(seed=12, send=False))
    assert not torch.equal(cand.inputs[0], expected_inputs[0])
    assert ref.op_check(Check.of(other, 12)).verdict.ok
    assert not ref.op_check(Check.of(other, 11)).verdict.ok


def test_runner_reports_an_input_written_by_the_candidate() -> None:
    ref, cand = _pair((FIXTURES / "input_write.py").read_text())
    ref.op_make_inputs(MakeInputs(seed=5, send=False))
    ran = cand.op_run(Run(seed=5))
    assert ran.inputs_problem == "input 0 was modified by the candidate's forward"
    verdict = ref.op_check(Check.of(ran, 5)).verdict
    assert not verdict.ok and verdict.kind in ("input_mutated", "mismatch")


@pytest.fixture(scope="module")
def seeded_pool() -> Iterator[RunnerPool]:
    yield from pool_under({"KF_TENSOR_TRANSPORT": "seed"})


@pytest.mark.parametrize("name", ["honest_cpp", "input_write", "stale", "cache_outputs"])
def test_evaluation_with_seeded_inputs_gives_the_default_verdicts(
    name: str, seeded_pool: RunnerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KF_TENSOR_TRANSPORT", "seed")
    check_default_verdict(name, seeded_pool)


def test_payloads_over_the_piece_size_travel_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """msgpack cannot carry one bytes object over 4 GiB (a 6.4 GB KernelBench output
    crashed the runner on the H200): longer payloads go as a list of pieces, through the
    real message encoding, and are judged as before."""
    from kf.evaluation.runner import common as runner_module
    from kf.evaluation.wire.protocol import Ran, decode_from_runner, encode

    monkeypatch.setattr(runner_module, "PAYLOAD_PIECE", 4096)
    ref, cand = _pair((FIXTURES / "honest_cpp.py").read_text())
    ref.op_make_inputs(MakeInputs(seed=21, send=False))
    ran = decode_from_runner(encode(cand.op_run(Run(seed=21))))
    assert isinstance(ran, Ran)
    assert isinstance(ran.outputs, list) and len(ran.outputs) > 1
    assert all(len(piece) <= 4096 for piece in ran.outputs)
    assert ref.op_check(Check.of(ran, 21)).verdict.ok
    wrong = decode_from_runner(encode(cand.op_run(Run(seed=22))))
    assert isinstance(wrong, Ran)
    assert not ref.op_check(Check.of(wrong, 21)).verdict.ok
