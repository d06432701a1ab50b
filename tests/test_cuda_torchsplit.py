"""kf.cuda.torchsplit: answers in KernelBench's usual layout (everything in ``cuda_sources``
under ``#include <torch/extension.h>``) built split, their kernels without torch's headers
and their host code in ``main.cpp``, where a conservative checker accepts them.

The checker's verdicts are pinned on typical answers (tests/torch_layout_answers.py): an
elementwise kernel with check macros, a shared-memory reduction with a ``__device__``
helper and the current stream, two kernels with a constant, a struct and half types, a
dynamic-shared-memory launch on a stream are split; a template helper, an
``AT_DISPATCH`` launch, a ``__constant__`` set from host code and a host ``min`` are not.
The builds are real, as in tests/test_cuda_torchfree.py: kf's ``load_inline`` builds one
answer PyTorch's way and split, for sm_90a, and the tests compare the kernels' SASS
kernel by kernel and the module's exported functions; a split that does not compile
falls back to PyTorch's build with its own errors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kf.cuda import inline, torchsplit
from tests import cuda_elf
from tests.test_cuda_torchfree import GXX, NVCC, build
from tests.torch_layout_answers import ANSWERS, MULTI_KERNEL, REDUCTION, REFUSED, SPLIT, STREAM


def _cpu_torch(source: str) -> str:
    """``source`` without the headers a CPU-only PyTorch lacks (``c10/cuda``'s made
    header, cuSPARSE for ``ATen/cuda``): the stream is the default one instead."""
    source = re.sub(r"^#include .*$", "", source, flags=re.MULTILINE)
    source = source.replace("at::cuda::getCurrentCUDAStream()", "(cudaStream_t) nullptr")
    source = source.replace("c10::cuda::getCurrentCUDAStream()", "(cudaStream_t) nullptr")
    return source.replace("C10_CUDA_KERNEL_LAUNCH_CHECK();", "")


#: one answer holding the reduction, the two kernels and the stream launch (one build
#: each way, to keep the suite's compile time down)
COMBINED = "\n".join(
    [
        "#include <torch/extension.h>\n#include <cuda_fp16.h>",
        *(_cpu_torch(s) for s in (REDUCTION, MULTI_KERNEL, STREAM)),
    ]
)
COMBINED_CALL = {
    "name": "kf_ts",
    "cpp_sources": (
        "torch::Tensor row_norm(torch::Tensor x);\n"
        "torch::Tensor two_pass(torch::Tensor x, double alpha);\n"
        "torch::Tensor add_cuda(torch::Tensor a, torch::Tensor b);\n"
    ),
    "cuda_sources": COMBINED,
    "functions": ["row_norm", "two_pass", "add_cuda"],
    "extra_cuda_cflags": ["-O3"],
}
#: splits, but does not compile: the standard build's own error is what is shown (its
#: ``main.cpp`` is the combined answer's, served by the object cache)
BROKEN_CALL = {
    **COMBINED_CALL,
    "cuda_sources": COMBINED.replace("return out;", "return kf_undeclared_value;"),
}


def test_torchsplit_splits_typical_answers() -> None:
    """The typical answers the checker can account for are split; the others are refused,
    each with its reason."""
    for name in SPLIT:
        assert torchsplit.why_not(ANSWERS[name]) is None, name
    for name, reason in REFUSED.items():
        why = torchsplit.why_not(ANSWERS[name])
        assert why is not None and reason in why, (name, why)
    assert set(SPLIT) | set(REFUSED) == set(ANSWERS)


def test_torchsplit_rewrites_launches_through_launchers() -> None:
    """Each ``<<<>>>`` launch in host code becomes a call of its kernel's launcher with
    the configuration's defaults filled in; the device part holds the kernels, the
    launchers and no torch, the host part the includes, the macros and the wrapper."""
    parts = torchsplit.split(ANSWERS["stream"])
    assert parts is not None
    assert "<<<" not in parts.host and "kf_launch_add_kernel((n + threads - 1)" in parts.host
    assert "threads * sizeof(float), stream," in parts.host
    assert "add_kernel<<<kf_grid_, kf_block_, kf_shared_, kf_stream_>>>(a, b, out, n);" in (
        parts.device
    )
    assert "torch" not in parts.device and "__global__" not in parts.host
    elementwise = torchsplit.split(ANSWERS["elementwise"])
    assert elementwise is not None
    assert "kf_launch_swish_kernel(num_blocks, block_size, 0, 0, x.data_ptr" in elementwise.host
    assert "#define CHECK_INPUT" in elementwise.host and "CHECK_" not in elementwise.device


def test_torchsplit_refuses_what_it_cannot_account_for() -> None:
    """Sources or calls where the split might not be the same program are refused: a
    kernel named outside a launch, an overloaded kernel, a struct parameter, a launch
    whose arguments have side effects, a top-level directive, extra host flags,
    ``cpp_sources`` with code, a source already free of torch."""
    head = "#include <torch/extension.h>\n"
    kernel = "__global__ void k(float* y, int n) { y[0] = n; }\n"
    host = "torch::Tensor f(torch::Tensor x) {\n    BODY\n    return x;\n}\n"

    def call(source: str, **extra: Any) -> dict[str, Any]:
        return {
            "cpp_sources": "torch::Tensor f(torch::Tensor x);",
            "cuda_sources": source,
            "functions": ["f"],
            **extra,
        }

    def launch(body: str, device: str = kernel) -> dict[str, Any]:
        return call(head + device + host.replace("BODY", body))

    good = launch("k<<<1, 32>>>(x.data_ptr<float>(), 4);")
    assert torchsplit.why_not(good) is None
    refused = [
        (
            "host code names k",
            launch(
                "cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 1);"
                "k<<<1, 32>>>(x.data_ptr<float>(), 4);"
            ),
        ),
        (
            "defined twice",
            launch(
                "k<<<1, 32>>>(x.data_ptr<float>(), 4);",
                kernel + "__global__ void k(double* y, int n) {}\n",
            ),
        ),
        (
            "parameter",
            launch(
                "k<<<1, 32>>>(x.data_ptr<float>(), 4);",
                "__global__ void k(float y[4], int n) {}\n",
            ),
        ),
        ("cannot read", launch("int i = 0; k<<<1, 32>>>(x.data_ptr<float>(), i++);")),
        ("the directive #if", call(head + "#if 1\n#endif\n" + kernel)),
        ("extra_cflags", {**good, "extra_cflags": ["-O3"]}),
        ("cpp_sources", {**good, "cpp_sources": "int g = 1;"}),
        ("name nothing of torch", call(kernel)),
        ("not a statement", launch("bool ok = (k<<<1, 32>>>(x.data_ptr<float>(), 4), true);")),
        ("extra_cuda_cflags", {**good, "extra_cuda_cflags": ["-Xcompiler -fno-math-errno"]}),
        (
            "template",
            launch("k<<<1, 32>>>(x.data_ptr<float>(), 4);", "template <int N>\n" + kernel),
        ),
    ]
    for reason, bad in refused:
        why = torchsplit.why_not(bad)
        assert why is not None and reason in why, (reason, why)


def test_torchsplit_blocks_names_cuda_declares_for_nvcc_only() -> None:
    """The unqualified host calls refused are read from the toolkit's headers: ``min``,
    ``max``, ``abs``, ``powf`` and the intrinsics are among them, the runtime API and
    torch's names are not."""
    home = torchsplit._cuda_home()
    if home is None:
        pytest.skip("needs the CUDA toolkit's headers")
    names = torchsplit.cuda_only_names(home)
    assert {"min", "max", "abs", "powf", "__shfl_down_sync", "rsqrtf"} <= names
    assert not {"cudaGetLastError", "cudaMemcpy", "TORCH_CHECK", "if", "sizeof"} & names


#: the builds' tests: three builds, run at once in the first test's setup (some 190 CPU-s
#: in all; the longest, nvcc over PyTorch's headers in the answer's cuda.cu, about 85)
_compiles = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The combined answer built PyTorch's way and split, and the broken one, in one cache."""
    if NVCC is None or GXX is None:
        pytest.skip("needs nvcc and g++")
    root = tmp_path_factory.mktemp("torchsplit")
    plan = [
        {"torchfree": "1", "args": COMBINED_CALL},
        {"torchfree": "0", "args": COMBINED_CALL},
        {"torchfree": "1", "args": BROKEN_CALL},
    ]
    (split, standard, broken), output = build(root, plan)
    assert standard["ok"], standard
    assert split["ok"], split
    cuda_ext = root / "cache" / "cuda_ext"
    return {
        "standard": standard["record"],
        "split": split["record"],
        "broken": broken,
        "standard_dir": cuda_ext / standard["record"]["key"],
        "split_dir": cuda_ext / split["record"]["key"],
        "cuda_ext": cuda_ext,
        "output": output,
    }


@_compiles
def test_torchsplit_build_records_its_path(builds: dict[str, Any]) -> None:
    """The build record, the build folder's ``kf-build.json`` and the report line say the
    answer was built split; PyTorch's way keeps ``torch``; one module name."""
    assert builds["standard"]["cuda_prelude"] == "torch"
    assert builds["split"]["cuda_prelude"] == "split"
    assert builds["standard"]["key"] != builds["split"]["key"]
    meta = json.loads((builds["split_dir"] / "kf-build.json").read_text())
    assert meta == {"cuda_prelude": "split"}
    names = {p.name for p in builds["standard_dir"].glob("*.so")}
    assert names == {p.name for p in builds["split_dir"].glob("*.so")} and len(names) == 1
    assert "(split: the kernels in cuda.cu without" in builds["output"]
    cuda = (builds["split_dir"] / "cuda.cu").read_text()
    assert "torch" not in cuda.split("\n", 1)[1] and "<<<kf_grid_" in cuda


@_compiles
def test_torchsplit_kernels_compile_to_the_same_sass(builds: dict[str, Any]) -> None:
    """Kernel by kernel, the SASS, relocations, parameter bank, attributes and resources
    of the split build's kernels are the standard build's."""
    a = cuda_elf.cubins((builds["standard_dir"] / "cuda.cuda.o").read_bytes())
    b = cuda_elf.cubins((builds["split_dir"] / "cuda.cuda.o").read_bytes())
    assert len(a) == len(b) == 1
    ka, kb = cuda_elf.kernels(a[0]), cuda_elf.kernels(b[0])
    ours = {"row_norm_kernel", "to_half_kernel", "combine_kernel", "add_kernel"}
    assert {n for n in ka if any(k in n for k in ours)} == set(ka) - {""} or len(ka) >= 4
    assert {n for n in ka if any(k in n for k in ours)} == {
        n for n in kb if any(k in n for k in ours)
    }
    assert len([n for n in ka if any(k in n for k in ours)]) == 4
    for name in ka:
        if any(k in name for k in ours):
            assert ka[name] == kb[name], name


@_compiles
def test_torchsplit_module_exports_the_same_functions(builds: dict[str, Any]) -> None:
    """Both libraries link and export the same dynamic symbols of the module (its
    ``PyInit_`` and nothing of kf's launchers), and the split one's host functions are
    defined in ``main.o``."""
    import subprocess

    def exported(folder: Path) -> set[str]:
        (library,) = folder.glob("*.so")
        out = subprocess.run(
            ["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}

    a, b = exported(builds["standard_dir"]), exported(builds["split_dir"])
    assert any(n.startswith("PyInit_") for n in a)
    assert {n for n in a if "PyInit" in n} == {n for n in b if "PyInit" in n}
    main = cuda_elf.functions((builds["split_dir"] / "main.o").read_bytes())
    assert {"_Z8row_normN2at6TensorE", "_Z8add_cudaN2at6TensorES0_"} <= set(main)
    launchers = cuda_elf.functions((builds["split_dir"] / "cuda.cuda.o").read_bytes())
    assert sum(1 for n in launchers if torchsplit.LAUNCHER_PREFIX in n) == 4


@_compiles
def test_torchsplit_failed_split_falls_back_with_pytorchs_errors(builds: dict[str, Any]) -> None:
    """A split answer whose split build fails is built PyTorch's way, and only that
    build's errors are reported (they name the original ``cuda.cu``, not ``main.cpp``)."""
    broken = builds["broken"]
    assert not broken["ok"]
    assert "kf_undeclared_value" in broken["error"]
    assert "main.cpp" not in broken["error"].split("kf_undeclared_value")[0][-300:]
    assert inline.torch_in_cuda_sources(BROKEN_CALL["cuda_sources"])


def test_torchsplit_throughput_bench_reads_each_builds_path() -> None:
    """bench/throughput_gpu.py counts, from the compile reports' lines, how each
    candidate's ``cuda.cu`` was built: every note kf's report line can carry maps back to
    its ``cuda_prelude``."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parent.parent / "bench" / "throughput_gpu.py"
    spec = importlib.util.spec_from_file_location("kf_bench_throughput_gpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(path.parent))
    for prelude, note in inline._PRELUDE_NOTES.items():
        line = f"kf.cuda.inline: m 0123456789ab built in 1.20s{note}"
        assert [bench.prelude_of(n) for n in bench._BUILT_NOTE.findall(line)] == [prelude]
    assert bench.prelude_of("") == "torch"
