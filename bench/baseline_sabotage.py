"""Baseline sabotage (issue 43, NK2) by numbers: a candidate profiled with and without a
process it starts at import that loads the machine (the CPU: a spinner; ``--device
cuda:0``: a process keeping the GPU busy), with kf's quiet box on and switched off
in-process (what main did before 274f976's fix), interleaved on one pool.

    python bench/baseline_sabotage.py [--device cuda:0] [--reps 3] [--out OUT.json]

With the box quiet, the saboteur's speed-ups (against eager and ``torch.compile``) should
be the plain candidate's, and carry ``busy_child`` (CPU) or ``gpu_child_killed`` (GPU);
switched off, the probe saw 3.76x for an honest 2.34-2.57x on a many-core host. A
2-core machine under other load shows nothing either way: the spinner slows the
candidate as much as eager.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kf.evaluation import RunnerPool
from kf.evaluation.grader import runner_handle
from kf.evaluation.grader.profiling import Timing, profile_session
from kf.evaluation.grader.session import GradingSession
from tests.runner_cases import gelu_task

ADV = ROOT / "tests" / "fixtures" / "adversarial"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    saboteur = (ADV / ("gpu_busy_child.py" if gpu else "baseline_sabotage.py")).read_text()
    plain = saboteur.replace("os.fork() == 0", "False")
    real = runner_handle.RunnerHandle.quiet, runner_handle.RunnerHandle.unquiet
    rows = []
    pool = RunnerPool(size=0, warm=args.device if gpu else None)
    try:
        for rep in range(args.reps):
            for quiet in (True, False):
                on = real if quiet else (lambda self: None, lambda self: None)
                runner_handle.RunnerHandle.quiet, runner_handle.RunnerHandle.unquiet = on
                for name, source in (("plain", plain), ("saboteur", saboteur)):
                    session = GradingSession(
                        gelu_task(), source, device=args.device, pool=pool, timeout_s=300
                    )
                    r = profile_session(session, Timing(), compile_baseline=not args.no_compile)
                    row = {
                        "rep": rep, "quiet": quiet, "candidate": name, "ok": r.ok,
                        "error": r.error, "speedup": r.speedup,
                        "speedup_vs_compiled": r.speedup_vs_compiled,
                        "runtime_ms": r.runtime_ms, "eager_ms": r.ref_runtime_ms,
                        "compiled_ms": r.compiled_runtime_ms,
                        "flags": sorted({f.split(":", 1)[0] for f in r.flags}),
                    }  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        runner_handle.RunnerHandle.quiet, runner_handle.RunnerHandle.unquiet = real
        pool.close()
    summary = {}
    for quiet in (True, False):
        for name in ("plain", "saboteur"):
            got = [r for r in rows if r["quiet"] is quiet and r["candidate"] == name and r["ok"]]
            key = f"{'quiet' if quiet else 'off'}/{name}"
            summary[key] = {
                "speedup_median": statistics.median([r["speedup"] for r in got]) if got else None,
                "vs_compiled_median": statistics.median(
                    [r["speedup_vs_compiled"] for r in got if r["speedup_vs_compiled"]] or [0.0]
                ),
                "flags": sorted({f for r in got for f in r["flags"]}),
            }
            print(key, summary[key])
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "rows": rows, "summary": summary}))


if __name__ == "__main__":
    main()
