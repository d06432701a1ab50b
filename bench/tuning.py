"""Does tuning per shape pay? The fusion examples, tuned by kf, re-measured independently.

1. ``kf run`` on the three fusion tasks of examples/tasks (their seeds, the offline
   mutator, ``--budget B``, ``--tune-budget T``); each task defines
   ``get_tuning_inputs()`` with two batch sizes besides its own.
2. From the log: the kernel kf tuned (the task's best once its budget was spent: "the
   untuned elite") and, per shape set, the configuration the tuner found best there.
3. For every shape set other than the task's own whose tuned configuration differs from
   the elite's, both are timed ``--rounds`` times, alternately, each time in a fresh
   sandboxed session of :func:`kf.evaluation.profile_candidate` (kf's own timing: warm-up,
   many trials, mean and 95% interval), bound to that shape set.

Noise: each round times the two configurations back to back, so a round gives one paired
ratio (tuned / untuned session means). The ratio reported is the geometric mean over the
rounds with its 95% interval (Student's t on the log-ratios); the noise is the larger of
that interval's half-width and kf's own within-session 95% interval (each
configuration's mean relative interval over its sessions, the two combined). "beats"
means the tuned configuration is faster by more than that noise. The spread of each
configuration's session means is shown too (a busy machine shows up there). Prints a Markdown table.

    .venv/bin/python bench/tuning.py                       # run, then measure
    .venv/bin/python bench/tuning.py --db runs/bench-tuning.db --measure-only
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FUSION = ("gelu_bias", "linear_bias_relu", "rmsnorm_silu")
T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def run_search(db: Path, budget: int, tune_budget: int, seed: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        tasks = Path(tmp) / "tasks"
        (tasks / "seeds").mkdir(parents=True)
        for name in FUSION:
            shutil.copy(ROOT / "examples/tasks" / f"{name}.py", tasks / f"{name}.py")
            shutil.copy(
                ROOT / "examples/tasks/seeds" / f"{name}.py", tasks / "seeds" / f"{name}.py"
            )
        db.parent.mkdir(parents=True, exist_ok=True)
        db.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "kf.app.cli", "run", str(tasks), "--budget", str(budget)]
        cmd += ["--tune-budget", str(tune_budget), "--seed", str(seed), "--db", str(db)]
        env = dict(os.environ, KF_LOG_LEVEL="WARNING")
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"kf run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return time.monotonic() - t0


def from_log(db: Path) -> dict[str, Any]:
    """Per task: the first tuned elite's (the best's) source and config, and the tuner's
    result per shape set."""
    from kf.events import decode_event
    from kf.log import EventLog

    out: dict[str, Any] = {}
    with EventLog(db, readonly=True) as elog:
        sources = {}
        for env in elog.read(types=["kernel.candidate_proposed"]):
            ev = decode_event(env)
            sources[ev.candidate_id] = ev.source  # type: ignore[attr-defined]
        for env in elog.read(types=["tuning.config_tuned"]):
            ev = decode_event(env)
            t = out.setdefault(ev.task, {"elite": ev.candidate_id, "shapes": []})  # type: ignore[attr-defined]
            if ev.candidate_id != t["elite"]:  # type: ignore[attr-defined]
                continue  # search version 4 tunes other elites next: the best is the first
            t["source"] = sources[ev.candidate_id]  # type: ignore[attr-defined]
            t["shapes"].append(ev)
    return out


def measure(task: Any, source: str, rounds: int, configs: list[dict[str, Any]]) -> list[Any]:
    from kf.evaluation import profile_candidate
    from kf.kernels import params

    sessions: list[list[Any]] = [[] for _ in configs]
    for _ in range(rounds):
        for i, cfg in enumerate(configs):
            r = profile_candidate(task, params.apply(source, cfg), compile_baseline=False)
            if not r.ok:
                sys.exit(f"{task.name}: {cfg} failed: {r.error}")
            sessions[i].append(r)
    return sessions


def summary(reports: list[Any]) -> tuple[float, float, float]:
    """Mean of the session means, their relative spread, the mean relative 95% CI."""
    means = [r.runtime_ms for r in reports]
    mean = statistics.fmean(means)
    sd = statistics.stdev(means) / mean if len(means) > 1 else 0.0
    ci = statistics.fmean(r.runtime_ci95_ms / r.runtime_ms for r in reports)
    return mean, sd, ci


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", type=Path, default=ROOT / "runs" / "bench-tuning.db")
    ap.add_argument("--budget", type=int, default=6)
    ap.add_argument("--tune-budget", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--measure-only", action="store_true", help="use an existing --db")
    args = ap.parse_args()
    os.environ.setdefault("KF_COMPILE_BASELINE", "0")  # eager-only sessions: shorter
    os.environ.setdefault("KF_LOG_LEVEL", "WARNING")
    wall = (
        None if args.measure_only else run_search(args.db, args.budget, args.tune_budget, args.seed)
    )

    from kf.kernels.tasks import load_task
    from kf.logs import configure

    configure("WARNING")
    from kf.kernels.tuning import bind_shape

    found = from_log(args.db)
    took = f"kf run {wall / 60:.1f} min; " if wall is not None else ""
    print(
        f"kf tuning benchmark: kf run <the 3 fusion tasks> --budget {args.budget} "
        f"--tune-budget {args.tune_budget} --seed {args.seed}; {os.cpu_count()} CPUs; {took}"
        f"{args.rounds} alternating rounds per configuration, each a fresh kf profiling session\n"
    )
    print(
        "| task | shape (set) | untuned elite ms ± spread | tuned ms ± spread "
        "| tuned / untuned (paired) | noise | beats? "
        "| tuned configuration (what changed) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    beaten: set[str] = set()
    for name in FUSION:
        t = found.get(name)
        if t is None:
            print(f"| {name} | — | not tuned | | | | | |")
            continue
        base_task = load_task(ROOT / "examples/tasks" / f"{name}.py")
        for ev in t["shapes"]:
            own = dict(ev.baseline_config)
            best = dict(ev.best_config) if ev.best_config else own
            changed = {k: v for k, v in best.items() if own.get(k) != v}
            where = f"{ev.shape} ({ev.shape_index}{', own' if ev.shape_index == 0 else ''})"
            if ev.shape_index == 0:  # the task's own shape: a tuned candidate ranked there
                continue
            if not changed:
                print(f"| {name} | {where} | | | | | — | the elite's own (tuner: {ev.note[:60]}) |")
                continue
            task = bind_shape(base_task, ev.shape_index)
            u, x = measure(task, t["source"], args.rounds, [own, best])
            um, usd, uci = summary(u)
            xm, xsd, xci = summary(x)
            logs = [math.log(b.runtime_ms / a.runtime_ms) for a, b in zip(u, x, strict=True)]
            ratio = math.exp(statistics.fmean(logs))
            half = T975.get(len(logs) - 1, 2.0) * statistics.stdev(logs) / math.sqrt(len(logs))
            paired = math.exp(half) - 1  # relative half-width of the ratio's 95% interval
            noise = max(paired, math.hypot(uci, xci))
            margin = 1 - ratio
            wins = margin > noise
            if wins and ev.shape_index > 0:
                beaten.add(name)
            print(
                f"| {name} | {where} | {um:.4f} ± {usd * 100:.1f}% | {xm:.4f} ± {xsd * 100:.1f}% "
                f"| {ratio:.3f} ({-margin * 100:+.1f}% ± {paired * 100:.1f}%) "
                f"| {noise * 100:.1f}% (kf: {math.hypot(uci, xci) * 100:.1f}%) "
                f"| {'yes' if wins else 'no'} | {changed} |"
            )
    print(
        f"\nfusion tasks where a tuned configuration beats the untuned elite beyond the noise "
        f"at a shape other than the task's own: {len(beaten)} of {len(FUSION)} "
        f"({', '.join(sorted(beaten)) or 'none'})"
    )
    print(f"log: {args.db} (kf replay {args.db} --check; kf report {args.db})")


if __name__ == "__main__":
    main()
