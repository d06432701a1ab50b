"""Where a boxed runner's CPU-seconds go, per phase and per role.

kf grades every candidate in fresh runner processes (``python -m kf.evaluation.runner``,
boxed in bubblewrap by kf/evaluation/grader/spawn.py), and reuses candidate-free
reference runners per task. On a busy host their CPU-seconds bound how many candidates a
minute kf can judge. This benchmark goes through the real path (``RunnerPool``, the
stage functions, the box unless ``--unboxed``) and reads, from ``/proc/PID/stat``, the
user + system seconds of each runner's whole box: the runner, bubblewrap's processes,
and anything started inside (inductor's compile workers included), reaped children
counted by their parents.

1. **Start-up**: ``--starts`` runners started one after another, each measured from its
   spawn to its ``Ready`` (wall and CPU of the box), with the runner's own account of
   each step (it logs one line: the interpreter and kf's imports, the runner's remaining
   imports, ``import torch``, its set-up, the CUDA context and the op tracer's warm-up
   where the pool warms runners for a device); then the same runners idle for
   ``--idle`` seconds (threads that spin would show there).
2. **Stages**: ``--candidates`` times the stages of ``kf run``: compile (a fresh
   candidate runner), the task's audit (once), verify (the task's reference runner,
   reused, and a fresh candidate runner), the ``torch.compile`` baseline compiled early
   as the verifier does (once), and profile. A thread samples every box's CPU every
   ``--interval`` seconds; each request of the request log
   (``kf.evaluation.grader.sandbox.REQUESTS``) gets the CPU its runner used between its
   start and its end, so the table gives CPU-seconds per stage, role and request.
3. **Imports** (``-X importtime``, outside the box, same interpreter): the imports a
   runner makes before it is ready, the costliest first.

    python bench/runner_cost.py --device cpu --out OUT [--unboxed] [--candidates 2]
    python bench/runner_cost.py --device cuda:0 --out OUT

Writes ``OUT/runner_cost.json`` and prints the tables (also ``OUT/runner_cost.txt``).
Defaults: on a CPU examples/tasks/gelu_bias.py with its seed (a kf.native C++ kernel);
on a GPU examples/cuda_tasks/gelu_residual.py with
examples/cuda_candidates/gelu_residual_load_inline.py (a ``load_inline`` CUDA kernel).
Builds run in the grader's build boxes, not in a runner's: their CPU is not a runner's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_TICK = os.sysconf("SC_CLK_TCK")
_RUNNER = b"kf.evaluation.runner"


# -- /proc -------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    """Every child of ``pid``, whichever of its threads started it."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def own_cpu(pid: int) -> float:
    """``pid``'s user + system seconds and those of its reaped children."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK


def tree_cpu(pid: int) -> tuple[float, int]:
    """CPU-seconds of ``pid`` and every process below it, and how many there are."""
    total, count, _ = tree_cpu_split(pid)
    return total, count


def tree_cpu_split(pid: int) -> tuple[float, int, float]:
    """:func:`tree_cpu`, and the part of it that inductor's compile workers used."""
    total, count, workers, todo = 0.0, 0, 0.0, [pid]
    while todo:
        p = todo.pop()
        used = own_cpu(p)
        total += used
        count += 1
        try:
            if b"compile_worker" in Path(f"/proc/{p}/cmdline").read_bytes():
                workers += used
        except OSError:
            pass
        todo += children(p)
    return total, count, workers


def runner_roots() -> list[int]:
    """This process's children that are runners (bwrap's, or the runner itself unboxed)."""
    roots = []
    for pid in children(os.getpid()):
        try:
            if _RUNNER in Path(f"/proc/{pid}/cmdline").read_bytes():
                roots.append(pid)
        except OSError:
            continue
    return roots


class Sampler(threading.Thread):
    """Every runner box's CPU-seconds, every ``interval`` seconds (monotonic time)."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.series: dict[int, list[tuple[float, float]]] = defaultdict(list)
        #: the CPU-seconds of each box's inductor compile workers, at its last sample
        self.workers: dict[int, float] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def sample(self) -> None:
        for pid in runner_roots():
            cpu, _, workers = tree_cpu_split(pid)
            now = time.monotonic()
            points = self.series[pid]
            if not points or cpu >= points[-1][1]:  # a box dying reads less: keep the last
                points.append((now, cpu))
                self.workers[pid] = max(workers, self.workers.get(pid, 0.0))

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def at(self, pid: int, t: float) -> float:
        """The box's CPU-seconds at ``t``, interpolated between samples."""
        points = self.series.get(pid, [])
        if not points or t <= points[0][0]:
            return points[0][1] if points else 0.0
        for (t0, c0), (t1, c1) in itertools.pairwise(points):
            if t <= t1:
                return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)
        return points[-1][1]

    def total(self, pid: int) -> float:
        points = self.series.get(pid, [])
        return points[-1][1] if points else 0.0


# -- the runner's own account of its start-up ---------------------------------------
_STEP = re.compile(r"([^;(]+?) ([0-9.]+) CPU-s ([0-9.]+) s")


def startup_steps(log: str) -> dict[str, dict[str, float]]:
    """The steps of the runner's ``kf runner: started in ...`` line (empty if none)."""
    line = next((x for x in log.splitlines() if x.startswith("kf runner: started in")), "")
    inner = line.split("(", 1)[1].rsplit(")", 1)[0] if "(" in line else ""
    return {
        m.group(1).strip(): {"cpu_s": float(m.group(2)), "wall_s": float(m.group(3))}
        for m in _STEP.finditer(inner)
    }


def measure_starts(n: int, idle_s: float, warm: str | None) -> dict[str, Any]:
    """Start ``n`` runners one at a time, each to ready; then let them idle ``idle_s``."""
    from kf.evaluation.grader.sandbox import RunnerPool

    pool = RunnerPool(size=0, warm=warm)
    rows: list[dict[str, Any]] = []
    handles = []
    try:
        for _ in range(n):
            began = time.monotonic()
            handle = pool.acquire_ready()
            wall = time.monotonic() - began
            cpu, procs = tree_cpu(handle.pid)
            handles.append(handle)
            rows.append(
                {
                    "pid": handle.pid,
                    "wall_s": round(wall, 3),
                    "cpu_s": round(cpu, 3),
                    "processes": procs,
                    "steps": startup_steps(handle.log_tail()),
                    "sandbox": handle.sandbox,
                }
            )
            print(f"  start {len(rows)}: {wall:.2f} s wall, {cpu:.2f} CPU-s", flush=True)
        before = [tree_cpu(h.pid)[0] for h in handles]
        time.sleep(idle_s)
        after = [tree_cpu(h.pid)[0] for h in handles]
    finally:
        for h in handles:
            pool.release(h)
        pool.close()
    idle = [a - b for a, b in zip(after, before, strict=True)]
    steps: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        for name, v in row["steps"].items():
            steps[name].append(v["cpu_s"])
    return {
        "runners": rows,
        "mean_cpu_s": _mean([r["cpu_s"] for r in rows]),
        "mean_wall_s": _mean([r["wall_s"] for r in rows]),
        "steps_mean_cpu_s": {k: _mean(v) for k, v in steps.items()},
        "idle_s": idle_s,
        "idle_cpu_s_per_runner_minute": _mean([60 * c / idle_s for c in idle]) if idle_s else None,
    }


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


# -- the stages ------------------------------------------------------------------------
def run_stages(
    task_path: Path, source: str, device: str, n: int, warm: str | None, sampler: Sampler
) -> list[tuple[str, float, float, Any]]:
    """The stages of ``kf run`` for ``n`` candidates: ``(stage, began, ended, report)``.
    Each candidate's stages share its key, as a worker's do: its build's runner verifies
    it and that one profiles it, unless ``$KF_KEPT_RUNNERS=0``."""
    from kf.evaluation import GradingSession, RunnerPool
    from kf.evaluation.grader.audit import audit_task
    from kf.evaluation.grader.baseline import compile_early
    from kf.evaluation.grader.compiling import compile_session
    from kf.evaluation.grader.profiling import profile_session
    from kf.evaluation.grader.verifying import verify_session
    from kf.kernels.tasks import load_task

    task = load_task(task_path)
    pool = RunnerPool(size=2, warm=warm, references=4)
    pool.start()
    pool.wait_warm()
    windows: list[tuple[str, float, float, Any]] = []

    def stage(name: str, fn: Any, *args: Any, **kw: Any) -> Any:
        began = time.monotonic()
        report = fn(*args, **kw)
        ended = time.monotonic()
        ok = getattr(report, "ok", getattr(report, "correct", None))
        print(f"  {name}: {ended - began:.2f} s ok={ok}", flush=True)
        windows.append((name, began, ended, report))
        return report

    try:
        for i in range(n):
            mine = GradingSession(task, source, device=device, pool=pool, candidate_key=f"c{i}")
            stage("compile", compile_session, mine)
            if i == 0:
                stage("audit", audit_task, task, device=device, pool=pool)
            stage("verify", verify_session, mine)
            if i == 0:
                session = GradingSession(task, source, device=device, pool=pool)
                stage("baseline", compile_early, session)
            stage("profile", profile_session, mine)
        time.sleep(3 * sampler.interval)  # the last samples of the runners still alive
        sampler.sample()
    finally:
        pool.close()
    return windows


def attribute(
    windows: list[tuple[str, float, float, Any]], sampler: Sampler
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """CPU-seconds per (stage, role, request op), and per runner of the stages."""
    from kf.evaluation.grader.sandbox import REQUESTS

    first, last = windows[0][1], windows[-1][2]
    requests = [r for r in list(REQUESTS) if first <= r.ended <= last and r.op != "lease_wait"]
    candidates = {r.pid for r in requests if r.op == "load_candidate"}

    def stage_of(t: float) -> str:
        return next((name for name, a, b, _ in windows if a <= t <= b), "between")

    ops: dict[tuple[str, str, str], dict[str, float]] = defaultdict(
        lambda: {"n": 0, "wall_s": 0.0, "runner_s": 0.0, "cpu_s": 0.0}
    )
    per_runner: dict[int, dict[str, Any]] = {}
    for r in requests:
        began = r.ended - r.wall_s
        role = "candidate" if r.pid in candidates else "reference"
        cpu = sampler.at(r.pid, r.ended) - sampler.at(r.pid, began)
        row = ops[(stage_of(r.ended), role, r.op)]
        row["n"] += 1
        row["wall_s"] += r.wall_s
        row["runner_s"] += r.runner_s
        row["cpu_s"] += cpu
        for phase, seconds in (r.detail or {}).items():  # a run's inputs, forward, outputs
            row[f"{phase}_s"] = row.get(f"{phase}_s", 0.0) + seconds
        mine = per_runner.setdefault(r.pid, {"role": role, "stages": [], "requests_cpu_s": 0.0})
        mine["requests_cpu_s"] += cpu
        if stage_of(r.ended) not in mine["stages"]:
            mine["stages"].append(stage_of(r.ended))
    table = [
        {"stage": s, "role": role, "op": op, **{k: round(v, 4) for k, v in row.items()}}
        for (s, role, op), row in sorted(ops.items(), key=lambda kv: _order(kv[0]))
    ]
    runners = []
    for pid, points in sampler.series.items():
        if points[-1][0] < first:
            continue  # a runner of the start-up measurement
        mine = per_runner.get(
            pid, {"role": "spare (never leased)", "stages": [], "requests_cpu_s": 0.0}
        )
        total = sampler.total(pid)
        runners.append(
            {
                "pid": pid,
                **mine,
                "requests_cpu_s": round(mine["requests_cpu_s"], 3),
                "total_cpu_s": round(total, 3),
                "outside_requests_cpu_s": round(total - mine["requests_cpu_s"], 3),
                "inductor_workers_cpu_s": round(sampler.workers.get(pid, 0.0), 3),
            }
        )
    return table, runners


_STAGES = ("compile", "audit", "verify", "baseline", "profile", "between")


def _order(key: tuple[str, str, str]) -> tuple[int, str, str]:
    stage, role, op = key
    return (_STAGES.index(stage) if stage in _STAGES else 99, role, op)


# -- imports ---------------------------------------------------------------------------
def import_profile(python: str, device: str, top: int = 15) -> dict[str, Any]:
    """``-X importtime`` of what a runner imports before it is ready (outside the box)."""
    code = "import kf.evaluation.runner.loop, torch; from kf.evaluation.runner.loop import Runner"
    code += "; import time; Runner(time.perf_counter_ns)"
    if device.startswith("cuda"):
        code += f"; torch.empty(1, device={device!r})"
    proc = subprocess.run(
        [python, "-X", "importtime", "-P", "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line[len("import time:") :].split("|")
        self_us, cum_us, name = int(parts[0]), int(parts[1]), parts[2]
        depth = (len(name) - len(name.lstrip(" ")) - 1) // 2
        rows.append(
            {"module": name.strip(), "self_s": self_us / 1e6, "cum_s": cum_us / 1e6, "depth": depth}
        )
    tops = sorted((r for r in rows if r["depth"] == 0), key=lambda r: -r["cum_s"])[:top]
    selfs = sorted(rows, key=lambda r: -r["self_s"])[:top]
    return {
        "modules": len(rows),
        "total_s": round(sum(r["self_s"] for r in rows), 3),
        "top_level_by_cumulative": [_rounded(r) for r in tops],
        "by_self": [_rounded(r) for r in selfs],
    }


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


# -- how a CUDA wait costs the host -----------------------------------------------------
def sync_probe(device: str, seconds: float = 0.2) -> dict[str, Any]:
    """CPU-seconds this process spends waiting ``seconds`` for a GPU kernel: with
    ``torch.cuda.synchronize`` (CUDA's default schedule spins a core while it waits: a
    runner waiting for a GPU that other runners keep busy burns CPU all along) and with
    a blocking event (the thread sleeps). Measured outside the box, on the same GPU."""
    import torch

    torch.cuda.set_device(device)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(1_000_000 * seconds * 1000 / max(start.elapsed_time(end), 1e-3))
    out: dict[str, Any] = {"wait_s": seconds}
    for how in ("synchronize", "blocking event"):
        cpu, wall = time.process_time(), time.perf_counter()
        torch.cuda._sleep(cycles)
        if how == "synchronize":
            torch.cuda.synchronize()
        else:
            done = torch.cuda.Event(blocking=True)
            done.record()
            done.synchronize()
        out[how] = {
            "cpu_s": round(time.process_time() - cpu, 4),
            "wall_s": round(time.perf_counter() - wall, 4),
        }
    return out


# -- the report ---------------------------------------------------------------------------
def summary(table: list[dict[str, Any]], runners: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The headline figures: per phase and role, and per candidate."""

    def cpu(stage: str | None = None, role: str | None = None, op: str | None = None) -> float:
        return sum(
            r["cpu_s"]
            for r in table
            if (stage is None or r["stage"] == stage)
            and (role is None or r["role"] == role)
            and (op is None or r["op"] == op)
        )

    total = sum(r["total_cpu_s"] for r in runners)
    return {
        "candidates": n,
        "runners": len(runners),
        "runner_cpu_s_total": round(total, 2),
        "runner_cpu_s_per_candidate": round(total / n, 2),
        "in_requests_cpu_s": round(sum(r["requests_cpu_s"] for r in runners), 2),
        "outside_requests_cpu_s": round(sum(r["outside_requests_cpu_s"] for r in runners), 2),
        "load_task_cpu_s_each": _each(table, "load_task"),
        "load_candidate_cpu_s_each": {
            s: round(cpu(s, "candidate", "load_candidate") / n, 3)
            for s in ("compile", "verify", "profile")
        },
        "verification_cpu_s_each": {
            role: round(cpu("verify", role) / n, 3) for role in ("candidate", "reference")
        },
        "baseline_compile_cpu_s": round(cpu("baseline", "reference", "compile_baseline"), 3),
        "profile_cpu_s_each": {
            role: round(cpu("profile", role) / n, 3) for role in ("candidate", "reference")
        },
    }


def _each(table: list[dict[str, Any]], op: str) -> float:
    rows = [r for r in table if r["op"] == op]
    n = sum(r["n"] for r in rows)
    return round(sum(r["cpu_s"] for r in rows) / n, 3) if n else 0.0


def render(result: dict[str, Any]) -> str:
    out = [
        f"runner cost on {result['device']} ({result['sandbox']}), kf {result['commit']}, "
        f"{result['load']} busy processes beside the stages; candidate runners kept between "
        f"stages: {result.get('kept_runners', 0)} ($KF_KEPT_RUNNERS; 0: a fresh one a stage)"
    ]
    starts = result["starts"]
    out.append(
        f"\nstart→ready: {starts['mean_cpu_s']:.3f} CPU-s, {starts['mean_wall_s']:.3f} s wall "
        f"(mean of {len(starts['runners'])}, the whole box); idle: "
        f"{starts['idle_cpu_s_per_runner_minute']} CPU-s per runner-minute"
    )
    for name, v in starts["steps_mean_cpu_s"].items():
        out.append(f"  {name:<24} {v:8.3f} CPU-s")
    out.append(
        f"\n{'stage':<9} {'role':<10} {'op':<16} {'n':>4} {'wall s':>8} {'runner s':>9} "
        f"{'CPU-s':>8}"
    )
    for r in result["requests"]:
        out.append(
            f"{r['stage']:<9} {r['role']:<10} {r['op']:<16} {r['n']:>4g} {r['wall_s']:>8.3f} "
            f"{r['runner_s']:>9.3f} {r['cpu_s']:>8.3f}"
            + "".join(
                f"  {k[:-2]} {v:.3f}"
                for k, v in r.items()
                if k.endswith("_s") and k not in ("wall_s", "runner_s", "cpu_s")
            )
        )
    out.append(
        f"\n{'pid':>8} {'role':<22} {'stages':<28} {'total':>7} {'requests':>9} {'outside':>8}"
        f" {'inductor workers':>17}"
    )
    for r in result["runners"]:
        out.append(
            f"{r['pid']:>8} {r['role']:<22} {','.join(r['stages']):<28} {r['total_cpu_s']:>7.2f} "
            f"{r['requests_cpu_s']:>9.2f} {r['outside_requests_cpu_s']:>8.2f}"
            f" {r['inductor_workers_cpu_s']:>17.2f}"
        )
    out.append("\n" + json.dumps(result["summary"], indent=1))
    if "sync_probe" in result:
        out.append(f"\nCPU of a GPU wait (this process): {json.dumps(result['sync_probe'])}")
    imports = result.get("imports")
    if imports:
        out.append(
            f"\nimports before ready (outside the box): {imports['modules']} modules, "
            f"{imports['total_s']} s"
        )
        for r in imports["top_level_by_cumulative"]:
            out.append(f"  {r['module']:<40} {r['cum_s']:7.3f} s")
    return "\n".join(out)


def _git(*args: str) -> str:
    """What ``git ARGS`` prints in the repository (empty where git fails)."""
    done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, check=False)
    return done.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--task", type=Path, default=None)
    ap.add_argument("--candidate", type=Path, default=None)
    ap.add_argument("--candidates", type=int, default=2, help="candidates through every stage")
    ap.add_argument("--starts", type=int, default=3, help="runners started one at a time")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds the started runners idle")
    ap.add_argument("--interval", type=float, default=0.05, help="CPU sampling interval, s")
    ap.add_argument(
        "--warm", default="auto", help="warm-up device (auto: as kf run: the GPU, none on a CPU)"
    )
    ap.add_argument("--unboxed", action="store_true", help="KF_UNSAFE_NO_SANDBOX=1")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in the runners' environment too ($KF_SANDBOX_ENV passes it into the box); "
        "e.g. TORCHINDUCTOR_COMPILE_THREADS=1",
    )
    ap.add_argument("--no-imports", action="store_true")
    ap.add_argument(
        "--load",
        type=int,
        default=0,
        help="busy processes beside the stages (a host as loaded as in a run: on SMT cores a "
        "CPU-second costs more when the sibling thread is busy)",
    )
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    args = ap.parse_args()
    if args.unboxed:
        os.environ["KF_UNSAFE_NO_SANDBOX"] = "1"
    for item in args.env:
        name, _, value = item.partition("=")
        os.environ[name] = value
        passed = [n for n in os.environ.get("KF_SANDBOX_ENV", "").split(",") if n]
        os.environ["KF_SANDBOX_ENV"] = ",".join([*passed, name])
    from kf.settings import current

    gpu = args.device.startswith("cuda")
    task = args.task or ROOT / (
        "examples/cuda_tasks/gelu_residual.py" if gpu else "examples/tasks/gelu_bias.py"
    )
    cand = args.candidate or ROOT / (
        "examples/cuda_candidates/gelu_residual_load_inline.py"
        if gpu
        else "examples/tasks/seeds/gelu_bias.py"
    )
    warm = (
        (args.device if gpu else current().runner_warm)
        if args.warm == "auto"
        else (args.warm or None)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    commit, dirty = _git("rev-parse", "--short", "HEAD"), _git("status", "--porcelain", "kf")
    print(f"start-up: {args.starts} runners (warm={warm})", flush=True)
    starts = measure_starts(args.starts, args.idle, warm)
    sampler = Sampler(args.interval)
    sampler.start()
    print(
        f"stages: {args.candidates} candidates of {task.name} ({cand.name}) on {args.device}",
        flush=True,
    )
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)
    ]
    try:
        windows = run_stages(task, cand.read_text(), args.device, args.candidates, warm, sampler)
    finally:
        sampler.stop()
        for proc in spinners:
            proc.kill()
            proc.wait()
    table, runners = attribute(windows, sampler)
    result: dict[str, Any] = {
        "device": args.device,
        "sandbox": starts["runners"][0]["sandbox"] if starts["runners"] else "?",
        "commit": commit + (" (kf/ modified)" if dirty else ""),
        "task": str(task.relative_to(ROOT)) if task.is_relative_to(ROOT) else str(task),
        "candidate": str(cand.relative_to(ROOT)) if cand.is_relative_to(ROOT) else str(cand),
        "warm": warm,
        "kept_runners": current().kept_runners,
        "env": args.env,
        "load": args.load,
        "cores": len(os.sched_getaffinity(0)),
        "loadavg_at_end": os.getloadavg(),
        "starts": starts,
        "stages": [{"stage": s, "wall_s": round(b - a, 3)} for s, a, b, _ in windows],
        "requests": table,
        "runners": runners,
        "summary": summary(table, runners, args.candidates),
    }
    if not args.no_imports:
        result["imports"] = import_profile(sys.executable, args.device)
    if gpu:
        try:
            result["sync_probe"] = sync_probe(args.device)
        except Exception as exc:  # a probe, not the benchmark: say why and go on
            result["sync_probe"] = {"error": f"{type(exc).__name__}: {exc}"}
    text = render(result)
    print(text)
    (args.out / "runner_cost.json").write_text(json.dumps(result, indent=1))
    (args.out / "runner_cost.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
