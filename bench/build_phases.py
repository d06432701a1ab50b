"""One `load_inline` build at a time, alone: how long each layout and option takes.

Builds bench/throughput_gpu.py's candidate modules for one task through kf's own
content-addressed ``load_inline`` (unboxed, in a child process, ``verbose=True``), each
into a fresh cache (``KF_CACHE_DIR``) unless told to share one, and prints per build its
wall seconds, the CPU seconds of the child and everything it started (nvcc, g++, ninja:
the honest figure on a shared machine), how its ``cuda.cu`` was built (``cuda_prelude``:
``none`` without PyTorch's ``#include <torch/types.h>``, kf.cuda.torchfree; ``split``
kernels so and the host code in ``main.cpp``, kf.cuda.torchsplit; ``torch`` with it) and
the object cache's verdict lines (which compile took how long, and whether
it had the precompiled header). Runs in order:

1. ``split`` layout, fresh cache: makes the precompiled header on the way;
2. ``split``, another variant, same cache: uses it;
3. ``split``, another variant, same cache, ``KF_TORCHFREE=0`` (``cuda.cu`` PyTorch's way);
4. ``split`` with ``KF_PCH=0``;
5. ``torch`` layout (kernel and wrapper in the ``.cu`` under ``torch/extension.h``), same
   cache: kf splits it (kf.cuda.torchsplit: the kernels without torch, the wrapper in
   ``main.cpp`` with the header);
6. ``torch`` layout, another variant, same cache, ``KF_TORCHFREE=0``: PyTorch's way, the
   whole ``.cu`` under ``torch/extension.h`` (what every such answer cost before).

    python bench/build_phases.py --out OUT

Without a GPU (a CPU-only PyTorch, nvcc installed) the child is told where the CUDA
toolkit is (``--cuda-home``, default ``$CUDA_HOME`` or ``/usr/local/cuda``), compiles for
``TORCH_CUDA_ARCH_LIST`` (default ``9.0a``, the H200's), links against empty stand-ins
of ``libc10_cuda``/``libtorch_cuda`` and imports lazily: the compile and link are
measured, nothing is run. That PyTorch lacks a header ``c10/cuda/CUDAStream.h`` needs, so
there the wrapper passes the default stream instead of PyTorch's current one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, os, sys, time
import torch.utils.cpp_extension as ext
if ext.CUDA_HOME is None and os.environ.get("KF_BENCH_CUDA_HOME"):  # a CPU-only PyTorch
    ext.CUDA_HOME = os.environ["KF_BENCH_CUDA_HOME"]
    sys.setdlopenflags(os.RTLD_LAZY)  # CUDA-side symbols of the stand-in libraries
from kf.cuda import inline
inline.install()
sys.path.insert(0, sys.argv[2])
import throughput_gpu
source = throughput_gpu.module(sys.argv[3], int(sys.argv[4]), sys.argv[5])
if os.environ.get("KF_BENCH_CUDA_HOME"):  # a CPU-only PyTorch lacks c10/cuda's made header
    source = source.replace("#include <c10/cuda/CUDAStream.h>", "#include <cuda_runtime.h>")
    source = source.replace("c10::cuda::getCurrentCUDAStream()", "(cudaStream_t) nullptr")
start = time.perf_counter()
exec(compile(source.replace("verbose=False", "verbose=True"), "candidate", "exec"), {})
print("KF_BUILD_SECONDS", time.perf_counter() - start)
print("KF_BUILD_RECORD", json.dumps(dict(inline.builds()[-1])))
"""


def build(cache: Path, task: str, variant: int, layout: str, env: dict[str, str]) -> dict:
    """Build one module in a fresh interpreter; its seconds, CPU seconds and verdicts."""
    log = cache.parent / f"verdicts-{variant}.log"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT), str(ROOT / "bench"), task, str(variant), layout],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            **env,
            "KF_CACHE_DIR": str(cache),
            "KF_CUDA_REPORT": "1",
            "KF_OBJCACHE_LOG": str(log),
        },
        cwd=ROOT,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    text = proc.stdout + proc.stderr
    seconds = re.findall(r"KF_BUILD_SECONDS ([0-9.]+)", text)
    record = re.findall(r"KF_BUILD_RECORD (.*)", text)
    return {
        "layout": layout,
        "variant": variant,
        "env": env,
        "exit": proc.returncode,
        "build_s": float(seconds[0]) if seconds else None,
        "process_s": round(time.perf_counter() - start, 2),
        "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 2),
        "cuda_prelude": json.loads(record[0]).get("cuda_prelude") if record else None,
        "verdicts": log.read_text().splitlines() if log.exists() else [],
        "tail": text[-1500:] if proc.returncode else "",
        "errors": [line for line in text.splitlines() if "error" in line][:8],
    }


def _cpu_only(out: Path, cuda_home: str) -> dict[str, str]:
    """What the child needs to build CUDA sources with a CPU-only PyTorch: the toolkit's
    folder, an architecture, and empty stand-ins of PyTorch's CUDA libraries to link."""
    stubs = out / "stand-ins"
    stubs.mkdir(exist_ok=True)
    cxx = shutil.which("g++") or "c++"
    for name in ("c10_cuda", "torch_cuda"):
        subprocess.run(
            [cxx, "-shared", "-fPIC", "-x", "c++", "/dev/null", "-o", str(stubs / f"lib{name}.so")],
            check=True,
        )
    libs = os.pathsep.join([str(stubs), os.path.join(cuda_home, "lib64")])
    return {
        "KF_BENCH_CUDA_HOME": cuda_home,
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0a"),
        "LIBRARY_PATH": libs,
        "LD_LIBRARY_PATH": os.pathsep.join([libs, os.environ.get("LD_LIBRARY_PATH", "")]),
        "PATH": os.pathsep.join([os.path.join(cuda_home, "bin"), os.environ["PATH"]]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--task", default="19_ReLU")
    ap.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    base = _cpu_only(args.out.resolve(), args.cuda_home) if torch.version.cuda is None else {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shared = Path(tmp) / "shared"
        plan = [
            (shared, 0, "split", {}),
            (shared, 1, "split", {}),
            (shared, 2, "split", {"KF_TORCHFREE": "0"}),
            (Path(tmp) / "nopch", 3, "split", {"KF_PCH": "0"}),
            (shared, 4, "torch", {}),
            (shared, 5, "torch", {"KF_TORCHFREE": "0"}),
        ]
        for cache, variant, layout, env in plan:
            row = build(cache, args.task, variant, layout, {**base, **env})
            row["env"] = env
            rows.append(row)
            print(json.dumps(row, indent=1), flush=True)
    (args.out / "build_phases.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
