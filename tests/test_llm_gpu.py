"""The user's path on a GPU: `kf run` on a seedless CUDA task with an LLM (scripted).

The scripted server (labelled ``scripted``; it serves modules kf's developers wrote) answers
each first-generation request in the language the prompt asks for: CUDA C++ through
``load_inline`` (KernelBench's format) or Triton. Both must reach the GPU, be verified and
profiled, and the run must replay with the server stopped. Skips without a GPU.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import logged, replay_check, scripted_llm_run, seedless_scale_relu
from tests.scripted_answers import GpuResponder

pytestmark = [
    pytest.mark.gpu,
    # a whole boxed run: its CUDA candidate's build alone took 64 s on the H200
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs an NVIDIA GPU and a CUDA build of PyTorch (CI has neither)",
    ),
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc for load_inline"),
]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    db = tmp_path_factory.mktemp("llmgpu") / "run.db"
    task = seedless_scale_relu(db.parent / "tasks", 8192, 8192)  # big enough for a GPU
    report, url = scripted_llm_run(
        GpuResponder(), task, db, "--device", "cuda:0", "--budget", "4", "--init", "2",
        "--max-in-flight", "4", timeout=560, eval_threads=None,
    )  # fmt: skip
    return db, report, url


def test_llm_gpu_first_generation_reaches_the_gpu_in_both_languages(gpu_run: Any) -> None:
    """One CUDA load_inline and one Triton first kernel were asked for, assigned to the
    GPU with their backends, verified and profiled."""
    db, report, url = gpu_run
    inits = [s for s in logged(db, "search.parent_selected") if s.operator == "init"]
    assert sorted(s.language for s in inits) == ["cuda", "triton"]
    assigned = {a.candidate_id: a for a in logged(db, "search.candidate_assigned")}
    proposed = [c for c in logged(db, "kernel.candidate_proposed") if c.operator == "init"]
    assert {assigned[c.candidate_id].backend for c in proposed} == {"cuda-load-inline", "triton"}
    assert all(assigned[c.candidate_id].device_id.endswith("cuda:0") for c in proposed)
    profiled = {p.candidate_id: p for p in logged(db, "kernel.candidate_profiled")}
    failed = {f.candidate_id: f for f in logged(db, "kernel.candidate_failed")}
    for c in proposed:
        assert c.mutator == f"llm: scripted via {url}"
        assert c.candidate_id in profiled, (
            f"{c.candidate_id} ({assigned[c.candidate_id].backend}) was not profiled: "
            f"{failed.get(c.candidate_id)}"
        )
        assert profiled[c.candidate_id].report.ok and profiled[c.candidate_id].report.device
    (task,) = report["tasks"]
    assert task["best_speedup"] is not None
    assert task["profiled"] + task["failed"] + task["duplicates"] == task["candidates"]


def test_llm_gpu_replay_check_passes_with_server_gone(gpu_run: Any) -> None:
    """`kf replay --check` recomputes the GPU run's decisions without the model."""
    db, _, _ = gpu_run
    replay_check(db)
