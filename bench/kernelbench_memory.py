"""Peak GPU memory of `kf eval` beside KernelBench's own protocol, on the same task files.

For each KernelBench task file given, the candidate is the reference itself rewritten as
``ModelNew`` (``class ModelNew(Model): pass``: correct by construction, so the run shows
the harness and not a kernel). Two evaluations, one after the other on an idle GPU:

1. **KernelBench's protocol**, in one process as KernelBench's ``eval_kernel_against_ref``
   does it: seed, ``Model(*get_init_inputs())`` and ``ModelNew(...)`` on the GPU, then 5
   correctness trials (fresh ``get_inputs()`` on the GPU, both models called, outputs
   compared with ``torch.allclose(atol=rtol=1e-2)``) and 100 timed calls of ``ModelNew``.
2. **`kf eval TASK CANDIDATE --device cuda:0 --json`** as a user runs it (boxed runners;
   compile, 5 verification trials, the generalisation gate, the profile).

The device's used memory (``nvidia-smi --query-gpu=memory.used``, every 0.1 s, minus the
idle figure measured just before) is sampled during each; the peak is what is reported,
as both count every process and the CUDA contexts alike.

    python bench/kernelbench_memory.py ../shared/kernelbench/level1/23_Softmax.py ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

KERNELBENCH_PROTOCOL = r"""
import importlib.util, sys, time, torch
spec = importlib.util.spec_from_file_location("task", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
class ModelNew(m.Model):
    pass
torch.manual_seed(42)
init = [x.cuda() if isinstance(x, torch.Tensor) else x for x in m.get_init_inputs()]
model = m.Model(*init).cuda()
torch.manual_seed(42)
new = ModelNew(*init).cuda()
ok = True
with torch.no_grad():
    for trial in range(5):
        torch.manual_seed(trial)
        inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in m.get_inputs()]
        out = model(*inputs)
        got = new(*inputs)
        ok = ok and torch.allclose(out, got, atol=1e-2, rtol=1e-2)
        del out, got
    torch.cuda.synchronize()
    times = []
    for _ in range(100):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); new(*inputs); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
print("correct", ok, "mean_ms", sum(times) / len(times),
      "max_reserved_gb", torch.cuda.max_memory_reserved() / 1e9)
"""


def used_mb() -> float:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[0])


def per_process_mb() -> dict[int, float]:
    """Device memory each process holds now (``--query-compute-apps``), by pid."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits",
         "-i", "0"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    held: dict[int, float] = {}
    for line in out.stdout.strip().splitlines():
        try:
            pid, mb = (part.strip() for part in line.split(","))
            held[int(pid)] = float(mb)
        except ValueError:
            continue
    return held


def _role(pid: int) -> str:
    """A process's role, from its command line (a kf runner says which it is)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(a.decode("utf-8", "replace") for a in argv if a)
    return text[-120:]


def sampled(
    cmd: list[str], timeout: float, env: dict[str, str]
) -> tuple[float, float, str, int, dict[str, float]]:
    """(peak MB above idle, seconds, stdout and log, exit code, peak MB per process) of
    one command; the processes are named by their command lines' ends."""
    idle = used_mb()
    peak = [idle]
    procs: dict[int, float] = {}
    roles: dict[int, str] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], used_mb())
            for pid, mb in per_process_mb().items():
                if mb > procs.get(pid, 0.0):
                    procs[pid] = mb
                    roles.setdefault(pid, _role(pid))
            time.sleep(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.monotonic()
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False
        )
        out, rc = done.stdout + "\n--- log ---\n" + done.stderr[-4000:], done.returncode
    except subprocess.TimeoutExpired as exc:
        # what kf said before it was stopped (its log, at INFO): where the time went
        said = [
            (x.decode("utf-8", "replace") if isinstance(x, bytes) else x or "")
            for x in (exc.stdout, exc.stderr)
        ]
        out, rc = f"timed out after {timeout:.0f} s: {said[0][-1000:]}\n{said[1][-3000:]}", 124
    seconds = time.monotonic() - start
    stop.set()
    t.join()
    by_process = {f"{pid} {roles.get(pid, '?')}": mb for pid, mb in procs.items()}
    return peak[0] - idle, seconds, out, rc, by_process


def request_peaks(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """From a ``kf eval --request-log``'s rows: per runner pid, per request op, the most
    that runner's allocator reserved during such a request (MB)."""
    peaks: dict[str, dict[str, float]] = {}
    for r in rows:
        if not r["peak_mb"]:
            continue
        ops = peaks.setdefault(str(r["pid"]), {})
        ops[r["op"]] = max(ops.get(r["op"], 0.0), r["peak_mb"])
    return peaks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("tasks", nargs="+", type=Path)
    ap.add_argument("--timeout", type=float, default=300.0, help="per evaluation")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    # kf at INFO: a kf eval stopped by --timeout still shows which stage it was in
    level = os.environ.get("KF_LOG_LEVEL", "INFO")
    env = dict(os.environ, PYTHONUNBUFFERED="1", KF_LOG_LEVEL=level)
    rows = []
    for task in args.tasks:
        kb_mb, kb_s, kb_out, kb_rc, _ = sampled(
            [sys.executable, "-c", KERNELBENCH_PROTOCOL, str(task)], args.timeout, env
        )
        with tempfile.TemporaryDirectory() as tmp:
            cand = Path(tmp) / "candidate.py"
            cand.write_text(task.read_text() + "\n\nclass ModelNew(Model):\n    pass\n")
            requests = Path(tmp) / "requests.jsonl"
            kf_mb, kf_s, kf_out, kf_rc, kf_procs = sampled(
                [sys.executable, "-m", "kf.app.cli", "eval", str(task), str(cand), "--device",
                 "cuda:0", "--json", "--request-log", str(requests)],
                args.timeout, env,
            )  # fmt: skip
            # the whole log, in order: which request held what, while which other runner
            # held what (per-op maxima alone do not say)
            log_rows = (
                [json.loads(line) for line in requests.read_text().splitlines()]
                if requests.exists()
                else []
            )
        verdict = "?"
        stages: dict[str, object] = {}
        try:
            report = kf_out.split("\n--- log ---\n")[0]  # the JSON report is kf's stdout
            result = json.loads(report[report.index("{") : report.rindex("}") + 1])
            verdict = "correct" if result["correct"] else f"failed: {result['failure_kind']}"
            if result.get("speedup"):
                verdict += f", {result['speedup']:.2f}x vs eager"
            verdict += f" (sandbox {result.get('sandbox', '?')})"
            stages = {
                k: (result.get(k) or {}).get("duration_s")
                for k in ("compile", "audit", "verify", "profile")
            }
            stages["verify_phases"] = (result.get("verify") or {}).get("phases")
            # what kf's own stage reports state: the most their runners held at once (MB,
            # the allocators' reserved bytes, CUDA contexts not counted)
            stages["peak_device_mb"] = {
                k: (result.get(k) or {}).get("peak_device_mb") for k in ("verify", "profile")
            }
        except (ValueError, KeyError):
            verdict = f"exit {kf_rc}: {kf_out.strip().splitlines()[-1:]}"
        row = {
            "task": task.stem,
            # a kf eval that did not finish: the end of what it logged
            "kf_log_tail": kf_out[-3000:],
            "kf_peak_gb_per_process": {k: round(v / 1024, 2) for k, v in kf_procs.items()},
            "kernelbench_peak_gb": kb_mb / 1024,
            "kernelbench_s": kb_s,
            "kernelbench": [ln for ln in kb_out.splitlines() if ln.startswith("correct ")]
            or [kb_rc],
            # per runner (pid) and request: the most its allocator reserved (MB, kf's own
            # figures, CUDA contexts not counted), from `kf eval --request-log`
            "kf_request_peaks_mb": request_peaks(log_rows),
            "kf_request_log": log_rows,
            "kf_peak_gb": kf_mb / 1024,
            "kf_s": kf_s,
            "ratio": kf_mb / kb_mb if kb_mb > 0 else None,
            "kf": verdict,
            "kf_stage_s": stages,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| task | KernelBench protocol peak GB | kf eval peak GB | ratio | kf verdict | kf s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "?"
        print(
            f"| {r['task']} | {r['kernelbench_peak_gb']:.1f} | {r['kf_peak_gb']:.1f} | {ratio} | "
            f"{r['kf']} | {r['kf_s']:.0f} |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
