"""What a boxed ``load_inline`` build costs the host besides its compiles, both ways.

A boxed runner's ``load_inline`` is built by the grader in a build box
(kf.evaluation.grader.builds.build_inline). Two ways to run that box:

- ``python``: a Python in the box imports torch and runs kf's ``load_inline`` (how kf
  built until the fifteenth session; now only for calls with ``use_pch=True``);
- ``writer``: the grader's trusted writer (kf.evaluation.grader.inline_writer), one
  process with torch imported once, writes PyTorch's ``main.cpp`` and ``build.ninja``, and
  the box runs only ninja.

For each way, into a fresh cache, ``--builds`` distinct extensions are built one after the
other, and the CPU-seconds of this process's descendants are sampled from ``/proc`` every
50 ms (bench/host_cpu.py: the compilers, the box's Python or the writer, the object cache's
launchers, bubblewrap). Two kinds of extension: ``plain`` (a Python C module, no torch
header: what is left is the build's overhead) and ``torch`` (a ``torch/extension.h``
binding, as KernelBench candidates have: its ``main.cpp`` is most of the build). The
writer's start (one torch import) is counted in the writer's first build.

    python bench/build_box_cost.py --builds 4 --kinds plain,torch --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from host_cpu import HostCpu

PLAIN = """
#include <Python.h>
#define KF_STR(x) KF_STR2(x)
#define KF_STR2(x) #x
#define KF_CAT(a, b) a##b
#define KF_INIT(name) KF_CAT(PyInit_, name)
static PyObject* f(PyObject* self, PyObject* arg) { return PyLong_FromLong(%(n)d); }
static PyMethodDef methods[] = {{"f", f, METH_O, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, KF_STR(TORCH_EXTENSION_NAME), NULL, -1, methods};
PyMODINIT_FUNC KF_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""

TORCH = "torch::Tensor scale(torch::Tensor x) { return x * %(n)d; }"


def arguments(kind: str, n: int) -> dict[str, Any]:
    if kind == "plain":
        return {
            "name": "kf_bench_plain",
            "cpp_sources": PLAIN % {"n": n},
            "no_implicit_headers": True,
            "with_cuda": False,
        }
    return {"name": "kf_bench_torch", "cpp_sources": TORCH % {"n": n}, "functions": ["scale"]}


def measure(way: str, kind: str, builds: int, root: Path) -> dict[str, Any]:
    from kf.evaluation.grader import builds as grader_builds
    from kf.evaluation.grader import inline_writer

    os.environ["KF_CACHE_DIR"] = str(root / f"{way}-{kind}")
    original = inline_writer.usable
    if way == "python":
        inline_writer.usable = lambda arguments: False  # type: ignore[assignment]
    env = {**grader_builds._own_toolchain(), "arch": None}
    walls = []
    own = os.times()
    try:
        with HostCpu(interval_s=0.05, root=os.getpid()) as cpu:
            for n in range(builds):
                start = time.perf_counter()
                result = grader_builds.build_inline(arguments(kind, n + 1), env, 600)
                walls.append(time.perf_counter() - start)
                if not result["ok"]:
                    raise SystemExit(f"{way}/{kind} build {n} failed: {result}")
    finally:
        inline_writer.usable = original  # type: ignore[assignment]
        inline_writer.writer().close()
    now = os.times()
    mine = (now.user - own.user) + (now.system - own.system)  # this process: the grader's part
    summary = cpu.summary()
    by_kind = summary["by_kind"]
    children = sum(by_kind.values()) - mine
    return {
        "way": way,
        "kind": kind,
        "builds": builds,
        "wall_s": [round(w, 2) for w in walls],
        "wall_median_s": round(statistics.median(walls), 2),
        "cpu_s_per_build": round(children / builds, 2),
        "grader_cpu_s": round(mine, 2),
        "by_kind": by_kind,
        "unseen_s": summary["unseen_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", type=int, default=4)
    parser.add_argument("--kinds", default="plain,torch")
    parser.add_argument("--ways", default="python,writer")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kf-build-cost-") as tmp:
        for kind in args.kinds.split(","):
            for way in args.ways.split(","):
                row = measure(way, kind, args.builds, Path(tmp))
                rows.append(row)
                print(json.dumps(row), flush=True)
    report = {
        "what": "boxed load_inline builds, one at a time; CPU-s of this process's descendants",
        "load_average_at_end": os.getloadavg(),
        "rows": rows,
    }
    (args.out / "build_box_cost.json").write_text(json.dumps(report, indent=1))
    print(f"{'kind':6} {'way':7} {'builds':>6} {'wall median s':>14} {'CPU-s/build':>12}")
    for r in rows:
        print(
            f"{r['kind']:6} {r['way']:7} {r['builds']:>6} {r['wall_median_s']:>14} "
            f"{r['cpu_s_per_build']:>12}"
        )


if __name__ == "__main__":
    main()
