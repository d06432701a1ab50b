"""bench/seeds/decoder_block and bench/model_seeds.py: developer-written CUDA seeds for the
decoder block's RMSNorm and SiluMul regions, given to the tasks kf extract writes.

No GPU here: the seeds' kernels are run on the CPU through tests/fixtures/cuda_cpu_shim.h
(each CUDA thread a std::thread; it checks the kernels' logic, not CUDA itself), launched
as the seeds' own host code plans them, and judged against the task's eager reference.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kf.kernels.tasks import import_source, load_task

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from model_seeds import SEED_NOTE, install_seeds, summary_lines

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ROOT / "bench/seeds/decoder_block"
SHIM = ROOT / "tests/fixtures/cuda_cpu_shim.h"
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (C++20)")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny decoder block in bf16, extracted by kf extract (CPU), seeds installed."""
    out = tmp_path_factory.mktemp("seeded") / "tasks"
    env = {**os.environ, "DECODER_BLOCK_SIZE": "tiny", "DECODER_BLOCK_DTYPE": "bfloat16"}
    proc = subprocess.run(
        [sys.executable, "-m", "kf.app.cli", "extract", "examples/models/decoder_block.py:build",
         "-o", str(out), "--device", "cpu", "--top", "6", "--min-share", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


def _task(tasks: Path, cls: str) -> Path:
    (path,) = [p for p in tasks.glob("*.py") if f"_{cls}_" in p.name]
    return path


def _seed_module(tasks: Path, cls: str) -> Any:
    task = load_task(_task(tasks, cls))
    return import_source(f"kf_seed_{cls}", task.seeds[0].source)


def test_bench_seeds_go_to_the_tasks_of_their_region_class(tasks: Path) -> None:
    """RMSNorm and SiluMul tasks get their developer seed, labelled, after the task's own
    text; the projections and the attention core get none; a stale seed is removed."""
    (tasks / "seeds").mkdir(exist_ok=True)
    (tasks / "seeds/stale.py").write_text("class ModelNew: pass\n")
    installed = {t.task.split("_", 2)[1]: t for t in install_seeds(tasks, SEEDS)}
    assert installed["RMSNorm"].seeds == ["RMSNorm.py"]
    assert installed["SiluMul"].seeds == ["SiluMul.py"]
    assert installed["Linear"].seeds == [] and installed["AttentionCore"].seeds == []
    assert not (tasks / "seeds/stale.py").exists()
    for cls in ("RMSNorm", "SiluMul"):
        task = load_task(_task(tasks, cls))
        (seed,) = task.seeds
        assert seed.name == _task(tasks, cls).stem
        assert seed.source.startswith(task.source.rstrip())
        assert f"developer seed {cls}.py ({SEED_NOTE})" in seed.source
    lines = summary_lines(list(installed.values()), SEEDS, llm=False)
    assert any("RMSNorm" in line and "developer seed RMSNorm.py" in line for line in lines)
    assert any("AttentionCore" in line and "offline mutator skips it" in line for line in lines)


@pytest.mark.parametrize("cls", ["RMSNorm", "SiluMul"])
def test_bench_seeds_off_cuda_run_the_reference_with_its_parameters(tasks: Path, cls: str) -> None:
    """Built under the same seed, ModelNew holds the reference's parameters (same names,
    shapes, values: kf's check and the patch's binding need them) and, on the CPU, gives
    the reference's output bit for bit at both shape sets, in bf16 and in fp32."""
    install_seeds(tasks, SEEDS)
    mod = _seed_module(tasks, cls)
    torch.manual_seed(3)
    ref = mod.Model()
    torch.manual_seed(3)
    new = mod.ModelNew()
    assert {k: v.shape for k, v in new.state_dict().items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }
    for k, v in ref.state_dict().items():
        assert torch.equal(new.state_dict()[k], v)
    with torch.no_grad():
        for inputs in [mod.get_inputs(), *mod.get_tuning_inputs()]:
            assert inputs[0].dtype == torch.bfloat16
            assert torch.equal(new(*inputs), ref(*inputs))
            as32 = [t.float() for t in inputs]
            assert torch.equal(new.float()(*as32), ref.float()(*as32))


def _emulated(mod: Any, source: str, tmp: Path, kernels: list[str]) -> ctypes.CDLL:
    """The seed's kernels compiled for the CPU through the shim, one run_<kernel> each."""
    config = mod.CONFIG
    runs = "\n".join(
        f'extern "C" void run_{k}(unsigned g, unsigned b, void* x, void* y, void* z, '
        f"long long n, float eps) {{ kf_call({k}, g, b, x, y, z, n, eps); }}"
        for k in kernels
    )
    driver = (
        source
        + """
template <typename A, typename B, typename C, typename... R>
void kf_call(void (*k)(A, B, C, long long, R...), unsigned g, unsigned b, void* x, void* y,
             void* z, long long n, float eps) {
    kf_launch(g, b, [=] { k((A)x, (B)y, (C)z, n, (R)eps...); });
}
"""
        + runs
    )
    (tmp / "kernel.cpp").write_text(driver)
    lib = tmp / "kernel.so"
    subprocess.run(
        ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
         f"-DBLOCK={config['BLOCK']}", f"-DITEMS={config['ITEMS']}", "-include", str(SHIM),
         str(tmp / "kernel.cpp"), "-o", str(lib)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    dll = ctypes.CDLL(str(lib))
    for k in kernels:
        fn = getattr(dll, f"run_{k}")
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + [ctypes.c_void_p] * 3
        fn.argtypes += [ctypes.c_longlong, ctypes.c_float]
        fn.restype = None
    return dll


def _launch(dll: ctypes.CDLL, plan: tuple[str, int, int, list[Any]]) -> str:
    name, grid, block, args = plan
    pointers = [a.data_ptr() for a in args[:3]]
    eps = args[4] if len(args) > 4 else 0.0
    getattr(dll, f"run_{name}")(grid, block, *pointers, args[3], eps)
    return name


def _judge(got: torch.Tensor, want: torch.Tensor, same_bits_as: torch.Tensor) -> None:
    """kf's rule for half types (atol = rtol = 1e-2) against eager's ``want``, and nearly
    every element the same bits as ``same_bits_as`` (summation order aside)."""
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert (got == same_bits_as).float().mean().item() > 0.97


@needs_gxx
def test_bench_seeds_rmsnorm_kernel_matches_eager_on_cpu_emulation(
    tasks: Path, tmp_path: Path
) -> None:
    """The RMSNorm kernel, planned by the seed's host code: 16-byte packs with the row
    kept in registers (4096) and the rest read again (5120), and element by element (a
    row of 1001): as the task's eager reference computes."""
    install_seeds(tasks, SEEDS)
    mod = _seed_module(tasks, "RMSNorm")
    kernels = ["rmsnorm_bf16_vec", "rmsnorm_bf16_scalar"]
    dll = _emulated(mod, mod.RMSNORM_SOURCE, tmp_path, kernels)
    seen = set()
    for cols, dtype in [(4096, torch.bfloat16), (1001, torch.bfloat16), (5120, torch.bfloat16)]:
        torch.manual_seed(cols)
        x = (torch.randn(3, cols) * 2 + 0.5).to(dtype)
        w = (1 + 0.1 * torch.randn(cols)).to(dtype)
        ref = mod.Model()
        ref.weight = torch.nn.Parameter(w, requires_grad=False)
        out = torch.full_like(x, float("nan"))
        seen.add(_launch(dll, mod.launch_plan(x, w, out)))
        with torch.no_grad():
            want = ref(x)
        _judge(out, want, same_bits_as=want)  # the formula and rounding of eager's
    assert seen == {"rmsnorm_bf16_vec", "rmsnorm_bf16_scalar"}


@needs_gxx
def test_bench_seeds_silu_mul_kernel_matches_eager_on_cpu_emulation(
    tasks: Path, tmp_path: Path
) -> None:
    """The SiluMul kernel, planned by the seed's host code: packs over a last, partial
    block (bf16 and fp32) and element by element (1001 elements): within kf's rule of
    eager, and rounded once from the float64 value (eager rounds twice), ties to even."""
    install_seeds(tasks, SEEDS)
    mod = _seed_module(tasks, "SiluMul")
    kernels = [f"silu_mul_{t}_{v}" for t in ("bf16", "f32") for v in ("vec", "scalar")]
    dll = _emulated(mod, mod.SILU_MUL_SOURCE, tmp_path, kernels)
    per_block = mod.CONFIG["BLOCK"] * mod.CONFIG["ITEMS"]
    seen = set()
    for n, dtype in [(8 * per_block * 2 + 40, torch.bfloat16), (1001, torch.bfloat16),
                     (4 * per_block + 12, torch.float32)]:  # fmt: skip
        torch.manual_seed(n)
        gate, up = (torch.randn(n) * 3).to(dtype), torch.randn(n).to(dtype)
        out = torch.full_like(gate, float("nan"))
        seen.add(_launch(dll, mod.launch_plan(gate, up, out)))
        truth = torch.nn.functional.silu(gate.double()) * up.double()
        with torch.no_grad():  # eager rounds silu's output, then the product: twice
            want = mod.Model()(gate, up)
        if dtype == torch.bfloat16:
            _judge(out, want, same_bits_as=truth.to(dtype))
        else:  # fp32: a few ulps of fp32 math from float64
            torch.testing.assert_close(out.double(), truth, atol=1e-6, rtol=1e-6)
    assert seen == {"silu_mul_bf16_vec", "silu_mul_bf16_scalar", "silu_mul_f32_vec"}
    # ties: silu(g) = g exactly in fp32 for g >= 20, and g * u halfway between two bf16s
    g, u = torch.arange(20, 40, 0.125), torch.arange(1, 2, 1 / 128)
    ties = ((g[:, None] * u[None, :]).view(torch.int32) & 0xFFFF) == 0x8000
    gi, ui = ties.nonzero(as_tuple=True)
    gate, up = g[gi][:256].to(torch.bfloat16), u[ui][:256].to(torch.bfloat16)
    out = torch.empty_like(gate)
    assert _launch(dll, mod.launch_plan(gate, up, out)) == "silu_mul_bf16_vec"
    assert torch.equal(out, (gate.double() * up.double()).to(torch.bfloat16))  # to even


def test_bench_model_gpu_refuses_a_missing_seed_folder_in_one_line(tmp_path: Path) -> None:
    """bench/model_gpu.py --seeds on a folder that does not exist says so in one line,
    before it extracts anything."""
    proc = subprocess.run(
        [sys.executable, "bench/model_gpu.py", "--out", str(tmp_path / "out"), "--seeds",
         str(tmp_path / "nope")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"model_gpu: --seeds {tmp_path / 'nope'}: no such folder (a folder of <Class>.py seeds)"
    ]
    assert not (tmp_path / "out/tasks").exists()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize(
    ("cls", "var"), [("RMSNorm", "RMSNORM_SOURCE"), ("SiluMul", "SILU_MUL_SOURCE")]
)
def test_bench_seeds_build_for_sm90_at_their_space_corners(
    tasks: Path, tmp_path: Path, cls: str, var: str
) -> None:
    """nvcc builds each seed's CUDA text (as NVRTC gets it: no include) for sm_90 at its
    CONFIG and at the largest BLOCK and ITEMS of its SPACE, with no register spills at
    CONFIG."""
    install_seeds(tasks, SEEDS)
    mod = _seed_module(tasks, cls)
    (tmp_path / "k.cu").write_text(getattr(mod, var))
    big = {k: max(v) for k, v in mod.SPACE.items()}
    for config in (mod.CONFIG, big):
        proc = subprocess.run(
            ["nvcc", "-arch=sm_90", "-c", "-Xptxas", "-v", str(tmp_path / "k.cu"), "-o",
             str(tmp_path / "k.o"), *(f"-D{k}={v}" for k, v in config.items())],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        if config is mod.CONFIG:
            assert " 0 bytes spill stores" in proc.stderr
            assert "bytes spill stores" not in proc.stderr.replace(" 0 bytes spill stores", "")
