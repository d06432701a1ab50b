"""The search benchmark (issue 3): `kf run examples/tasks --budget 60` on this machine.

Run: .venv/bin/python bench/search.py [--budget 60] [--seed 0] [--db runs/bench-search.db]

It runs the real thing — embedded NATS, archivist, archive, offline mutator, a CPU worker
(compiler, verifier, profiler in sandboxed runner processes) — over every example task,
then folds the log and prints, per task: PyTorch eager ms, best kernel ms, speedup,
correct/total candidates, and whether the fusion tasks reached 1.5×.

How each figure is measured (kf's own protocol, see docs/verification.md): a candidate
counts only after 5 seeded trials match the reference (atol = rtol = 1e-4) and it passes
the generalisation gate on unseen shapes; then candidate and eager are timed alternately
in separate processes of one session (warm-up, ≥ 20 trials, ≥ 0.5 s), and the speedup is
eager mean / candidate mean. A challenger within noise of the incumbent is re-timed side
by side before it replaces it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FUSION = ("gelu_bias", "linear_bias_relu", "rmsnorm_silu")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--db", type=Path, default=ROOT / "runs" / "bench-search.db")
    ap.add_argument("--tasks", type=Path, default=ROOT / "examples" / "tasks")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="print the table for an existing --db instead of running",
    )
    args = ap.parse_args()
    if args.report_only:
        sys.path.insert(0, str(ROOT))
        from kf.app.report import build_report

        return table(build_report(args.db), args, wall=None)
    if args.db.exists():
        raise SystemExit(f"{args.db} exists; remove it or pass --db (an existing log is resumed)")
    t0 = time.monotonic()
    env = dict(os.environ, KF_LOG_LEVEL=os.environ.get("KF_LOG_LEVEL", "WARNING"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kf.app.cli",
            "run",
            str(args.tasks),
            "--budget",
            str(args.budget),
            "--seed",
            str(args.seed),
            "--db",
            str(args.db),
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    return table(json.loads(proc.stdout), args, wall)


def table(report: dict, args: argparse.Namespace, wall: float | None) -> int:
    took = f"wall {wall / 60:.1f} min" if wall is not None else f"(from {args.db})"
    print(
        f"kf search benchmark: kf run {args.tasks.relative_to(ROOT)} --budget {args.budget} "
        f"--seed {args.seed}; {os.cpu_count()} CPUs; {took}; "
        f"{report['events']} events; mutator: {report['mutator']}"
    )
    print(
        "speedup = eager mean / best kernel mean, same session, separate sandboxed processes;"
        " correct = verified on 5 seeded trials and unseen shapes\n"
    )
    print(
        "| task | eager ms | best ms | eager/best | recorded speedup | correct/total "
        "| fusion ≥ 1.5× |"
    )
    print("|---|---|---|---|---|---|---|")
    ok = True
    for t in report["tasks"]:
        fusion = t["task"] in FUSION
        ref, best = t["ref_ms"] or 0.0, t["best_ms"] or 0.0
        direct = ref / best if best else 0.0  # means from the best kernel's own session
        reached = direct >= 1.5
        ok &= reached or not fusion
        mark = ("yes" if reached else "NO") if fusion else "—"
        print(
            f"| {t['task']} | {ref:.3f} | {best:.3f} | {direct:.2f}× | "
            f"{t['best_speedup'] or 0:.2f}× | {t['correct']}/{t['candidates']} | {mark} |"
        )
    print(
        "\neager/best: the two means from the best kernel's own profiling session (the figure"
        " the fusion check uses);\nrecorded speedup: what the log holds for it (a paired"
        " re-time against the previous best may have changed it)."
    )
    fp = ", ".join(f"{k} = {v:.2f}" for k, v in report["fast_p"].items())
    gm = report["geomean_speedup"]
    print(
        f"\n{fp}; geomean speedup {gm:.2f}×; archive cells filled "
        f"{report['archive']['filled_cells']} of {report['archive']['total_cells']}"
    )
    print(f"log: {args.db} (kf replay {args.db} --check)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
