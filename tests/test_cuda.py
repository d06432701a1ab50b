"""kf.cuda, the CUDA hardware probe and the CUDA backend: pure parts run anywhere,
NVRTC parts where cuda-python is installed, GPU parts only on a machine with a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hardware_agents.cuda import copy_bandwidth_gbs, parse_nvcc_version, parse_nvidia_smi_clocks
from kf.cuda import parse_ptxas_log
from kf.cuda.backends import backend_of
from kf.cuda.inline import cache_key

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "examples" / "cuda_tasks" / "gelu_residual.py"
SEEDS = ROOT / "examples" / "cuda_tasks" / "seeds"
INLINE = ROOT / "examples" / "cuda_candidates" / "gelu_residual_load_inline.py"

HAS_NVRTC = importlib.util.find_spec("cuda") is not None and (
    importlib.util.find_spec("cuda.bindings") is not None
)
needs_nvrtc = pytest.mark.skipif(
    not HAS_NVRTC, reason="cuda-python (cuda.bindings) with NVRTC is not installed here"
)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs an NVIDIA GPU and a CUDA build of PyTorch (CI has neither)",
)

PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'first' for 'sm_90'
ptxas info    : Function properties for first
ptxas         .     144 bytes stack frame, 144 bytes spill stores, 140 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'second' for 'sm_90'
ptxas info    : Function properties for second
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 22 registers, used 0 barriers
"""


def test_ptxas_log_reads_registers_shared_memory_and_spills() -> None:
    """Each entry function's registers, shared memory, stack and spills come from the log."""
    first, second = parse_ptxas_log(PTXAS)
    assert (first.name, first.registers, first.shared_bytes) == ("first", 64, 4096)
    assert (first.stack_bytes, first.spill_stores_bytes, first.spill_loads_bytes) == (
        144,
        144,
        140,
    )
    assert first.constant_bytes == 400
    assert (second.name, second.registers, second.spill_stores_bytes) == ("second", 22, 0)


def test_backend_of_routes_cpu_and_each_cuda_backend() -> None:
    """CPU targets stay cpp-openmp; CUDA sources are Triton, load_inline or NVRTC."""
    assert backend_of("load_inline(...)", "cpu") == "cpp-openmp"
    assert backend_of("import triton\n", "cuda:0") == "triton"
    assert backend_of("m = load_inline(name='x')", "cuda:0") == "cuda-load-inline"
    assert backend_of("kf.cuda.compile(SOURCE)", "cuda:1") == "cuda-nvrtc"


def test_inline_cache_key_covers_sources_not_verbosity() -> None:
    """The build key changes with the sources and toolchain, not with verbose or the folder."""
    env = {"torch": "2.11", "cuda": "13.0", "arch": "9.0"}
    args = {"name": "k", "cpp_sources": "int f();", "cuda_sources": "x", "verbose": False}
    key = cache_key(args, env)
    assert cache_key({**args, "verbose": True, "build_directory": "/tmp/x"}, env) == key
    assert cache_key({**args, "cuda_sources": "y"}, env) != key
    assert cache_key(args, {**env, "arch": "8.0"}) != key


def test_probe_parsers_read_nvcc_and_nvidia_smi() -> None:
    """nvcc's release, the driver and clocks are read from fixed tool output."""
    assert parse_nvcc_version("Cuda compilation tools, release 13.0, V13.0.88") == "13.0"
    assert parse_nvcc_version("garbage") is None
    assert parse_nvidia_smi_clocks("580.159.03, 345, 3201, 1980\n") == {
        "driver_version": "580.159.03",
        "sm_clock_mhz": 345,
        "memory_clock_mhz": 3201,
        "max_sm_clock_mhz": 1980,
    }
    assert parse_nvidia_smi_clocks("") == {}
    assert copy_bandwidth_gbs(10**9, 1.0) == pytest.approx(2000.0)


@needs_nvrtc
def test_nvrtc_compile_reports_resources_and_reuses_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVRTC builds the seed kernel for sm_90 with its resources; a second build is a hit."""
    from kf.cuda import compile_cubin

    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path))
    source = (SEEDS / "gelu_residual.py").read_text().split('SOURCE = r"""')[1].split('"""')[0]
    defines = {"BLOCK": 256, "ITEMS": 4, "MATH_EXP": 1}
    first = compile_cubin(source, arch="sm_90", defines=defines)
    again = compile_cubin(source, arch="sm_90", defines=defines)
    assert not first.cached and again.cached and again.cubin == first.cubin
    (kernel,) = first.resources
    assert kernel.name == "gelu_residual" and kernel.registers > 0
    assert kernel.spill_stores_bytes == 0


@needs_nvrtc
def test_nvrtc_compile_error_carries_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source NVRTC rejects raises CudaCompileError whose log names the problem."""
    from kf.cuda import CudaCompileError, compile_cubin

    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path))
    with pytest.raises(CudaCompileError) as info:
        compile_cubin('extern "C" __global__ void k() { undefined_thing(); }', arch="sm_90")
    assert "undefined_thing" in info.value.log


@needs_gpu
def test_cuda_probe_reports_device_and_measurements() -> None:
    """The probe names the GPU and measures a positive copy bandwidth and bf16 rate."""
    from hardware_agents.cuda import probe_in_subprocess

    caps = probe_in_subprocess("cuda:0")
    assert caps.sm_count > 0 and caps.l2_bytes > 0 and caps.memory_bytes > 0
    assert (caps.measured_copy_bandwidth_gbs or 0) > 0
    assert (caps.measured_bf16_tflops or 0) > 0
    assert "cuda-nvrtc" in caps.backends


@needs_gpu
@pytest.mark.parametrize("seed", ["gelu_residual.py", "gelu_residual.triton.py"])
def test_cuda_evaluate_seed_is_correct_and_profiled(seed: str) -> None:
    """The NVRTC and Triton seeds pass verification on the GPU and are profiled against
    eager PyTorch (how much faster they are is bench/gpu_pipeline.py's to say: a timing
    is no test's assertion)."""
    from kf.evaluation import evaluate
    from kf.kernels.tasks import load_task

    result = evaluate(load_task(TASK), (SEEDS / seed).read_text(), device="cuda:0")
    assert result.correct, result.error
    assert result.profile is not None and result.profile.ok, result.error
    assert result.profile.runtime_ms > 0 and result.profile.ref_runtime_ms > 0
    # the stages state the most device memory their runners held at once: at least the
    # task's one 134 MB input and its output (4096 x 8192 fp32 each)
    assert result.verify is not None
    for stage in (result.verify, result.profile):
        assert stage.peak_device_mb is not None and stage.peak_device_mb > 2 * 134


@needs_gpu
def test_cuda_load_inline_candidate_is_correct() -> None:
    """A KernelBench-style load_inline candidate compiles through kf's cache and verifies."""
    from kf.evaluation import evaluate
    from kf.kernels.tasks import load_task

    result = evaluate(load_task(TASK), INLINE.read_text(), device="cuda:0")
    assert result.correct, result.error


@needs_gpu
def test_cuda_illegal_memory_access_fails_only_that_candidate() -> None:
    """A kernel writing far out of bounds is rejected; the next candidate still verifies."""
    from kf.evaluation import verify_candidate
    from kf.kernels.tasks import load_task

    task = load_task(TASK)
    good = (SEEDS / "gelu_residual.py").read_text()
    bad = good.replace("out[i] = o;", "out[i + (1LL << 40)] = o;")
    rejected = verify_candidate(task, bad, device="cuda:0")
    assert not rejected.correct
    assert rejected.failure_kind in ("crash", "exception")
    assert verify_candidate(task, good, device="cuda:0").correct


@needs_gpu
def test_cuda_verification_over_ipc_matches_bytes_and_still_rejects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensors passed by CUDA IPC give the verdict the torch.save path gives, and a
    kernel that is wrong by a little is still rejected with the mismatch found. Unboxed
    runners: CUDA IPC does not cross kf's boxes (bench/box_ipc_probe.py), so only
    unboxed runners use it by default."""
    from kf.evaluation import RunnerPool, verify_candidate
    from kf.kernels.tasks import load_task

    task = load_task(TASK)
    good = (SEEDS / "gelu_residual.py").read_text()
    wrong = good.replace("+ rv[k].w;", "+ 1.01f * rv[k].w;")
    assert wrong != good
    verdicts = {}
    monkeypatch.setenv("KF_UNSAFE_NO_SANDBOX", "1")
    for transport in ("ipc", "bytes"):
        monkeypatch.setenv("KF_TENSOR_TRANSPORT", transport)
        pool = RunnerPool(size=2)
        try:
            ok = verify_candidate(task, good, device="cuda:0", pool=pool)
            again = verify_candidate(task, good, device="cuda:0", pool=pool)  # reused reference
            bad = verify_candidate(task, wrong, device="cuda:0", pool=pool)
        finally:
            pool.close()
        assert ok.correct and again.correct, (ok.error, again.error)
        assert not bad.correct and bad.failure_kind == "mismatch", bad.error
        verdicts[transport] = ok.max_abs_err
    assert verdicts["ipc"] == pytest.approx(verdicts["bytes"], rel=1e-6, abs=1e-9)


_BIG_TEMPORARY = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return (x.repeat(8, 1) * 2).sum()  # 2 GiB of temporaries for a 128 MiB input

def get_inputs():
    return [torch.rand(8192, 4096)]

def get_init_inputs():
    return []
"""


@needs_gpu
def test_cuda_timing_gives_its_temporaries_back_and_warms_up_first() -> None:
    """The reference and candidate runners time in turn on one GPU: after its turn each
    gives back the blocks its calls' temporaries took (``settle``; at KernelBench's
    HuberLoss size, 8 GB each), and before its next makes one untimed call, so no
    sample pays for allocating them again; the timed request makes only its own calls."""
    import time

    from kf.evaluation.runner import common as runner_common
    from kf.evaluation.runner.loop import Runner
    from kf.evaluation.wire.protocol import LoadTask, MakeInputs, Settle, Setup, Time

    ref = Runner(time.perf_counter_ns)
    ref.op_setup(Setup(device="cuda:0", threads=1))
    ref.op_load_task(LoadTask(source=_BIG_TEMPORARY, name="big_temporary", seed=3))
    ref.op_make_inputs(MakeInputs(seed=1, send=False))
    calls = 0
    model = ref.model

    def counted(*args: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return model(*args)

    ref.model = counted
    ref.op_settle(Settle(warm=True))
    assert len(ref.op_time(Time(n=3)).samples_ns) == 3
    cuda = torch.cuda
    assert cuda.memory_reserved() - cuda.memory_allocated() > runner_common._TRIM_ABOVE_BYTES
    ref.op_settle(Settle())
    assert cuda.memory_reserved() - cuda.memory_allocated() <= runner_common._TRIM_ABOVE_BYTES
    assert ref.cold
    calls = 0
    ref.op_settle(Settle(warm=True))
    ref.op_time(Time(n=3))
    assert calls == 4 and not ref.cold  # the warm-up, then the three timed
