"""GPU pipeline benchmark: kf's pipeline vs a sequential KernelBench-style loop, same GPU.

Forty distinct KernelBench-style candidates for ``examples/cuda_tasks/gelu_residual.py``
(CUDA C++ through ``torch.utils.cpp_extension.load_inline``: block size × items per
thread × GELU formula) are evaluated

* **through kf's pipeline**: ``kf run --device cuda:0`` with the forty as the task's
  seeds and a budget of forty (archivist, NATS, compiler/verifier/profiler agents,
  sandboxed runners, content-addressed ``load_inline`` cache, parallel compiles beside
  GPU verification and timing), from a cold build cache; wall time from start to the
  final report;
* **sequentially, as KernelBench does**: for each candidate a fresh process builds it
  with PyTorch's own ``load_inline`` (a fresh build folder), checks 5 seeded trials
  against the reference, and times 100 calls with CUDA events. ``--sequential N`` runs
  the first N candidates and reports the rate (a full sequential pass takes about 30 s a
  candidate).

The GPU's busy fraction is NVML's utilisation (share of time a kernel was running)
sampled every 50 ms over each arm. Last, kf evaluates the NVRTC seed in a few
configurations and reports the best one's achieved bandwidth over the measured copy
bandwidth (bytes: x and residual read once, output written once).

    python bench/gpu_pipeline.py --out results/ [--candidates 40] [--sequential 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "examples" / "cuda_tasks" / "gelu_residual.py"
INLINE = ROOT / "examples" / "cuda_candidates" / "gelu_residual_load_inline.py"
NVRTC_SEED = ROOT / "examples" / "cuda_tasks" / "seeds" / "gelu_residual.py"


def variants(
    n: int,
    blocks: tuple[int, ...] = (64, 128, 256, 512, 1024),
    items: tuple[int, ...] = (1, 2, 4, 8),
) -> list[str]:
    """``n`` distinct load_inline candidates (block × items × GELU formula)."""
    base = INLINE.read_text()
    out = []
    for block, per_thread, math in itertools.product(blocks, items, ("exp", "tanh")):
        src = base.replace("BLOCK = 256", f"BLOCK = {block}").replace(
            "ITEMS = 4", f"ITEMS = {per_thread}"
        )
        if math == "tanh":
            src = src.replace(
                "return v / (1.0f + __expf(-2.0f * u));", "return 0.5f * v * (1.0f + tanhf(u));"
            )
        out.append(src)
    if n > len(out):
        raise SystemExit(f"at most {len(out)} distinct candidates")
    return out[:n]


def run_timed(
    argv: list[str], env: dict[str, str], timeout_s: float
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``argv`` run to its end (exit status -9 and "timed out" after ``timeout_s``), and
    its wall seconds."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=env, check=False, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        proc = subprocess.CompletedProcess(argv, -9, "", f"{err}\ntimed out")
    return proc, time.perf_counter() - t0


class GpuSampler:
    """Samples NVML GPU utilisation every ``period_s`` in a thread."""

    def __init__(self, period_s: float = 0.05) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.period_s = period_s
        self.samples: list[int] = []
        # (time, busy jiffies, all jiffies, this cgroup's CPU seconds)
        self.cpu: list[tuple[float, int, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        ticks = 0
        while not self._stop.is_set():
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            if ticks % round(1.0 / self.period_s) == 0:
                self.cpu.append((time.perf_counter(), *host_cpu_jiffies(), cgroup_cpu_s()))
            ticks += 1
            self._stop.wait(self.period_s)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def busy(self) -> float:
        return sum(self.samples) / max(1, len(self.samples)) / 100.0

    def host_cpu(self, window_s: float = 10.0) -> dict[str, Any]:
        """CPU use over the arm and per ``window_s`` window: the busy share of all the
        CPUs /proc/stat shows, and the cores this container's cgroup kept busy (its CPU
        seconds over wall seconds): whether the builds had the host's cores to themselves."""
        if len(self.cpu) < 2:
            return {}
        first, last = self.cpu[0], self.cpu[-1]
        share, cores, start = [], [], first
        for point in self.cpu[1:]:
            if point[0] - start[0] >= window_s or point is last:
                share.append(round((point[1] - start[1]) / max(1, point[2] - start[2]), 2))
                cores.append(round((point[3] - start[3]) / max(1e-9, point[0] - start[0]), 1))
                start = point
        cgroup = first[3] == first[3]  # NaN where there is no cgroup v2 cpu.stat
        return {
            "busy_share": round((last[1] - first[1]) / max(1, last[2] - first[2]), 3),
            "cores_busy": round((last[3] - first[3]) / max(1e-9, last[0] - first[0]), 2)
            if cgroup
            else None,
            "cpus_usable": len(os.sched_getaffinity(0)),
            "cpus_in_proc_stat": os.cpu_count(),
            f"busy_share_per_{window_s:g}s": share,
            f"cores_busy_per_{window_s:g}s": cores if cgroup else None,
        }


def cgroup_cpu_s() -> float:
    """CPU seconds this process's cgroup (v2) has used; NaN where there is none."""
    try:
        with open("/sys/fs/cgroup/cpu.stat") as f:
            for line in f:
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return float("nan")


def host_cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all the host's CPUs; idle and iowait count as not busy."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # guest time is already inside user and nice
    return total - idle, total


def task_file(work: Path, batch: int) -> Path:
    """The task with its leading dimension set to ``batch`` (smaller: cheaper verification)."""
    path = work / "task" / "gelu_residual.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TASK.read_text().replace("BATCH = 4096", f"BATCH = {batch}"))
    return path


def pipeline_arm(sources: list[str], work: Path, task: Path, timeout_s: float) -> dict[str, Any]:
    folder = work / "tasks"
    (folder / "seeds").mkdir(parents=True)
    shutil.copy(task, folder / "gelu_residual.py")
    for i, src in enumerate(sources):
        (folder / "seeds" / f"gelu_residual.v{i:02d}.py").write_text(src)
    env = {**os.environ, "KF_CACHE_DIR": str(work / "kf-cache")}
    argv = [
        sys.executable, "-m", "kf.app.cli", "run", str(folder / "gelu_residual.py"),
        "--device", "cuda:0", "--budget", str(len(sources)), "--max-in-flight",
        str(len(sources)), "--json", "--db", str(work / "pipeline.db"),
    ]  # fmt: skip
    with GpuSampler() as gpu:
        launched = time.time()  # envelope times are epoch seconds
        proc, wall = run_timed(argv, env, timeout_s)
    (work / "pipeline.stderr").write_text(proc.stderr)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        report = {"raw": proc.stdout[-2000:], "stderr": proc.stderr[-3000:]}
    return {
        "candidates": len(sources),
        "wall_s": wall,
        "candidates_per_min": len(sources) / wall * 60,
        "gpu_busy": gpu.busy,
        "host_cpu": gpu.host_cpu(),
        "returncode": proc.returncode,
        "stages": stage_summary(work / "pipeline.db", launched),
        "report": report,
    }


def concurrency(intervals: list[tuple[float, float]]) -> dict[str, float]:
    """How many of ``intervals`` overlapped: at most, and on average while any ran."""
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    now = peak = 0
    busy = weighted = 0.0
    last = points[0][0] if points else 0.0
    for t, step in points:
        if now:
            busy += t - last
            weighted += now * (t - last)
        now += step
        peak = max(peak, now)
        last = t
    return {"max": float(peak), "mean_while_busy": weighted / busy if busy else 0.0, "busy_s": busy}


def stage_summary(db: Path, launched: float | None = None) -> dict[str, Any]:
    """What the run's log says each stage did: counts, seconds, failures, flags, builds,
    and (given when ``kf run`` was launched, epoch seconds) a timeline: seconds from the
    launch to the first and last event of each type, and to the first build's start."""
    from kf.log import EventLog
    from kf.search_facts import (
        CandidateCompiled,
        CandidateProfiled,
        CandidateRejected,
        CandidateVerified,
    )

    if not db.exists():
        return {}
    out: dict[str, Any] = {
        "compiled_ok": 0, "compile_failed": 0, "verified": 0, "rejected": {},
        "profiled_ok": 0, "profile_failed": {}, "flagged": 0, "objcache_hits": 0,
        "compile_s": [], "verify_s": [], "profile_s": [], "speedups": [],
    }  # fmt: skip
    # per stage, per runner request op: summed seconds (reports' phases)
    phases: dict[str, dict[str, list[float]]] = {"compile": {}, "verify": {}, "profile": {}}
    spans: dict[str, list[tuple[float, float]]] = {"build": [], "gpu": []}
    seen: dict[str, list[float]] = {}  # event type: [first, last] time
    log = EventLog(db)
    try:
        for rec in log.records():
            ev = rec.event
            when = seen.setdefault(rec.envelope.type, [rec.envelope.time, rec.envelope.time])
            when[1] = rec.envelope.time
            report = getattr(ev, "report", None)
            stages = CandidateCompiled | CandidateVerified | CandidateRejected | CandidateProfiled
            if isinstance(ev, stages):
                stage = (
                    "compile"
                    if isinstance(ev, CandidateCompiled)
                    else "profile"
                    if isinstance(ev, CandidateProfiled)
                    else "verify"
                )
                for op, secs in (getattr(report, "phases", None) or {}).items():
                    phases[stage].setdefault(op, []).append(float(secs))
                end = rec.envelope.time
                which = "build" if isinstance(ev, CandidateCompiled) else "gpu"
                spans[which].append((end - float(getattr(report, "duration_s", 0.0)), end))
            if isinstance(ev, CandidateCompiled):
                out["compiled_ok" if ev.report.ok else "compile_failed"] += 1
                out["compile_s"].append(ev.report.duration_s)
                out["objcache_hits"] += ev.report.log.count("kf.cuda.objcache: hit")
            elif isinstance(ev, CandidateVerified):
                out["verified"] += 1
                out["verify_s"].append(ev.report.duration_s)
            elif isinstance(ev, CandidateRejected):
                kind = str(ev.report.failure_kind)
                out["rejected"][kind] = out["rejected"].get(kind, 0) + 1
                out["verify_s"].append(ev.report.duration_s)
            elif isinstance(ev, CandidateProfiled):
                out["profile_s"].append(ev.report.duration_s)
                if ev.report.ok:
                    out["profiled_ok"] += 1
                    out["speedups"].append(round(ev.report.speedup, 3))
                    out["flagged"] += bool(ev.report.flags)
                else:
                    kind = str(ev.report.failure_kind)
                    out["profile_failed"][kind] = out["profile_failed"].get(kind, 0) + 1
    finally:
        log.close()
    for which, intervals in spans.items():
        out[f"{which}_concurrency"] = concurrency(intervals)
    if launched is not None:
        out["timeline_s"] = {
            kind: [round(first - launched, 2), round(last - launched, 2)]
            for kind, (first, last) in sorted(seen.items(), key=lambda kv: kv[1][0])
        }
        if spans["build"]:
            out["timeline_s"]["first_build_started"] = round(
                min(a for a, _ in spans["build"]) - launched, 2
            )
    # mean seconds per candidate in each runner request op (lease_wait: runner start-up)
    out["phases_mean_s"] = {
        stage: {op: round(sum(v) / len(v), 4) for op, v in sorted(ops.items())}
        for stage, ops in phases.items()
    }
    for key in ("compile_s", "verify_s", "profile_s"):
        values = out.pop(key)
        out[key.replace("_s", "_seconds")] = {
            "count": len(values),
            "mean": sum(values) / len(values) if values else None,
            "total": sum(values),
        }
    return out


def sequential_one(task_path: str, cand_path: str) -> dict[str, Any]:
    """KernelBench's loop for one candidate, in this (fresh) process."""
    import torch

    def load(name: str, path: str) -> Any:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    dev = torch.device("cuda:0")
    t0 = time.perf_counter()
    task = load("task", task_path)
    init = task.get_init_inputs()
    cand = load("cand", cand_path)  # load_inline builds here
    t_compile = time.perf_counter() - t0
    torch.manual_seed(0)
    ref = task.Model(*init).to(dev)
    torch.manual_seed(0)
    new = cand.ModelNew(*init).to(dev)
    correct = True
    with torch.no_grad():
        for trial in range(5):
            torch.manual_seed(1000 + trial)
            inputs = [x.to(dev) for x in task.get_inputs()]
            want, got = ref(*inputs), new(*inputs)
            torch.cuda.synchronize()
            correct &= bool(torch.allclose(want, got, atol=1e-4, rtol=1e-4))
        times = []
        if correct:
            for _ in range(3):
                new(*inputs)
            for _ in range(100):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                new(*inputs)
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
    return {
        "compile_s": t_compile,
        "correct": correct,
        "mean_ms": sum(times) / len(times) if times else None,
        "total_s": time.perf_counter() - t0,
    }


def sequential_arm(sources: list[str], count: int, work: Path, task: Path) -> dict[str, Any]:
    results = []
    with GpuSampler() as gpu:
        t0 = time.perf_counter()
        for i, src in enumerate(sources[:count]):
            path = work / f"seq_{i:02d}.py"
            path.write_text(src)
            env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(work / f"ext_{i:02d}")}
            t1 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, __file__, "--sequential-one", str(task), str(path)],
                capture_output=True, text=True, env=env, check=False,
            )  # fmt: skip
            one = {"wall_s": time.perf_counter() - t1, "returncode": proc.returncode}
            try:
                one.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            except (json.JSONDecodeError, IndexError):
                one["stderr"] = proc.stderr[-1500:]
            results.append(one)
            print(f"  sequential {i}: {one}", file=sys.stderr, flush=True)
        wall = time.perf_counter() - t0
    return {
        "candidates": count,
        "wall_s": wall,
        "candidates_per_min": count / wall * 60,
        "gpu_busy": gpu.busy,
        "host_cpu": gpu.host_cpu(),
        "each": results,
    }


def bandwidth_arm(work: Path, configs: list[dict[str, Any]]) -> dict[str, Any]:
    from hardware_agents.cuda import probe_in_subprocess

    caps = probe_in_subprocess("cuda:0")
    base = NVRTC_SEED.read_text()
    from kf.kernels import params

    nbytes = 3 * 4096 * 8192 * 4
    rows = []
    for config in configs:
        path = work / f"nvrtc_{len(rows)}.py"
        path.write_text(params.apply(base, config))
        proc = subprocess.run(
            [sys.executable, "-m", "kf.app.cli", "eval", str(TASK), str(path), "--device", "cuda:0",
             "--json"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        try:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            rows.append({"config": config, "error": proc.stderr[-1500:]})
            continue
        ms = res.get("runtime_ms")
        gbs = nbytes / (ms * 1e-3) / 1e9 if ms else None
        rows.append(
            {
                "config": config,
                "correct": res.get("correct"),
                "runtime_ms": ms,
                "eager_ms": res.get("ref_runtime_ms"),
                "speedup": res.get("speedup"),
                "achieved_gbs": gbs,
                "fraction_of_copy": gbs / caps.measured_copy_bandwidth_gbs
                if gbs and caps.measured_copy_bandwidth_gbs
                else None,
                "compile_log": (res.get("compile") or {}).get("log", ""),
            }
        )
    import msgspec

    return {"device": msgspec.to_builtins(caps), "bytes": nbytes, "configs": rows}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--candidates", type=int, default=40)
    p.add_argument("--sequential", type=int, default=4)
    p.add_argument("--batch", type=int, default=4096, help="task rows for the two arms")
    p.add_argument("--pipeline-timeout", type=float, default=3600.0)
    p.add_argument("--configs", type=int, default=3, help="NVRTC configurations to time")
    p.add_argument("--skip", action="append", default=[], help="pipeline, sequential, bandwidth")
    p.add_argument("--sequential-one", nargs=2, metavar=("TASK", "CANDIDATE"))
    args = p.parse_args()
    if args.sequential_one:
        print(json.dumps(sequential_one(*args.sequential_one)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    sources = variants(args.candidates)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kf-gpu-bench-") as tmp:
        work = Path(tmp)
        if "bandwidth" not in args.skip:
            configs = [
                {"BLOCK": 256, "ITEMS": 4, "MATH": "exp"},
                {"BLOCK": 512, "ITEMS": 2, "MATH": "exp"},
                {"BLOCK": 128, "ITEMS": 8, "MATH": "exp"},
            ]
            result["bandwidth"] = bandwidth_arm(work, configs[: args.configs])
            print(json.dumps(result["bandwidth"]["configs"], indent=1), file=sys.stderr)
        if "pipeline" not in args.skip:
            task = task_file(work, args.batch)
            result["pipeline"] = pipeline_arm(sources, work, task, args.pipeline_timeout)
            result["pipeline"]["batch"] = args.batch
            shutil.copy(work / "pipeline.stderr", args.out / "pipeline.stderr")
            # kept even if the sequential arm is cut short
            (args.out / "gpu_pipeline.json").write_text(json.dumps(result, indent=2))
        if "sequential" not in args.skip and args.sequential > 0:
            task = task_file(work, args.batch)
            result["sequential"] = sequential_arm(sources, args.sequential, work, task)
            result["sequential"]["batch"] = args.batch
    finished = "pipeline" in result and result["pipeline"]["returncode"] == 0
    if finished and result["pipeline"].get("stages", {}).get("profiled_ok", 0) == 0:
        finished = False
    if "pipeline" in result and not finished:
        print("pipeline arm FAILED (see pipeline.stderr): no ratio", file=sys.stderr)
    if finished and "sequential" in result:
        result["ratio"] = (
            result["pipeline"]["candidates_per_min"] / result["sequential"]["candidates_per_min"]
        )
    (args.out / "gpu_pipeline.json").write_text(json.dumps(result, indent=2))
    if "pipeline" in result:
        st = result["pipeline"].get("stages", {})
        print(f"pipeline stages: {json.dumps({k: v for k, v in st.items() if k != 'speedups'})}")
    for arm in ("pipeline", "sequential"):
        if arm in result:
            r = result[arm]
            print(
                f"{arm:<10} {r['candidates']:3d} candidates {r['wall_s']:8.1f} s "
                f"{r['candidates_per_min']:7.2f}/min  GPU busy {r['gpu_busy']:.1%}"
            )
    if "ratio" in result:
        print(f"pipeline / sequential: {result['ratio']:.1f}x candidates per minute")
    for row in result.get("bandwidth", {}).get("configs", []):
        print(
            f"nvrtc {row['config']}: {row.get('runtime_ms')} ms, "
            f"{row.get('achieved_gbs')} GB/s, {row.get('fraction_of_copy')} of copy"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
