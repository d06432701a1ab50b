"""Do evaluations stay fed while a slow model answers? `kf run` on a seedless CPU task
against the scripted server (tests/llm_server.py; canned answers, not a model) that
answers every request after ``--delay`` seconds, at ``--llm-concurrency`` calls at once.

Prints kf run's own summary (model calls, their overlap, seconds the evaluators were idle
waiting for the model, each evaluator's busy fraction) for each concurrency given.

    python bench/llm_concurrency.py --delay 20 --concurrency 8 --concurrency 1 --budget 12
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.harness import seedless_scale_relu
from tests.llm_server import ScriptedServer
from tests.scripted_answers import cpp_module


class SlowResponder:
    """A correct C++ kernel for every request, each a different CHUNK/factor spelling."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.n = 0

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        self.n += 1
        src = cpp_module().replace('CONFIG = {"CHUNK": 64}', f'CONFIG = {{"CHUNK": {self.n}}}')
        src = src.replace('SPACE = {"CHUNK": [16, 64, 256]}', f'SPACE = {{"CHUNK": [{self.n}]}}')
        return {"content": f"```python\n{src}```", "delay": self.delay}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--delay", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, action="append", default=[])
    ap.add_argument("--budget", type=int, default=12)
    ap.add_argument("--max-in-flight", type=int, default=2)
    args = ap.parse_args()
    results = []
    for conc in args.concurrency or [8]:
        with (
            tempfile.TemporaryDirectory() as tmp,
            ScriptedServer(responder=SlowResponder(args.delay)) as server,
        ):
            db = Path(tmp) / "run.db"
            task = seedless_scale_relu(Path(tmp) / "tasks")
            cmd = [
                sys.executable, "-m", "kf.app.cli", "run", str(task), "--llm-url", server.url,
                "--model", "scripted", "--budget", str(args.budget), "--init", str(conc),
                "--llm-concurrency", str(conc), "--max-in-flight", str(args.max_in_flight),
                "--db", str(db), "--json",
            ]  # fmt: skip
            t0 = time.monotonic()
            proc = subprocess.run(
                cmd, check=False, capture_output=True, text=True, cwd=ROOT,
                env=dict(os.environ, KF_LOG_LEVEL="WARNING"),
            )  # fmt: skip
            wall = time.monotonic() - t0
            if proc.returncode != 0:
                print(proc.stderr[-3000:])
                return 1
            report = json.loads(proc.stdout)
            stats = report["run_stats"]
            (task,) = report["tasks"]
            print(
                f"--llm-concurrency {conc}, model delay {args.delay:g} s, budget {args.budget}: "
                f"{wall:.1f} s wall; {task['profiled']} profiled, {task['failed']} failed; "
                f"server saw up to {server.max_in_flight} requests waiting at once"
            )
            for line in stats_lines(stats):
                print("   ", line)
            results.append({"concurrency": conc, "wall_s": wall, "stats": stats})
    print(json.dumps(results, indent=2))
    return 0


def stats_lines(stats: dict[str, Any]) -> list[str]:
    from kf.app.run_stats import format_run_stats

    return format_run_stats(stats)


if __name__ == "__main__":
    sys.exit(main())
