"""The `cuda.cu` of a split-layout `load_inline` module compiled with and without the
`#include <torch/types.h>` PyTorch puts in front (kf.cuda.torchfree), nvcc alone.

Writes bench/throughput_gpu.py's split-layout `cuda_sources` as `load_inline` would
(PyTorch's three implicit lines, or kf's placeholder comment instead of the first) and
compiles each `--repeat` times with the flags PyTorch's ninja file gives it (as PyTorch
2.13 writes them: its include paths, its `COMMON_NVCC_FLAGS`, `--compiler-options
'-fPIC'`, the module's `-O3`, `-gencode` for `TORCH_CUDA_ARCH_LIST`, default `9.0a`).
Prints per compile its wall seconds and CPU seconds (user + system of nvcc and everything
it ran: the honest figure on a shared machine). No GPU needed.

    python bench/cu_prelude.py --out OUT [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _flags(cuda_home: str, arch: str) -> list[str]:
    import torch.utils.cpp_extension as ext

    number = arch.replace(".", "").replace("+PTX", "")
    out = ["-DTORCH_EXTENSION_NAME=kf_bench", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    for folder in [*ext.include_paths(), f"{cuda_home}/include", sysconfig.get_paths()["include"]]:
        out += ["-isystem", folder]
    out += [*ext.COMMON_NVCC_FLAGS, f"-gencode=arch=compute_{number},code=sm_{number}"]
    return [*out, "--compiler-options", "-fPIC", "-O3", "-std=c++20"]


def _sources(task: str) -> dict[str, str]:
    import throughput_gpu

    from kf.cuda import torchfree

    source = throughput_gpu.module(task, 0, "split")
    cuda = source.split('cuda_source = r"""', 1)[1].split('"""', 1)[0]
    rest = ["#include <cuda.h>", "#include <cuda_runtime.h>", cuda]
    return {
        "torch": "\n".join(["#include <torch/types.h>", *rest]),
        "none": "\n".join([torchfree.PLACEHOLDER, *rest]),
    }


def compile_once(nvcc: str, flags: list[str], source: Path) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [nvcc, *flags, "-c", str(source), "-o", str(source.with_suffix(".o"))], check=True
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--task", default="19_ReLU")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    nvcc = shutil.which("nvcc", path=f"{args.cuda_home}/bin") or "nvcc"
    flags = _flags(args.cuda_home, os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0a"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for prelude, text in _sources(args.task).items():
            source = Path(tmp) / prelude / "cuda.cu"
            source.parent.mkdir()
            source.write_text(text)
            for _ in range(args.repeat):
                row = {"cuda_prelude": prelude, **compile_once(nvcc, flags, source)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    (args.out / "cu_prelude.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
