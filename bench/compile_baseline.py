"""What the torch.compile baseline costs: ``kf eval``-style evaluations with it off, with
a cold inductor cache, with a warm one, and a second candidate in the same process.

Each arm is a fresh Python process (like ``kf eval``) evaluating ``TASK`` with
``CANDIDATE`` (compile, verify, profile); the last arm evaluates it twice in one process,
so the second profile finds the compiled reference in its reference runner. Prints one
JSON object: per arm the wall time, the profile's duration and compile time.

    python bench/compile_baseline.py [TASK CANDIDATE] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE = """
import json, sys, time
from kf.evaluation import evaluate
from kf.kernels.tasks import load_task
task, source = load_task(sys.argv[1]), open(sys.argv[2]).read()
out = []
for _ in range(int(sys.argv[4])):
    t0 = time.perf_counter()
    r = evaluate(task, source, device=sys.argv[3])
    p = r.profile
    out.append({"wall_s": time.perf_counter() - t0, "profile_s": p.duration_s if p else None,
                "compile_baseline_s": p.compile_baseline_s if p else None,
                "cached": p.compile_baseline_cached if p else None,
                "error": p.compile_baseline_error if p else r.error,
                "speedup": p.speedup if p else None,
                "speedup_vs_compiled": p.speedup_vs_compiled if p else None})
print(json.dumps(out))
"""


def arm(task: str, cand: str, device: str, env: dict[str, str], times: int = 1) -> list[dict]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", ONE, task, cand, device, str(times)],
        capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, check=True,
    )  # fmt: skip
    runs: list[dict] = json.loads(proc.stdout.strip().splitlines()[-1])
    runs[0]["process_s"] = time.perf_counter() - t0
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task", nargs="?", default=str(ROOT / "tests/fixtures/eval/task_gelu.py"))
    ap.add_argument("candidate", nargs="?", default=str(ROOT / "tests/fixtures/eval/honest.py"))
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="kf-bench-cache-"))
    try:
        env = {"KF_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
        arm(args.task, args.candidate, args.device, {**env, "KF_COMPILE_BASELINE": "0"})  # builds
        result = {
            "off": arm(args.task, args.candidate, args.device, {**env, "KF_COMPILE_BASELINE": "0"}),
            "cold": arm(
                args.task, args.candidate, args.device, {**env, "KF_COMPILE_BASELINE": "1"}
            ),
            "warm": arm(
                args.task, args.candidate, args.device, {**env, "KF_COMPILE_BASELINE": "1"}
            ),
            "twice": arm(
                args.task, args.candidate, args.device, {**env, "KF_COMPILE_BASELINE": "1"}, 2
            ),
        }
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
