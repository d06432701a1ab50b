"""What a runner pays before and while it grades (issue 31): the op recorder without
``torch._dynamo``, and the start-up line a runner logs (bench/runner_cost.py reads it).

The recorder's verdicts themselves (a candidate computing with PyTorch is flagged,
an honest one is not, through real runners) are tests/test_evaluation.py's
``test_warmed_runners_trace_and_verify`` and tests/test_adversarial.py's
``torch_reference``.
"""

from __future__ import annotations

import contextlib
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kf.bus import EmbeddedServer
from kf.evaluation import RunnerPool
from kf.evaluation.runner.guard import OpRecorder
from kf.evaluation.wire.protocol import Ping, Pong

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import runner_cost


def test_the_op_recorder_records_without_importing_dynamo() -> None:
    """In a fresh interpreter (as a runner is), tracing a call records its aten ops and
    leaves ``torch._dynamo`` unimported: PyTorch's own wrapper imported it (1 to 2
    CPU-seconds in every verification's candidate runner)."""
    code = textwrap.dedent(
        """
        import sys, torch
        from kf.evaluation.runner.guard import OpRecorder
        recorder = OpRecorder(torch)
        with recorder, torch.no_grad():
            torch.nn.functional.gelu(torch.ones(4) * 2)
        print(sorted(recorder.ops), "torch._dynamo" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")[-2]
    assert out == "['gelu', 'mul', 'ones'] False", out


def test_the_op_recorder_keeps_dynamo_out_once_dynamo_is_loaded() -> None:
    """Once dynamo is in the process (a candidate's ``torch.compile``), the recorder's
    dispatch goes through PyTorch's dynamo-disabled wrapper, as PyTorch's own modes do;
    a compiled function called under the recorder runs eagerly and its ops are recorded
    (so a candidate computing with ``torch.compile`` is still flagged)."""
    import torch._dynamo

    compiled = torch.compile(lambda x: torch.sigmoid(x) + 1, backend="eager")
    x = torch.randn(8)
    compiled(x)  # compiled outside the recorder
    recorder = OpRecorder(torch)
    with recorder, torch.no_grad():
        got = compiled(x)
    assert torch.equal(got, torch.sigmoid(x) + 1)
    assert {"sigmoid", "add"} <= set(recorder.ops), recorder.ops
    # the call went through PyTorch's wrapper, which caches dynamo's disabled function
    # on the wrapped one at its first call
    raw = inspect.getclosurevars(type(recorder).__torch_dispatch__).nonlocals["raw"]
    assert getattr(raw, "__dynamo_disable", None) is not None


def test_a_warmed_runner_logs_its_start_up_and_has_no_dynamo() -> None:
    """A runner warmed for its device (the op tracer entered once) says what its
    start-up cost, step by step, and did not import dynamo; it then serves."""
    pool = RunnerPool(size=0, threads=1, warm="cpu")
    try:
        with pool.lease() as handle:
            log = handle.log_tail()
            line = next(x for x in log.splitlines() if x.startswith("kf runner: started in"))
            for step in ("interpreter and kf", "import torch", "runner set-up", "op tracer"):
                assert f"{step} " in line, line
            assert "torch._dynamo loaded: no" in line, line
            # what bench/runner_cost.py reads of it, and of the box from /proc
            steps = runner_cost.startup_steps(log)
            assert steps["import torch"]["cpu_s"] > 0.1, steps
            box_cpu, processes = runner_cost.tree_cpu(handle.pid)
            assert processes >= 2 and box_cpu >= steps["import torch"]["cpu_s"], (box_cpu, steps)
            assert isinstance(handle.request(Ping(), 60.0), Pong)
    finally:
        pool.close()


def test_kf_load_inline_is_in_place_when_a_candidate_imports_it() -> None:
    """A runner's backend no longer imports ``torch.utils.cpp_extension`` (0.12 CPU-s of
    setuptools) but still hands kf's ``load_inline`` to whoever imports it, however it is
    imported; a module imported before the backend gets it at once."""
    code = textwrap.dedent(
        """
        import sys, time, torch
        import kf.cuda.inline as kf_inline
        from kf.evaluation.runner.device import make_backend
        make_backend("cpu", time.perf_counter_ns)
        print("imported", "torch.utils.cpp_extension" in sys.modules)
        from torch.utils.cpp_extension import load_inline
        import torch.utils.cpp_extension as ext
        mine = kf_inline.load_inline
        print("kf's", load_inline is mine, ext.load_inline is mine)
        make_backend("cpu", time.perf_counter_ns)  # installed at once, still kf's
        print("again", ext.load_inline is kf_inline.load_inline, callable(kf_inline._original))
        """
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert out[-3:] == ["imported False", "kf's True True", "again True True"], out


def test_a_runner_warmed_for_the_gpu_has_its_context_and_no_dynamo() -> None:
    """On a GPU (the H200): a runner warmed for ``cuda:0`` made its CUDA context and
    entered the op tracer before it said it was ready, without importing dynamo, and
    its box's CPU is what bench/runner_cost.py reports for a start."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (the H200)")
    pool = RunnerPool(size=0, threads=1, warm="cuda:0")
    try:
        with pool.lease() as handle:
            line = next(
                x for x in handle.log_tail().splitlines() if x.startswith("kf runner: started in")
            )
            steps = runner_cost.startup_steps(handle.log_tail())
            assert {"import torch", "CUDA context", "op tracer"} <= set(steps), line
            assert "torch._dynamo loaded: no" in line, line
            assert isinstance(handle.request(Ping(), 60.0), Pong)
    finally:
        pool.close()


def test_run_without_worker_keeps_no_idle_runners_after_its_task_check(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """``kf run --no-worker`` evaluates nothing after checking its tasks, so once the run
    has started no runner is left below it (warm idle ones would each have imported
    torch for nothing: about 1.3 s of a core apiece)."""
    from kf.shutdown import descendants
    from tests.test_faults import kf_proc, of_type, run_args, stop, wait_until

    def runners() -> list[str]:
        cmds = []
        for pid in descendants(main.pid):
            with contextlib.suppress(OSError):
                cmds.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "))
        return [c.decode() for c in cmds if b"kf.evaluation.runner" in c]

    db = tmp_path / "run.db"
    main = kf_proc(*run_args(nats_server.url, db, "no-worker", 1, "--no-worker"))
    try:
        wait_until(lambda: of_type(db, "run.started") or main.poll() is not None, 120, "start")
        assert main.poll() is None, main.communicate()[1][-3000:]
        assert of_type(db, "kernel.task_checked")  # the check ran in a runner
        wait_until(lambda: not runners(), 30, "no runner left below kf run --no-worker")
    finally:
        stop(main)
        main.communicate()
