"""Where a GPU candidate's verification and profiling time goes, request by request.

A diagnostic for the pipeline benchmark (``bench/gpu_pipeline.py``): it builds a few of
the same KernelBench-style ``load_inline`` candidates, then verifies and profiles each
one, first on an idle host and then while other candidates build beside it (as in
kf's pipeline, where up to all-cores-but-one builds run at once). For every stage it
adds up kf's request log (``kf.evaluation.grader.sandbox.REQUESTS``): per runner request, the
grader's wall time around it and the handler's own time inside the runner, so
start-up waits, CUDA set-up, candidate loading, trials and comparisons are told apart
from transport and scheduling.

    python bench/gpu_stage_phases.py --out results/ [--candidates 4] [--load 12]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def phases(since: float, until: float) -> dict[str, dict[str, float]]:
    """The request log between two ``time.monotonic`` instants, summed per op."""
    from kf.evaluation.grader.sandbox import REQUESTS

    out: dict[str, dict[str, float]] = defaultdict(lambda: {"n": 0, "wall_s": 0.0, "runner_s": 0.0})
    for r in list(REQUESTS):
        if since <= r.ended <= until:
            row = out[r.op]
            row["n"] += 1
            row["wall_s"] += r.wall_s
            row["runner_s"] += r.runner_s
    return {k: {m: round(v, 4) for m, v in row.items()} for k, row in sorted(out.items())}


def staged(name: str, fn: Any, *args: Any, **kw: Any) -> dict[str, Any]:
    """Run one stage; its duration, verdict and request phases."""
    from kf.evaluation.grader.sandbox import REQUESTS

    t0 = time.monotonic()
    report = fn(*args, **kw)
    t1 = time.monotonic()
    ok = getattr(report, "correct", getattr(report, "ok", None))
    spent = phases(t0, t1)
    row: dict[str, Any] = {
        "stage": name,
        "seconds": round(t1 - t0, 3),
        "ok": ok,
        "failure": getattr(report, "failure_kind", None),
        "phases": spent,
    }
    print(f"  {name}: {row['seconds']:.2f} s ok={ok} {row['failure'] or ''}", flush=True)
    runs = [r.detail for r in REQUESTS if r.op == "run" and t0 <= r.ended <= t1 and r.detail]
    if runs:
        row["runs"] = [{k: round(v, 4) for k, v in d.items()} for d in runs]
        print(f"      run phases: {row['runs']}", flush=True)
    for op, p in spent.items():
        print(
            f"      {op:>14}: n={p['n']:<3g} wall {p['wall_s']:7.3f} s  in runner "
            f"{p['runner_s']:7.3f} s",
            flush=True,
        )
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--candidates", type=int, default=4, help="candidates verified and profiled")
    p.add_argument("--load", type=int, default=12, help="builds running beside the loaded pass")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--cache", type=Path, help="build cache to use (default: a fresh, cold one)")
    p.add_argument(
        "--no-warm", action="store_true", help="runners skip start-up warm-up (KF_RUNNER_WARM)"
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kf-phases-"))
    # runners inherit it: a cold cache unless --cache names a used one
    os.environ["KF_CACHE_DIR"] = str(args.cache or work / "kf-cache")
    os.environ.setdefault("KF_NCU", "0")

    from gpu_pipeline import task_file, variants

    from kf.evaluation import compile_candidate, profile_candidate, verify_candidate
    from kf.evaluation.grader.sandbox import RunnerPool
    from kf.kernels.tasks import load_task

    n, load = args.candidates, args.load
    sources = variants(n + load)
    task = load_task(task_file(work, args.batch))
    pool = RunnerPool(size=min(n + load, 24) + 4, warm=None if args.no_warm else args.device)
    pool.start()
    result: dict[str, Any] = {
        "candidates": n,
        "load": load,
        "batch": args.batch,
        "warm": pool.warm,
    }

    print(f"== building {n} candidates at once (cold cache)", flush=True)
    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as ex:
        built = list(
            ex.map(
                lambda s: compile_candidate(task, s, device=args.device, pool=pool, timeout_s=600),
                sources[:n],
            )
        )
    result["build"] = {
        "wall_s": round(time.monotonic() - t0, 2),
        "each_s": [round(b.duration_s, 2) for b in built],
        "ok": [b.ok for b in built],
    }
    print(f"  {result['build']}", flush=True)

    def evaluate(label: str) -> list[dict[str, Any]]:
        rows = []
        for i, src in enumerate(sources[:n]):
            for name, fn in (("verify", verify_candidate), ("profile", profile_candidate)):
                row = staged(
                    f"{label} {name} {i}", fn, task, src, device=args.device, pool=pool, seed=0
                )
                rows.append(row)
        return rows

    print("== idle host: verify, then profile, each candidate", flush=True)
    result["idle"] = evaluate("idle")

    print(f"== loaded host: {load} other candidates building meanwhile", flush=True)
    done = threading.Event()
    loaded: list[float] = []

    def builds() -> None:
        t = time.monotonic()
        with ThreadPoolExecutor(max(1, load)) as ex:
            list(
                ex.map(
                    lambda s: compile_candidate(
                        task, s, device=args.device, pool=pool, timeout_s=600
                    ),
                    sources[n : n + load],
                )
            )
        loaded.append(time.monotonic() - t)
        done.set()

    if load:
        threading.Thread(target=builds, daemon=True).start()
        time.sleep(5.0)  # let the compilers get going
    result["loaded"] = evaluate("loaded")
    result["loaded_builds_still_running_at_end"] = load > 0 and not done.is_set()
    if load:
        done.wait(600)
    result["load_builds_wall_s"] = loaded[0] if loaded else None
    pool.close()
    for key in ("idle", "loaded"):
        for stage in ("verify", "profile"):
            secs = [r["seconds"] for r in result[key] if f" {stage} " in r["stage"]]
            if secs:
                result[f"{key}_{stage}_mean_s"] = round(sum(secs) / len(secs), 3)
    print(
        json.dumps({k: v for k, v in result.items() if k.endswith("_mean_s")}, indent=1),
        flush=True,
    )
    (args.out / "gpu_stage_phases.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
