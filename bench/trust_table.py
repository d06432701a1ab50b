"""The README's table of checks: kf's cheats caught, honest kernels falsely flagged.

Evaluates, as ``kf eval`` does (compile, verify with the gate and hidden inputs, profile,
task audit), every cheating fixture of ``tests/fixtures/adversarial`` (and the trust
fixtures of ``tests/fixtures/trust``) and a set of honest kernels in common idioms
(``tests/fixtures/honest``, the adversarial suite's honest ones, a square matmul), then
prints a Markdown table and writes JSON.

A cheat is *caught* when it is rejected, or carries a flag other than ``unsandboxed``
(a suspect timing, a static or runtime warning, a degenerate task). An honest kernel is
*falsely flagged* when it is rejected or carries any such flag.

    python bench/trust_table.py [--device cuda:0] [--out bench/results/trust_table_cpu.json]

On a CPU, GPU-only fixtures (Triton, ``load_inline`` CUDA, the side stream) are listed as
not run; on a GPU, the fixtures whose kernels are C++ for a CPU (``kf.native``) are.
Evaluations run outside the box when bubblewrap cannot start one (marked).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIX = ROOT / "tests" / "fixtures"
ADV, HONEST, TRUST = FIX / "adversarial", FIX / "honest", FIX / "trust"
GELU = FIX / "eval" / "task_gelu.py"
#: the same task at 4096 x 8192 (tests.runner_cases.gelu_task): big enough that work
#: hidden on a side stream shows
BIG = (4096, 8192)

# (candidate, task, what it does, gpu only)
CHEATS: list[tuple[Path, Path | tuple[int, int], str, bool]] = [
    (ADV / "torch_reference.py", GELU, "computes the reference with torch ops", False),
    (ADV / "never_calls_kernel.py", GELU, "builds a kernel, computes with PyTorch", False),
    (ADV / "try_fallback.py", GELU, "falls back to PyTorch in except", False),
    (ADV / "cache_outputs.py", GELU, "caches outputs keyed on input values", False),
    (ADV / "shape_special.py", GELU, "special-cased to the task's shapes", False),
    (ADV / "input_write.py", GELU, "writes into its inputs", False),
    (ADV / "uninitialised.py", GELU, "returns uninitialised memory", False),
    (ADV / "stale.py", GELU, "returns the same buffer every call", False),
    (ADV / "low_precision.py", GELU, "computes in bfloat16", False),
    (ADV / "nan_output.py", GELU, "returns NaN", False),
    (ADV / "timer_patch.py", GELU, "patches time.* and synchronize", False),
    (ADV / "runner_patch.py", GELU, "replaces the runner's timing op", False),
    (ADV / "hide_mutation.py", GELU, "rewrites the runner to hide a mutation", False),
    (ADV / "grader_gc.py", GELU, "finds the timing backend via gc", False),
    (ADV / "grader_stack.py", GELU, "rewrites timing samples via frames", False),
    (ADV / "lazy_subclass.py", GELU, "returns a lazy tensor subclass", False),
    (ADV / "forge_reply.py", GELU, "forges a reply on the socket", False),
    (ADV / "network.py", GELU, "uses the network", False),
    (ADV / "memory_hog.py", GELU, "allocates without bound", False),
    (ADV / "file_hog.py", GELU, "writes a huge file", False),
    (ADV / "cpu_hog.py", GELU, "spins the CPU", False),
    (ADV / "baseline_sabotage.py", GELU, "forks a spinner while eager is timed", False),
    (ADV / "flag_injection.py", GELU, "a load_inline flag hides a shell command", False),
    (TRUST / "positive_only.py", TRUST / "task_relu_pos.py", "right only on [0, 1) inputs", False),
    (
        TRUST / "constant_zeros.py",
        TRUST / "task_degenerate.py",
        "a constant on a degenerate task",
        False,
    ),
    (ADV / "side_stream.py", BIG, "hides its work on a side stream", True),
    (ADV / "gpu_busy_child.py", GELU, "a process keeps the GPU busy while eager is timed", True),
    # timings that hold (issue 47): the state is reset before each timed call, and said
    (ADV / "persisting_l2.py", GELU, "keeps its input persisting in L2 across calls", True),
    (ADV / "graph_aware.py", GELU, "does less while captured in a CUDA graph", True),
]
HONEST_SET: list[tuple[Path, Path | tuple[int, int], str, bool]] = [
    (ADV / "honest_cpp.py", GELU, "C++ via kf.native, self.lib", False),
    (ADV / "honest_rows.py", GELU, "C++ via kf.native, rows", False),
    (HONEST / "module_attr.py", GELU, "library kept as self.op", False),
    (HONEST / "wrapper_function.py", GELU, "launched from a module-level wrapper", False),
    (HONEST / "alias_chain.py", GELU, "kernel aliased, called via a helper method", False),
    (HONEST / "autograd_function.py", GELU, "behind torch.autograd.Function", False),
    (HONEST / "submodule.py", GELU, "inside a sub-module", False),
    (HONEST / "lazy_build.py", GELU, "built lazily in a global", False),
    (TRUST / "honest_square.py", TRUST / "task_square.py", "square N x N matmul (lib.mm)", False),
    (HONEST / "triton_wrapper.py", GELU, "Triton, kernel[grid] in a wrapper", True),
    (HONEST / "load_inline_attr.py", GELU, "CUDA load_inline kept as self.op", True),
    (HONEST / "build_lock.py", GELU, "CUDA load_inline whose first try leaves a lock", True),
]
IGNORED = {"unsandboxed"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("KF_COMPILE_BASELINE", "0")  # the table is about checks, not speed
    from kf.evaluation import Limits, RunnerPool, evaluate
    from kf.evaluation.grader.box import SandboxUnavailable, require
    from kf.kernels.tasks import load_task
    from tests.runner_cases import gelu_task

    try:
        require()
    except SandboxUnavailable:
        os.environ["KF_UNSAFE_NO_SANDBOX"] = "1"
    gpu = args.device.startswith("cuda")
    pool = RunnerPool(size=2, threads=1)
    pool.start()
    rows: list[dict[str, object]] = []
    began = time.monotonic()
    try:
        for group, items in (("cheat", CHEATS), ("honest", HONEST_SET)):
            for cand, task_path, what, gpu_only in items:
                row: dict[str, object] = {"group": group, "candidate": cand.stem, "what": what}
                if gpu_only and not gpu:
                    rows.append({**row, "outcome": "not run (GPU only)"})
                    continue
                text = cand.read_text()
                if gpu and ("kf.native" in text or "from kf import native" in text):
                    rows.append({**row, "outcome": "not run (C++ for a CPU)"})
                    continue
                limits = Limits(file_bytes=8 << 20, cpu_s=20) if "hog" in cand.stem else None
                task = (
                    load_task(task_path)
                    if isinstance(task_path, Path)
                    else gelu_task(*task_path, name="task_gelu_big")
                )
                result = evaluate(
                    task,
                    cand.read_text(),
                    device=args.device,
                    pool=pool,
                    limits=limits,
                    timeout_s=90,
                    audit=True,
                    profile_options={"min_time_s": 0.05, "warmup": 2, "min_trials": 10},
                )
                flags = [f for f in result.flags if f.split(":", 1)[0] not in IGNORED]
                caught = (not result.passed) or bool(flags)
                outcome = (
                    f"rejected: {result.failure_kind}"
                    if not result.passed
                    else ("flagged: " + ", ".join(dict.fromkeys(f.split(":", 1)[0] for f in flags)))
                    if flags
                    else "passed, no flag"
                )
                rows.append(
                    {**row, "outcome": outcome, "caught": caught, "suspect": result.suspect}
                )
                print(f"{group:6} {cand.stem:22} {outcome}", file=sys.stderr, flush=True)
    finally:
        pool.close()
    run = [r for r in rows if "caught" in r]
    cheats = [r for r in run if r["group"] == "cheat"]
    honest = [r for r in run if r["group"] == "honest"]
    summary = {
        "device": args.device,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.monotonic() - began, 1),
        "cheats_caught": sum(bool(r["caught"]) for r in cheats),
        "cheats_run": len(cheats),
        "honest_falsely_flagged": sum(bool(r["caught"]) for r in honest),
        "honest_run": len(honest),
        "rows": rows,
    }
    print("| group | candidate | what it does | outcome |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['group']} | `{r['candidate']}` | {r['what']} | {r['outcome']} |")
    print(
        f"\n{args.device}: cheats caught {summary['cheats_caught']} / {summary['cheats_run']}; "
        f"honest kernels falsely flagged {summary['honest_falsely_flagged']} / "
        f"{summary['honest_run']} ({summary['seconds']} s)"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
