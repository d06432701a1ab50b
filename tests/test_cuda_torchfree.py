"""kf.cuda.torchfree: ``load_inline``'s CUDA sources built without PyTorch's
``#include <torch/types.h>`` where they name nothing of torch, falling back to PyTorch's
own build when that fails.

The builds are real: kf's ``load_inline`` runs PyTorch's ninja build with nvcc and g++
for sm_90a (the H200's ``TORCH_CUDA_ARCH_LIST=9.0a``), once PyTorch's way
(``KF_TORCHFREE=0``) and once without the include, and the tests compare what came out:
the sources and flags PyTorch wrote, and the code, kernel by kernel (SASS, resources) and
host function by host function. No GPU is needed to compile; on a CPU-only PyTorch the
child process is told where the CUDA toolkit is (the CPU wheel refuses CUDA builds
otherwise) and links against empty stand-ins of ``libc10_cuda``/``libtorch_cuda``, so the
module imports without running anything. With a GPU, ``test_both_builds_compute_the_same``
also runs both and compares the outputs bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kf.cuda import inline, torchfree
from tests import cuda_elf

NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None
)
GXX = shutil.which("g++")
needs_toolchain = pytest.mark.skipif(NVCC is None or GXX is None, reason="needs nvcc and g++")

#: kernels in the split layout, with the unqualified math whose overloads torch's headers
#: could change (abs, sqrt, pow, max, min on floats, in device and host code)
KERNELS = r"""
#include <cuda_fp16.h>
#include <stdint.h>

__global__ void kf_math(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        float a = abs(v) + sqrt(fabs(v)) + exp(v) * 0.5f + pow(v, 2) + max(v, 0.0f);
        a += min(v, 1.0f) + tanh(v) + erf(v) + log1p(abs(v)) + floor(v) + round(v);
        y[i] = a + (v > 0.f ? v : 0.f);
    }
}

__global__ void kf_half(const __half* x, __half* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __hmul(__hadd(x[i], __float2half(1.0f)), __float2half(0.5f));
}

int kf_blocks(int64_t n, float scale) {
    return (int)ceil(abs(scale) * n / 256.0f);
}

void kf_launch(const float* x, float* y, const void* hx, void* hy, int64_t n,
               cudaStream_t stream) {
    int blocks = kf_blocks(n, -1.0f);
    kf_math<<<blocks, 256, 0, stream>>>(x, y, n);
    kf_half<<<blocks, 256, 0, stream>>>((const __half*)hx, (__half*)hy, n);
}
"""

WRAPPER = r"""
#include <cuda_runtime.h>
void kf_launch(const float* x, float* y, const void* hx, void* hy, int64_t n,
               cudaStream_t stream);
torch::Tensor kf_run(torch::Tensor x) {
    auto y = torch::empty_like(x);
    auto hx = x.to(torch::kHalf);
    auto hy = torch::empty_like(hx);
    kf_launch(x.data_ptr<float>(), y.data_ptr<float>(), hx.data_ptr(), hy.data_ptr(),
              x.numel(), nullptr);
    return torch::cat({y, hy.to(torch::kFloat)});
}
"""

#: needs a header only torch's includes bring (<vector>), and has an error of its own
BROKEN = r"""
static std::vector<int> kf_sizes;
__global__ void kf_math(float* y) { y[0] = kf_undeclared_value; }
"""

ARGS = {"name": "kf_tf", "cpp_sources": WRAPPER, "functions": ["kf_run"]}

#: run in a child: the CUDA_HOME patch and the stand-in libraries stay out of pytest. The
#: steps are forked off all at once after the imports (the builds are independent: their
#: keys differ, and the cache's locks make one compile of a shared ``main.cpp`` serve the
#: others), so a build that waits on one core leaves the other to the next step; each
#: step's output goes to a file of its own, given back in the plan's order.
_CHILD = r"""
import json, os, sys, traceback
import torch.utils.cpp_extension as ext
if ext.CUDA_HOME is None:  # a CPU-only wheel: it would refuse to build CUDA sources
    ext.CUDA_HOME = os.environ["KF_TEST_CUDA_HOME"]
from kf.cuda import inline
inline.install()
plan, folder = json.loads(sys.argv[1]), sys.argv[2]

def step(i, s):
    log = os.open(os.path.join(folder, f"{i}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ["KF_TORCHFREE"] = s["torchfree"]
    os.environ["MAX_JOBS"] = "1"  # one compile per step: the steps share the cores
    try:
        ext.load_inline(**s["args"])
        out = {"ok": True, "record": dict(inline.builds()[-1])}
    except Exception as exc:
        out = {"ok": False, "error": str(exc)}
    with open(os.path.join(folder, f"{i}.json"), "w") as result:
        json.dump(out, result)

sys.stdout.flush()
sys.stderr.flush()
children = []
for i, s in enumerate(plan):
    pid = os.fork()
    if pid == 0:
        try:
            step(i, s)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
out = []
for i in range(len(plan)):
    with open(os.path.join(folder, f"{i}.log")) as log:
        sys.stdout.write(log.read())
    path = os.path.join(folder, f"{i}.json")
    if not os.path.exists(path):
        sys.exit(f"step {i} gave no result")
    with open(path) as result:
        out.append(json.load(result))
print("KF_RESULT " + json.dumps(out))
"""


def _stand_ins(folder: Path) -> None:
    """Empty ``libc10_cuda.so`` and ``libtorch_cuda.so``, which a CPU-only PyTorch lacks
    and its CUDA link line names."""
    folder.mkdir()
    for name in ("c10_cuda", "torch_cuda"):
        made = subprocess.run(
            [str(GXX), "-shared", "-fPIC", "-x", "c++", "/dev/null", "-o", f"lib{name}.so"],
            cwd=folder,
            capture_output=True,
        )
        assert made.returncode == 0, made.stderr


def _cuda_home() -> str:
    """The CUDA toolkit's folder (nvcc on PATH may be a wrapper script elsewhere)."""
    assert NVCC is not None
    for home in (os.environ.get("CUDA_HOME"), Path(os.path.realpath(NVCC)).parent.parent):
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return str(home)
    return "/usr/local/cuda"


def build(root: Path, plan: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Run kf's ``load_inline`` for each step of ``plan`` in a child, all at once, in one
    cache: each step's outcome, and all the child printed (with ``KF_CUDA_REPORT``'s
    lines), step by step in the plan's order."""
    cuda_home = _cuda_home()
    stubs = root / "stubs"
    if torch.version.cuda is None:
        _stand_ins(stubs)
    libs = [str(stubs), os.path.join(cuda_home, "lib64")]
    env = {
        **os.environ,
        "KF_CACHE_DIR": str(root / "cache"),
        "KF_OBJCACHE_LOG": str(root / "objcache.log"),
        "KF_PCH": "0",  # the precompiled header is not what is tested here (45 s to make)
        "KF_CUDA_REPORT": "1",  # the report line a compile log keeps
        "KF_TEST_CUDA_HOME": cuda_home,
        "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0a"),
        "LIBRARY_PATH": os.pathsep.join(libs),
        "LD_LIBRARY_PATH": os.pathsep.join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]),
        "PATH": os.pathsep.join([os.path.join(cuda_home, "bin"), os.environ["PATH"]]),
    }
    steps = root / "steps"
    steps.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(plan), str(steps)],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    found = re.findall(r"^KF_RESULT (.*)$", proc.stdout, re.MULTILINE)
    assert proc.returncode == 0 and found, proc.stdout[-3000:] + proc.stderr[-5000:]
    results: list[dict[str, Any]] = json.loads(found[0])
    return results, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The split-layout module built PyTorch's way and without the include, and the broken
    sources, in one cache (``main.cpp`` is compiled once, then served by the object cache)."""
    if NVCC is None or GXX is None:
        pytest.skip("needs nvcc and g++")
    root = tmp_path_factory.mktemp("torchfree")
    plan = [
        {"torchfree": "0", "args": {**ARGS, "cuda_sources": KERNELS}},
        {"torchfree": "1", "args": {**ARGS, "cuda_sources": KERNELS}},
        {"torchfree": "1", "args": {**ARGS, "cuda_sources": BROKEN}},
    ]
    (standard, free, broken), output = build(root, plan)
    assert standard["ok"], standard
    assert free["ok"], free
    cuda_ext = root / "cache" / "cuda_ext"
    return {
        "standard": standard["record"],
        "free": free["record"],
        "broken": broken,
        "standard_dir": cuda_ext / standard["record"]["key"],
        "free_dir": cuda_ext / free["record"]["key"],
        "cuda_ext": cuda_ext,
        "output": output,
    }


# --- which sources take which path ----------------------------------------------------------


def test_sources_that_name_torch_take_pytorchs_path() -> None:
    """Anything that may need torch's headers is built PyTorch's way: its includes, its
    namespaces, its macros, and preprocessor tests of macros other than CUDA's own."""
    needs_torch = [
        "#include <torch/extension.h>\n__global__ void k() {}",
        '#  include "ATen/cuda/CUDAContext.h"\n',
        "#include <c10/cuda/CUDAStream.h>\n",
        "__global__ void k(float* y) { y[0] = at::native::x; }",
        "using namespace c10;\n__global__ void k() {}",
        'void f() { TORCH_CHECK(true, "x"); }',
        'void f() { AT_DISPATCH_FLOATING_TYPES(t, "x", [&] {}); }',
        "void f() { CHECK(1); }",
        "__global__ void k() { CUDA_KERNEL_ASSERT(1); }",
        "#ifndef M_PI\n#define M_PI 3.14159f\n#endif\n",
        "#if defined(USE_ROCM)\n#endif\n",
        "int n = 1'000; torch::Tensor t;",  # a digit separator is not a character literal
        "#define UNIQUE(x) x##__COUNTER__\n",
        'const char* s = R"(x)";',
    ]
    for source in needs_torch:
        assert torchfree.why_not(source) is not None, source
    free = [
        KERNELS,
        "// like torch.relu\n__global__ void k(const float* x) { /* at::relu */ }",
        'void f() { printf("at::x torch"); }',
        "#if __CUDA_ARCH__ >= 800\n#endif\n#if defined(__CUDACC__) && CUDART_VERSION\n#endif",
        ["#include <cuda_fp16.h>\n", "__global__ void k(__half* x) {}\n"],
    ]
    for source in free:
        assert torchfree.why_not(source) is None, source
    assert torchfree.why_not(None) == "no CUDA sources"


def test_the_switch_and_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that tries the path without the include has a key of its own: the cache
    never serves one for a request PyTorch's way, or the other way round. Sources that
    name torch, and every build with ``KF_TORCHFREE=0``, keep the key they had; the
    module name (``main.cpp``'s binding) is the same on either path."""
    env = {"torch": "2", "cuda": "13.0", "arch": "9.0a", "python": "3", "cxx": "c++"}
    free = inline.bound_arguments(**ARGS, cuda_sources=KERNELS)
    uses = inline.bound_arguments(**ARGS, cuda_sources="#include <torch/types.h>\n" + KERNELS)
    monkeypatch.setenv("KF_TORCHFREE", "1")
    pytorch = inline.pytorch_load_inline()
    assert torchfree.prelude_known(pytorch), "PyTorch's load_inline prelude is not the one kf knows"
    assert torchfree.wanted(free, pytorch) and not torchfree.wanted(uses, pytorch)
    assert not torchfree.wanted({**free, "no_implicit_headers": True}, pytorch)
    assert not torchfree.wanted({**free, "extra_include_paths": ["/x"]}, pytorch)
    on = (inline.cache_key(free, env), inline.cache_key(uses, env), inline.binding_key(free, env))
    monkeypatch.setenv("KF_TORCHFREE", "0")
    assert not torchfree.wanted(free, pytorch)
    off = (inline.cache_key(free, env), inline.cache_key(uses, env), inline.binding_key(free, env))
    assert on[0] != off[0]
    assert on[1:] == off[1:]


def test_the_variant_call_gives_back_pytorchs_implicit_lines() -> None:
    """What kf hands PyTorch instead: the same ``main.cpp`` lines and ``cuda.cu`` lines but
    the first."""
    call = torchfree.arguments({**ARGS, "cuda_sources": [KERNELS, "// more"]})
    assert call["no_implicit_headers"] is True
    assert call["cpp_sources"] == ["#include <torch/extension.h>", WRAPPER]
    assert call["cuda_sources"] == [
        torchfree.PLACEHOLDER,
        "#include <cuda.h>",
        "#include <cuda_runtime.h>",
        KERNELS,
        "// more",
    ]


@needs_toolchain
def test_the_lists_cover_what_torch_types_h_defines(tmp_path: Path) -> None:
    """Every macro the installed PyTorch's ``torch/types.h`` leaves defined from its own
    headers, and every namespace those headers open at the top level, is refused by the
    test: a source using one must not build differently without the include."""
    import torch.utils.cpp_extension as ext

    source = tmp_path / "prelude.cu"
    source.write_text("#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n")
    flags = ["-std=c++17", "-DTORCH_API_INCLUDE_EXTENSION_H", *ext.COMMON_NVCC_FLAGS]
    flags += [a for p in ext.include_paths() for a in ("-isystem", p)]
    proc = subprocess.run(
        [str(NVCC), *flags, "-E", "-Xcompiler", "-dD", str(source)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # what ``-dM`` would list: the ``#define``s and ``#undef``s, replayed in order
    still_defined: set[str] = set()
    for m in re.finditer(r"^#(define|undef) (\w+)", proc.stdout, re.MULTILINE):
        (still_defined.add if m.group(1) == "define" else still_defined.discard)(m.group(2))
    torch_macros, namespaces = _torch_names(proc.stdout)
    assert len(torch_macros) > 100 and {"at", "c10", "torch"} <= namespaces
    for name in sorted((torch_macros & still_defined) | namespaces):
        if name != "std":
            assert torchfree.why_not(f"int x = {name};") is not None, name


def _torch_names(text: str) -> tuple[set[str], set[str]]:
    """Macros defined in PyTorch's include folder, and namespaces it opens at depth 0,
    from ``-dD`` preprocessed output (line markers say which file each line is from)."""
    macros: set[str] = set()
    namespaces: set[str] = set()
    depth = 0
    in_torch = False
    for line in text.splitlines():
        marker = re.match(r'# \d+ "([^"]+)"', line)
        if marker:
            in_torch = "/torch/include/" in marker.group(1)
            continue
        if line.startswith("#"):
            if in_torch and (m := re.match(r"#define (\w+)", line)):
                macros.add(m.group(1))
            continue
        code = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'', '""', line)
        for token in re.finditer(r"\bnamespace\s+(\w+)(?:\s*::\s*\w+)*\s*\{|[{}]", code):
            if token.group(0) == "}":
                depth -= 1
                continue
            if token.group(1) and depth == 0 and in_torch:
                namespaces.add(token.group(1))
            depth += 1
    return macros, namespaces


# --- the builds ---------------------------------------------------------------------------


def test_each_build_records_its_path(builds: dict[str, Any]) -> None:
    """The build record (and the report line a compile log gets) says how ``cuda.cu`` was
    built; the two builds have their own keys and one module name."""
    standard, free = builds["standard"], builds["free"]
    assert standard["cuda_prelude"] == "torch" and not standard["cached"]
    assert free["cuda_prelude"] == "none" and not free["cached"]
    assert standard["key"] != free["key"]
    for record, folder in ((standard, "standard_dir"), (free, "free_dir")):
        meta = json.loads((builds[folder] / "kf-build.json").read_text())
        assert meta == {"cuda_prelude": record["cuda_prelude"]}
    names = {p.name for p in builds["standard_dir"].glob("*.so")}
    assert names == {p.name for p in builds["free_dir"].glob("*.so")} and len(names) == 1
    lines = [line for line in builds["output"].splitlines() if line.startswith("kf.cuda.inline")]
    assert len(lines) == 2, builds["output"][-3000:]
    assert re.fullmatch(r"kf\.cuda\.inline: kf_tf \w{12} built in [0-9.]+s", lines[0])
    assert lines[1].endswith("(cuda.cu without PyTorch's #include <torch/types.h>)")


def test_the_sources_and_flags_are_pytorchs(builds: dict[str, Any]) -> None:
    """``main.cpp`` is byte for byte PyTorch's, ``cuda.cu`` differs in its first line
    only (so line numbers stay), and the ninja file (every compile and link command) is
    the same but for the build folder's path and the object cache's launcher scripts
    (the attempt's send their verdicts to the file that holds them back: ``--log``)."""
    a, b = builds["standard_dir"], builds["free_dir"]
    assert (a / "main.cpp").read_bytes() == (b / "main.cpp").read_bytes()
    standard, free = (a / "cuda.cu").read_text(), (b / "cuda.cu").read_text()
    assert standard.splitlines()[0] == "#include <torch/types.h>"
    assert free.splitlines()[0] == torchfree.PLACEHOLDER
    assert standard.splitlines()[1:] == free.splitlines()[1:]
    launchers = re.compile(r"/bin/(c\+\+|nvcc)-[0-9a-f]{16}")
    ninja_a = launchers.sub(r"/bin/\1", (a / "build.ninja").read_text().replace(a.name, "<key>"))
    ninja_b = launchers.sub(r"/bin/\1", (b / "build.ninja").read_text().replace(b.name, "<key>"))
    work = re.compile(r"\.build-\d+")  # each build's work folder (its process id)
    assert work.sub("", ninja_a) == work.sub("", ninja_b)
    assert (a / "main.o").read_bytes() == (b / "main.o").read_bytes()


def test_the_kernels_compile_to_the_same_sass(builds: dict[str, Any]) -> None:
    """Kernel by kernel, the SASS, its relocations, parameter bank, attributes and
    resources are the same. (Without the include the module lacks some unused one-byte
    globals torch's headers declare, so the cubins differ as files.)"""
    a = cuda_elf.cubins((builds["standard_dir"] / "cuda.cuda.o").read_bytes())
    b = cuda_elf.cubins((builds["free_dir"] / "cuda.cuda.o").read_bytes())
    assert len(a) == len(b) == 1  # sm_90a only
    ka, kb = cuda_elf.kernels(a[0]), cuda_elf.kernels(b[0])
    assert {"_Z7kf_mathPKfPfl", "_Z7kf_halfPK6__halfPS_l"} <= set(ka)
    assert ka == kb


def test_the_host_code_is_the_same(builds: dict[str, Any]) -> None:
    """Every function of the variant's object is the same in PyTorch's (the launcher, the
    host math, the kernels' launch stubs), but the module registration, which also
    registers torch's unused globals."""
    a = cuda_elf.functions((builds["standard_dir"] / "cuda.cuda.o").read_bytes())
    b = cuda_elf.functions((builds["free_dir"] / "cuda.cuda.o").read_bytes())
    ours = {n for n in b if "kf_" in n}
    assert {"_Z9kf_launchPKfPfPKvPvlP11CUstream_st", "_Z9kf_blockslf"} <= ours
    differ = {n for n in b if a.get(n) != b[n]}
    assert not differ & ours
    assert all("Register" in n for n in differ), differ


def test_a_failed_variant_falls_back_with_pytorchs_errors(builds: dict[str, Any]) -> None:
    """Sources that do not compile without torch's headers are built PyTorch's way, and
    only that build's errors are reported: its own error, not the variant's missing
    ``std::vector``; the build folder left behind holds PyTorch's ``cuda.cu``."""
    broken = builds["broken"]
    assert not broken["ok"]
    assert "kf_undeclared_value" in broken["error"]
    assert "vector" not in broken["error"]
    assert "vector" not in builds["output"]  # nothing of the attempt was printed either
    left = [p for p in builds["cuda_ext"].glob("*.build-*") if "cuda.cu" in os.listdir(p)]
    assert left and all(
        (p / "cuda.cu").read_text().startswith("#include <torch/types.h>\n") for p in left
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_both_builds_compute_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: the module built PyTorch's way and the one built without the include,
    loaded side by side, give bit-identical outputs on the same inputs."""
    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KF_PCH", "0")  # not what is tested here
    inline.install()
    try:
        modules = []
        for switch in ("0", "1"):
            monkeypatch.setenv("KF_TORCHFREE", switch)
            modules.append(ext.load_inline(**ARGS, cuda_sources=KERNELS))
        paths = [record["cuda_prelude"] for record in inline.builds()[-2:]]
    finally:
        inline.uninstall()
    assert paths == ["torch", "none"]
    assert modules[0].__file__ != modules[1].__file__
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1 << 20, device="cuda", generator=generator) * 4
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    a, b = modules[0].kf_run(x), modules[1].kf_run(x)
    torch.cuda.synchronize()
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
