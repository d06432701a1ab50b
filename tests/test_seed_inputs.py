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
from pathlib import Path

import pytest
import torch

from kf.evaluation import EvalResult, RunnerPool, evaluate
from kf.evaluation.runner import Runner

FIXTURES = Path(__file__).parent / "fixtures" / "adversarial"
TASK_FILE = FIXTURES / "task_gelu.py"
QUICK = {"min_time_s": 0.05, "warmup": 2, "min_trials": 10}


def _dump(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _pair(candidate: str) -> tuple[Runner, Runner]:
    import time

    ref, cand = Runner(time.perf_counter_ns), Runner(time.perf_counter_ns)
    ref.op_setup({"device": "cpu", "threads": 1})
    cand.op_setup({"device": "cpu", "threads": 1, "own_inputs": True})
    source = TASK_FILE.read_text()
    init = ref.op_load_task({"source": source, "name": "task_gelu", "seed": 3})["init"]
    cand.op_load_candidate(
        {"source": candidate, "seed": 3, "init": init, "task_source": source,
         "task_name": "task_gelu"}
    )  # fmt: skip
    return ref, cand


def test_runner_makes_the_reference_inputs_from_the_seed_and_moves_only_outputs() -> None:
    ref, cand = _pair((FIXTURES / "honest_cpp.py").read_text())
    made = ref.op_make_inputs({"seed": 11, "send": False})
    assert made["inputs"] is None  # nothing to move
    ran = cand.op_run({"seed": 11})
    assert ran["inputs_after"] is None and ran["inputs_problem"] is None
    # the candidate's inputs are the reference's, bit for bit
    expected_inputs = ref.trials[11][0]
    assert all(torch.equal(a, b) for a, b in zip(cand.inputs, expected_inputs, strict=True))
    verdict = ref.op_check({"seed": 11, **ran})["verdict"]
    assert verdict["ok"], verdict
    # another seed gives other inputs, and the check follows the seed it is told
    other = cand.op_run({"seed": 12})
    ref.op_make_inputs({"seed": 12, "send": False})
    assert not torch.equal(cand.inputs[0], expected_inputs[0])
    assert ref.op_check({"seed": 12, **other})["verdict"]["ok"]
    assert not ref.op_check({"seed": 11, **other})["verdict"]["ok"]


def test_runner_reports_an_input_written_by_the_candidate() -> None:
    ref, cand = _pair((FIXTURES / "input_write.py").read_text())
    ref.op_make_inputs({"seed": 5, "send": False})
    ran = cand.op_run({"seed": 5})
    assert ran["inputs_problem"] == "input 0 was modified by the candidate's forward"
    verdict = ref.op_check({"seed": 5, **ran})["verdict"]
    assert not verdict["ok"] and verdict["kind"] in ("input_mutated", "mismatch")


@pytest.fixture(scope="module")
def seeded_pool() -> Iterator[RunnerPool]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KF_TENSOR_TRANSPORT", "seed")
        runners = RunnerPool(size=2, threads=1)
        runners.start()
        try:
            yield runners
        finally:
            runners.close()


@pytest.mark.parametrize(
    ("name", "passed", "kind_or_flag"),
    [
        ("honest_cpp", True, None),
        ("input_write", False, "input_mutated"),
        ("stale", False, "mismatch"),
        ("cache_outputs", True, "cache_suspected"),
    ],
)
def test_evaluation_with_seeded_inputs_gives_the_default_verdicts(
    name: str,
    passed: bool,
    kind_or_flag: str | None,
    seeded_pool: RunnerPool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kf.tasks import load_task

    monkeypatch.setenv("KF_TENSOR_TRANSPORT", "seed")
    result: EvalResult = evaluate(
        load_task(TASK_FILE),
        (FIXTURES / f"{name}.py").read_text(),
        pool=seeded_pool,
        timeout_s=90,
        profile_options=QUICK,
        profile=name in ("honest_cpp", "cache_outputs"),
    )
    assert result.passed is passed, result.error
    if passed:
        assert result.profile is not None and result.profile.fresh_runtime_ms is not None
        flags = " ".join(result.flags)
        assert (kind_or_flag or "") in flags if kind_or_flag else result.flags == (), flags
    else:
        assert result.failure_kind == kind_or_flag, result.error


def test_payloads_over_the_piece_size_travel_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """msgpack cannot carry one bytes object over 4 GiB (a 6.4 GB KernelBench output
    crashed the runner on the H200): longer payloads go as a list of pieces, through the
    real message encoding, and are judged as before."""
    from kf.evaluation import runner_common as runner_module
    from kf.evaluation.protocol import decode, encode

    monkeypatch.setattr(runner_module, "PAYLOAD_PIECE", 4096)
    ref, cand = _pair((FIXTURES / "honest_cpp.py").read_text())
    ref.op_make_inputs({"seed": 21, "send": False})
    ran = decode(encode(cand.op_run({"seed": 21})))
    assert isinstance(ran["outputs"], list) and len(ran["outputs"]) > 1
    assert all(len(piece) <= 4096 for piece in ran["outputs"])
    assert ref.op_check({"seed": 21, **ran})["verdict"]["ok"]
    wrong = decode(encode(cand.op_run({"seed": 22})))
    assert not ref.op_check({"seed": 21, **wrong})["verdict"]["ok"]
