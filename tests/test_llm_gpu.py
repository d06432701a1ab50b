"""The user's path on a GPU: `kf run` on a seedless CUDA task with an LLM (scripted).

The scripted server (labelled ``scripted``; it serves modules kf's developers wrote) answers
each first-generation request in the language the prompt asks for: CUDA C++ through
``load_inline`` (KernelBench's format) or Triton. Both must reach the GPU, be verified and
profiled, and the run must replay with the server stopped. Skips without a GPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kf.events import decode_event
from kf.log import EventLog
from tests.harness import run_kf, seedless_scale_relu
from tests.llm_server import ScriptedServer
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


def kf(*args: str, timeout: float = 560) -> subprocess.CompletedProcess[str]:
    return run_kf(*args, timeout=timeout, eval_threads=None)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    db = tmp_path_factory.mktemp("llmgpu") / "run.db"
    task = seedless_scale_relu(db.parent / "tasks", 8192, 8192)  # big enough for a GPU
    with ScriptedServer(responder=GpuResponder()) as server:
        proc = kf(
            "run", str(task), "--device", "cuda:0", "--llm-url", server.url,
            "--model", "scripted", "--budget", "4", "--init", "2", "--db", str(db),
            "--json", "--max-in-flight", "4",
        )  # fmt: skip
        url = server.url
    assert proc.returncode == 0, proc.stderr[-6000:]
    return db, json.loads(proc.stdout), url


def _events(db: Path, tag: str) -> list[Any]:
    with EventLog(db, readonly=True) as elog:
        return [decode_event(e) for e in elog.read(types=[tag])]


def test_llm_gpu_first_generation_reaches_the_gpu_in_both_languages(gpu_run: Any) -> None:
    """One CUDA load_inline and one Triton first kernel were asked for, assigned to the
    GPU with their backends, verified and profiled."""
    db, report, url = gpu_run
    inits = [s for s in _events(db, "search.parent_selected") if s.operator == "init"]
    assert sorted(s.language for s in inits) == ["cuda", "triton"]
    assigned = {a.candidate_id: a for a in _events(db, "search.candidate_assigned")}
    proposed = [c for c in _events(db, "kernel.candidate_proposed") if c.operator == "init"]
    assert {assigned[c.candidate_id].backend for c in proposed} == {"cuda-load-inline", "triton"}
    assert all(assigned[c.candidate_id].device_id.endswith("cuda:0") for c in proposed)
    profiled = {p.candidate_id: p for p in _events(db, "kernel.candidate_profiled")}
    failed = {f.candidate_id: f for f in _events(db, "kernel.candidate_failed")}
    for c in proposed:
        assert c.mutator == f"llm: scripted via {url}"
        assert c.candidate_id in profiled, (
            f"{c.candidate_id} ({assigned[c.candidate_id].backend}) was not profiled: "
            f"{failed.get(c.candidate_id)}"
        )
        assert profiled[c.candidate_id].report.ok and profiled[c.candidate_id].report.device
    (task,) = report["tasks"]
    assert task["best_speedup"] is not None
    assert task["profiled"] + task["failed"] == task["candidates"]


def test_llm_gpu_replay_check_passes_with_server_gone(gpu_run: Any) -> None:
    """`kf replay --check` recomputes the GPU run's decisions without the model."""
    db, _, _ = gpu_run
    proc = kf("replay", str(db), "--check", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout)["check"]["ok"] is True
