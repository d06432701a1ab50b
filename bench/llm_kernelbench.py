"""`kf run` on KernelBench level-1 tasks with an LLM endpoint, on a GPU — the user's path.

What it does: copies the chosen task files from a KernelBench checkout (unchanged) into a
folder, starts the *scripted* OpenAI-compatible server (tests/llm_server.py with
tests/scripted_answers.GpuResponder: canned CUDA load_inline and Triton modules written by
kf's developers, not by a model), runs

    kf run FOLDER --device cuda:0 --llm-url <scripted> --model scripted --budget B --init I

and prints, from the run's log: the LLM requests per task and language, every candidate's
fate (compiled / failed with its cause / verified and profiled, with times and speed-ups
against eager and torch.compile where measured), the report table and the run stats.

    python bench/llm_kernelbench.py --kernelbench ../shared/kernelbench/level1 --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kf.app.report import build_report, format_table
from kf.events import decode_event
from kf.log import EventLog
from tests.llm_server import ScriptedServer
from tests.scripted_answers import GpuResponder

DEFAULT_TASKS = "19_ReLU,21_Sigmoid,23_Softmax"


def outcomes(db: Path) -> list[dict[str, object]]:
    """Every candidate with its last stage and result."""
    rows: dict[str, dict[str, object]] = {}
    with EventLog(db, readonly=True) as elog:
        for env in elog.read():
            t = env.type
            if not t.startswith(("kernel.", "search.candidate_")):
                continue
            ev = decode_event(env)
            cid = getattr(ev, "candidate_id", None)
            if cid is None:
                continue
            if t == "kernel.candidate_proposed":
                rows[cid] = {
                    "task": ev.task,
                    "candidate": cid[:12],
                    "operator": ev.operator,
                    "stage": "proposed",
                    "result": "",
                }
                continue
            row = rows.get(cid)
            if row is None:
                continue
            if t == "search.candidate_assigned":
                row["backend"] = ev.backend
                row["stage"] = "assigned"
            elif t == "search.candidate_unroutable":
                row["stage"], row["result"] = "failed", f"unroutable: {ev.reason}"
            elif t == "kernel.candidate_compiled":
                if ev.report.ok:
                    row["stage"] = "compiled"
                    row["compile_s"] = round(ev.report.duration_s, 1)
                else:
                    row["stage"] = "failed"
                    row["result"] = f"{ev.report.failure_kind}: {(ev.report.error or '')[:120]}"
            elif t == "kernel.candidate_verified":
                row["stage"] = "verified"
                row["max_abs_err"] = ev.report.max_abs_err
            elif t == "kernel.candidate_rejected":
                row["stage"] = "failed"
                row["result"] = f"{ev.report.failure_kind}: {(ev.report.error or '')[:120]}"
            elif t == "kernel.candidate_profiled":
                r = ev.report
                if r.ok:
                    row["stage"] = "profiled"
                    compiled = getattr(r, "compiled_runtime_ms", None)
                    row["result"] = (
                        f"{r.runtime_ms:.3f} ms vs eager {r.ref_runtime_ms:.3f} ms = "
                        f"{r.speedup:.2f}x"
                        + (
                            f"; torch.compile {compiled:.3f} ms = {compiled / r.runtime_ms:.2f}x"
                            if compiled
                            else ""
                        )
                    )
                else:
                    row["stage"] = "failed"
                    row["result"] = f"profile {r.failure_kind}: {(r.error or '')[:120]}"
    return list(rows.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernelbench", type=Path, default=ROOT.parent / "shared/kernelbench/level1")
    ap.add_argument("--tasks", default=DEFAULT_TASKS, help="comma list of task file stems")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--init", type=int, default=2)
    ap.add_argument("--max-in-flight", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=560.0, help="kf run's wall-clock limit")
    ap.add_argument("--stage-timeout", type=float, default=300.0)
    ap.add_argument(
        "--tune-budget", type=int, default=None, help="kf run's --tune-budget (default: kf's)"
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.out / "kernelbench_tasks"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for name in args.tasks.split(","):
        shutil.copyfile(args.kernelbench / f"{name}.py", folder / f"{name}.py")
    db = args.out / "kernelbench_llm.db"
    for p in db.parent.glob(db.name + "*"):
        p.unlink()
    responder = GpuResponder()
    t0 = time.monotonic()
    with ScriptedServer(responder=responder) as server:
        cmd = [
            sys.executable, "-m", "kf.app.cli", "run", str(folder), "--device", args.device,
            "--llm-url", server.url, "--model", "scripted", "--budget", str(args.budget),
            "--init", str(args.init), "--max-in-flight", str(args.max_in_flight),
            "--timeout", str(args.stage_timeout), "--db", str(db),
        ]  # fmt: skip
        if args.tune_budget is not None:
            cmd += ["--tune-budget", str(args.tune_budget)]
        print("$", " ".join(cmd), flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            proc = subprocess.run(
                cmd, check=False, cwd=ROOT, env=env, timeout=args.timeout, text=True
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.monotonic() - t0
    print(f"\nkf run exit {rc} after {wall:.1f} s")
    print("LLM requests per task and language:", json.dumps(responder.requests, sort_keys=True))
    rows = outcomes(db) if db.exists() else []
    print("\n| task | candidate | operator | backend | ended | result |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['task']} | {r['candidate']} | {r['operator']} | {r.get('backend', '')} | "
            f"{r['stage']} | {r['result']} |"
        )
    report = build_report(db) if db.exists() else {}
    if report:
        print()
        print(format_table(report))
    (args.out / "kernelbench_llm.json").write_text(
        json.dumps(
            {
                "exit": rc,
                "wall_s": wall,
                "requests": responder.requests,
                "candidates": rows,
                "report": report,
            },
            indent=2,
            default=str,
        )
    )
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
