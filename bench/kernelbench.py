"""A KernelBench folder through ``kf run``: the table per task (eager, torch.compile and
kf's best, the speed-ups against each and against the better of the two), peak device
memory and time per task, and KernelBench's scores per level.

    python bench/kernelbench.py PATH/level1 --tasks 1,19,23-26 [--device cuda:0] [--out DIR]
    python bench/kernelbench.py PATH/level2 --tasks 1-10 --llm-url URL --model NAME --budget 8
    python bench/kernelbench.py PATH/level1 --tasks 1-10 --device cuda:0 --wall 500 --resume

``--wall`` stops ``kf run`` after that many seconds (as Ctrl-C does: the log keeps what
was committed) and reports what the log holds; ``--resume`` continues the run of an
existing ``--out``, so a table longer than one sitting is made in several.

With ``--llm-url`` it runs ``kf run PATH --tasks … --llm-url …`` on the folder itself.
Without one there is no model to write kernels, so it checks the harness instead: each
task's own reference, rewritten as ``ModelNew`` (``class ModelNew(Model)``, nothing
else changed), is the one candidate (``--budget 1``) — it must come out correct and about
1.0× against eager on every task; anything else is a fault of kf's protocol, not of a
kernel. For that the task files are copied, unchanged, into a temporary ``levelN`` folder
(outside the repository, removed afterwards) beside a ``seeds/`` folder holding those
rewrites.

Candidates are evaluated one at a time (``--max-in-flight 1``), though every task's seeds
are compiled at the start. A task's time is its stages' work (compiles, verifications,
profiles; queueing left out). Peak device memory per task is ``peak_device_mb`` from the
task's stage reports where they carry one (on a GPU: the most its stage's runners held at
once, as they state it; docs/kernelbench.md); otherwise (older logs), on a GPU,
the largest device-wide ``memory.used`` that ``nvidia-smi`` showed (sampled every
``--sample-s``) during the task's span of device work (``kf.app.kernelbench.task_windows``):
that includes every runner's CUDA context and what the run's other runners still hold, so
it is not the task's own footprint (``bench/kernelbench_memory.py`` measures that). On a
CPU there is none. ``--table-only`` makes the table again from ``--out``'s log and the
samples its JSON kept, running nothing. Writes ``kernelbench.db`` (the log),
``kernelbench.json`` (rows, levels, memory samples) and ``kernelbench.csv`` (``kf report
--csv``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kf.app.kernelbench import format_levels, rows_to_csv, task_windows
from kf.app.report import build_report
from kf.app.task_select import SelectionError, select_loaded
from kf.kernels.task_folders import load_tasks_skipping
from kf.kernels.tasks import TaskError
from kf.log import EventLog

AS_CANDIDATE = '''

# --- kf bench/kernelbench.py: the reference itself as the candidate (a harness check) ---
class ModelNew(Model):
    """The task's own Model, unchanged: kf must find it correct and about 1.0x eager."""
'''


class MemorySampler:
    """``nvidia-smi``'s ``memory.used`` (MiB) of one GPU, sampled in a thread."""

    def __init__(self, device: str, every_s: float) -> None:
        self.index = device.partition(":")[2] or "0"
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        if shutil.which("nvidia-smi") is None:
            self.error = "nvidia-smi not found"
            return
        self._thread.start()

    def _run(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    [*cmd, "-i", self.index],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=False,
                )
                self.samples.append((time.time(), float(out.stdout.strip().splitlines()[0])))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
                self.error = f"nvidia-smi failed: {exc}"
                return
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, start: float, end: float) -> float | None:
        vals = [mb for t, mb in self.samples if start <= t <= end]
        return max(vals) if vals else None


def harness_folder(
    tasks: list[Any], skipped: list[tuple[str, str]], level_name: str, where: Path
) -> Path:
    """``where/<level_name>/``: the task files unchanged (the broken ones too, for kf run
    to skip and record), and ``seeds/<stem>.py`` holding each reference rewritten as
    ``ModelNew``."""
    folder = where / level_name
    (folder / "seeds").mkdir(parents=True)
    for path, _ in skipped:
        shutil.copyfile(path, folder / Path(path).name)
    for t in tasks:
        (folder / f"{t.name}.py").write_text(t.source)
        (folder / "seeds" / f"{t.name}.py").write_text(t.source + AS_CANDIDATE)
    return folder


def table(rows: list[dict[str, Any]]) -> str:
    """The per-task table."""

    def ms(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, int | float) and v > 0 else "—"

    def x(v: Any) -> str:
        return f"{v:.2f}×" if isinstance(v, int | float) else "—"

    head = ("level", "task", "ok", "eager ms", "compile ms", "kf ms", "vs eager",
            "vs compile", "vs best", "peak MB", "time s")  # fmt: skip
    out = [head]
    for r in rows:
        mb = r.get("peak_device_mb")
        out.append(
            (
                str(r["level"] if r["level"] is not None else "—"),
                r["problem_name"].removesuffix(".py"),
                "correct" if r["correctness"] else ("compiled" if r["compiled"] else "failed"),
                ms(r["ref_runtime"]),
                ms(r["ref_runtime_compile"]),
                ms(r["runtime"]),
                x(r["speedup"]),
                x(r["speedup_vs_compile"]),
                x(r["speedup_vs_best"]),
                f"{mb:,.0f}{r.get('peak_source', '')}" if mb else "—",
                f"{r['time_s']:.1f}" if r.get("time_s") is not None else "—",
            )
        )
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_for(cmd: list[str], env: dict[str, str], wall: float | None) -> tuple[int, bool]:
    """Run ``kf run``; after ``wall`` seconds interrupt it as Ctrl-C would (it commits
    what it has and exits), killing it if it has not exited 60 s later. (exit code,
    whether it was stopped)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        return proc.wait(timeout=wall), False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=60), True
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(), True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a KernelBench level folder (…/level1)")
    ap.add_argument("--tasks", help="ids, A-B ranges, name substrings (1,19,23-26,Softmax)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-kernelbench")
    ap.add_argument("--llm-url", help="an OpenAI-compatible endpoint; without it: harness check")
    ap.add_argument("--model", action="append", default=[], help="model name(s), as kf run")
    ap.add_argument("--budget", type=int, help="candidates per task (default 1 without an LLM)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per candidate stage")
    ap.add_argument("--sample-s", type=float, default=0.5, help="nvidia-smi sampling period")
    ap.add_argument("--unsafe-no-sandbox", action="store_true")
    ap.add_argument(
        "--wall", type=float, default=None,
        help="stop kf run after this many seconds (SIGINT: the log keeps what was "
        "committed) and report what it has; --resume continues it",
    )  # fmt: skip
    ap.add_argument(
        "--resume", action="store_true",
        help="continue the run in --out's kernelbench.db (same tasks, budget, seed, device)",
    )  # fmt: skip
    ap.add_argument(
        "--table-only", action="store_true",
        help="run nothing: make the table again from --out's kernelbench.db, with the "
        "nvidia-smi samples its kernelbench.json kept (a log brought back from a GPU)",
    )  # fmt: skip
    ap.add_argument("kf_args", nargs="*", help="after --: more `kf run` options")
    args = ap.parse_intermixed_args(argv)  # the folder first, `-- kf run options` last

    try:
        tasks, skipped = load_tasks_skipping(args.folder)
        if args.tasks:
            tasks, skipped = select_loaded(tasks, skipped, args.tasks, lambda t: t.name)
    except (TaskError, SelectionError) as exc:
        print(f"bench/kernelbench.py: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    db = args.out / "kernelbench.db"
    saved_json = args.out / "kernelbench.json"
    before: dict[str, Any] = json.loads(saved_json.read_text()) if saved_json.exists() else {}
    if db.exists() and not (args.resume or args.table_only):
        print(
            f"bench/kernelbench.py: {db} exists; choose another --out, or --resume it",
            file=sys.stderr,
        )
        return 2
    sampler = MemorySampler(args.device, args.sample_s)
    # a resumed table's earlier sittings were sampled too: their spans are in the log
    sampler.samples = [(float(t), float(mb)) for t, mb in before.get("memory_samples") or []]
    if args.table_only:
        if not db.exists():
            print(f"bench/kernelbench.py: --table-only: no {db}", file=sys.stderr)
            return 2
        cmd, returncode = list(before.get("command") or []), int(before.get("exit") or 0)
        stopped, wall = bool(before.get("stopped_at_wall")), float(before.get("wall_s") or 0.0)
        sampler.error = before.get("memory_error")
        budget = args.budget or (8 if args.llm_url else 1)
        return _finish(args, db, report_of(db), cmd, returncode, stopped, wall, sampler, budget)
    scratch = Path(tempfile.mkdtemp(prefix="kf-kernelbench-"))
    try:
        if args.llm_url:
            folder, budget = args.folder, args.budget or 8
            extra = ["--llm-url", args.llm_url, *(f"--model={m}" for m in args.model)]
            extra += ["--tasks", args.tasks] if args.tasks else []
        else:
            folder, budget = (
                harness_folder(tasks, skipped, args.folder.name, scratch),
                args.budget or 1,
            )
            extra = []
        cmd = [
            sys.executable, "-m", "kf.app.cli", "run", str(folder), "--budget", str(budget),
            "--seed", str(args.seed), "--device", args.device, "--max-in-flight", "1",
            "--timeout", str(args.timeout), "--db", str(db), "--json", *extra,
            *(["--unsafe-no-sandbox"] if args.unsafe_no_sandbox else []), *args.kf_args,
        ]  # fmt: skip
        print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
        if args.device.startswith("cuda"):
            sampler.start()
        t0 = time.time()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        returncode, stopped = run_for(cmd, env, args.wall)
        wall = time.time() - t0
        sampler.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not db.exists():
        when = f"was stopped at --wall {args.wall:g} s" if stopped else f"exited {returncode}"
        print(f"bench/kernelbench.py: kf run {when} before a log existed")
        return 1
    return _finish(args, db, report_of(db), cmd, returncode, stopped, wall, sampler, budget)


def report_of(db: Path) -> dict[str, Any]:
    """``kf report``'s report of the log, with each task's span of device work."""
    report = build_report(db)
    with EventLog(db, readonly=True) as elog:
        report["task_windows"] = task_windows(elog.read())
    return report


def _finish(
    args: argparse.Namespace,
    db: Path,
    report: dict[str, Any],
    cmd: list[str],
    returncode: int,
    stopped: bool,
    wall: float,
    sampler: MemorySampler,
    budget: int,
) -> int:
    """Print the table and the levels' scores, write the CSV and JSON."""
    windows = report.pop("task_windows")
    kb = report["kernelbench"]
    for r in kb["rows"]:
        r["peak_source"] = ""
        if r.get("peak_device_mb") is None and sampler.samples:
            name = r["problem_name"].removesuffix(".py")
            if name in windows:
                r["peak_device_mb"] = sampler.peak(*windows[name])
                r["peak_source"] = " (smi)"
    print(table(kb["rows"]))
    print()
    print("\n".join(format_levels(kb)))
    mode = (
        "harness check: each reference as its own candidate"
        if not args.llm_url
        else (f"LLM {args.llm_url}")
    )
    print(
        f"\n{mode}; device {args.device}; budget {budget} per task; torch.compile mode "
        f"{kb['compile_mode']}; kf run exited {returncode} after {wall:.1f} s"
        + (" (the table made again from the log: --table-only)" if args.table_only else "")
        + (
            f" (stopped at --wall {args.wall:g} s: the tasks it had not finished are "
            "partial; --resume continues the run)"
            if stopped
            else ""
        )
    )
    if args.device.startswith("cuda"):
        print(
            "peak MB: the runners' own peak_device_mb where reported; (smi): nvidia-smi "
            "device-wide memory.used during the task, CUDA contexts included"
            + (f" — {sampler.error}" if sampler.error else "")
        )
    if not args.llm_url:
        broken = [r["problem_name"] for r in kb["rows"] if "skipped" in r["metadata"]]
        if broken:
            print(f"skipped task files (the reference itself does not run): {broken}")
        off = [
            r["problem_name"]
            for r in kb["rows"]
            if "skipped" not in r["metadata"]
            and (not r["correctness"] or not 0.8 <= (r["speedup"] or 0.0) <= 1.25)
        ]
        print(
            "harness check: "
            + ("every reference correct and within 0.8-1.25x of eager" if not off else
               f"OUTSIDE expectations (not correct, or not within 0.8-1.25x of eager): {off}")
        )  # fmt: skip
    (args.out / "kernelbench.csv").write_text(rows_to_csv(kb["rows"]))
    (args.out / "kernelbench.json").write_text(
        json.dumps(
            {"command": cmd, "exit": returncode, "stopped_at_wall": stopped, "wall_s": wall,
             "resumed": args.resume, "rows": kb["rows"],
             "levels": kb["levels"], "memory_samples": sampler.samples,
             "memory_error": sampler.error, "report": report},
            indent=1, default=str,
        )
    )  # fmt: skip
    print(f"wrote {args.out}/kernelbench.{{db,json,csv}}", file=sys.stderr)
    return 0 if returncode == 0 or stopped else 1


if __name__ == "__main__":
    sys.exit(main())
