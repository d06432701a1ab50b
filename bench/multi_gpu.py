"""Multi-GPU benchmark: kf's candidates per minute with 1 GPU and with 2 (or more) GPUs
of the same host, in one command.

The same distinct KernelBench-style candidates for ``examples/cuda_tasks/gelu_residual.py``
(CUDA C++ through ``load_inline``: block size × items per thread × GELU formula, as in
``bench/gpu_pipeline.py``) are evaluated by ``kf run`` once per arm: ``--device cuda:0``,
then ``--device cuda:0,cuda:1`` (``--gpus 1,2,4`` for more arms), each from a cold build
cache of its own, all candidates proposed at once (``--max-in-flight`` = their number), so
the arms differ only in the GPUs serving them. Wall time runs from the start of
``kf run`` to its final report; per arm the script reads the log for how many candidates
each GPU profiled, the stage counts and any device that failed (``device.left`` with
``device failed: …``). NVML utilisation per GPU is sampled every 50 ms where pynvml is
installed. The issue's target: at least 1.7× the one-GPU rate with two.

    python bench/multi_gpu.py --out bench/results/multi_gpu [--candidates 60] [--gpus 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_pipeline import run_timed, stage_summary, task_file, variants

#: up to 60 distinct load_inline candidates (block × items × GELU formula)
BLOCKS, ITEMS = (32, 64, 128, 256, 512, 1024), (1, 2, 4, 8, 16)


class Sampler:
    """NVML utilisation of GPUs ``0..count-1`` every ``period_s`` (nothing without pynvml)."""

    def __init__(self, count: int, period_s: float = 0.05) -> None:
        self.samples: list[list[int]] = [[] for _ in range(count)]
        self.period_s = period_s
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception:  # no NVML: no utilisation figures
            self.nvml, self.handles = None, []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for i, h in enumerate(self.handles):
                self.samples[i].append(int(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu))

    def __enter__(self) -> Sampler:
        if self.handles:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.handles:
            self._thread.join()

    def busy(self) -> list[float | None]:
        return [sum(s) / len(s) / 100 if s else None for s in self.samples]


def per_device(db: Path) -> dict[str, Any]:
    """Profiled candidates per device id, and the devices that failed, from the log."""
    from kf.events import decode_event
    from kf.log import EventLog

    profiled: dict[str, int] = {}
    failed: dict[str, str] = {}
    if not db.exists():
        return {}
    with EventLog(db, readonly=True) as elog:
        for env in elog.read():
            if env.type == "kernel.candidate_profiled":
                ev = decode_event(env)
                d = str(getattr(ev, "device_id", ""))
                profiled[d] = profiled.get(d, 0) + 1
            elif env.type == "device.left":
                ev = decode_event(env)
                reason = str(getattr(ev, "reason", ""))
                if reason.startswith("device failed"):
                    failed[str(getattr(ev, "device_id", ""))] = reason
    return {"profiled_by_device": profiled, "failed_devices": failed}


def arm(sources: list[str], gpus: int, work: Path, task: Path, timeout_s: float) -> dict[str, Any]:
    """One ``kf run`` over ``sources`` on the first ``gpus`` GPUs, from a cold cache."""
    here = work / f"gpus{gpus}"
    folder = here / "tasks"
    (folder / "seeds").mkdir(parents=True)
    (folder / "gelu_residual.py").write_text(task.read_text())
    for i, src in enumerate(sources):
        (folder / "seeds" / f"gelu_residual.v{i:02d}.py").write_text(src)
    env = {**os.environ, "KF_CACHE_DIR": str(here / "kf-cache")}
    device = ",".join(f"cuda:{i}" for i in range(gpus))
    db = here / "run.db"
    argv = [
        sys.executable, "-m", "kf.app.cli", "run", str(folder / "gelu_residual.py"),
        "--device", device, "--budget", str(len(sources)), "--max-in-flight",
        str(len(sources)), "--json", "--db", str(db),
    ]  # fmt: skip
    print(f"arm {gpus} GPU(s): {' '.join(argv[3:])}", file=sys.stderr, flush=True)
    with Sampler(gpus) as sampler:
        launched = time.time()
        proc, wall = run_timed(argv, env, timeout_s)
    (work / f"gpus{gpus}.stderr").write_text(proc.stderr)
    stages = stage_summary(db, launched)
    return {
        "gpus": gpus,
        "device": device,
        "candidates": len(sources),
        "wall_s": round(wall, 2),
        "candidates_per_min": round(len(sources) / wall * 60, 3),
        "gpu_busy": sampler.busy(),
        "returncode": proc.returncode,
        "profiled_ok": stages.get("profiled_ok", 0),
        **per_device(db),
        "stages": stages,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-results/multi_gpu"))
    p.add_argument("--candidates", type=int, default=60, help="distinct candidates per arm")
    p.add_argument("--gpus", default="1,2", help="the arms: how many GPUs each uses")
    p.add_argument("--batch", type=int, default=4096, help="task rows")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per arm")
    args = p.parse_args()
    import torch

    arms = [int(x) for x in args.gpus.split(",")]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if max(arms) > have:
        print(f"multi_gpu: an arm needs {max(arms)} GPUs; this machine has {have}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    sources = variants(args.candidates, BLOCKS, ITEMS)
    result: dict[str, Any] = {"arms": []}
    with tempfile.TemporaryDirectory(prefix="kf-multi-gpu-") as tmp:
        work = Path(tmp)
        task = task_file(work, args.batch)
        for n in arms:
            r = arm(sources, n, work, task, args.timeout)
            result["arms"].append(r)
            (args.out / f"gpus{n}.stderr").write_text((work / f"gpus{n}.stderr").read_text())
            (args.out / "multi_gpu.json").write_text(json.dumps(result, indent=2))
    base = next((r for r in result["arms"] if r["gpus"] == 1 and r["returncode"] == 0), None)
    for r in result["arms"]:
        ok = r["returncode"] == 0 and r["profiled_ok"] > 0
        if base is not None and ok:
            r["speedup_vs_1"] = round(r["candidates_per_min"] / base["candidates_per_min"], 3)
        busy = ", ".join("—" if b is None else f"{b:.0%}" for b in r["gpu_busy"])
        print(
            f"{r['gpus']} GPU(s) {r['device']:<24} {r['candidates']:3d} candidates "
            f"{r['wall_s']:8.1f} s {r['candidates_per_min']:7.2f}/min"
            + (f"  ×{r['speedup_vs_1']:.2f} vs 1 GPU" if "speedup_vs_1" in r else "")
            + f"  profiled per device {r.get('profiled_by_device')}  GPU busy [{busy}]"
            + ("" if ok else "  FAILED (see the arm's stderr)")
        )
        if r.get("failed_devices"):
            print(f"   failed devices: {r['failed_devices']}")
    (args.out / "multi_gpu.json").write_text(json.dumps(result, indent=2))
    two = next((r for r in result["arms"] if r["gpus"] == 2), None)
    if two is not None and "speedup_vs_1" in two:
        verdict = "meets" if two["speedup_vs_1"] >= 1.7 else "misses"
        print(f"2 GPUs / 1 GPU: {two['speedup_vs_1']:.2f}× candidates per minute ({verdict} 1.7×)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
