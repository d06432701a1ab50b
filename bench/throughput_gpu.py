"""Candidates judged per minute on one GPU: `kf run` on KernelBench level-1 tasks, scripted model.

What it does: writes the chosen level-1 task files from a KernelBench checkout into a
folder, at KernelBench's original ("v0") sizes by default (``batch_size = 16``,
``dim = 16384``; ``--real-sizes`` keeps the checkout's), starts the *scripted*
OpenAI-compatible server (tests/llm_server.py) with a responder that answers every
request, first generation and mutation alike, with a new CUDA ``load_inline`` module for
the task: an elementwise kernel written by kf's developers (not by a model), in the
layout kf's prompt asks for (``--layout split``: kernels in ``cuda_sources`` without
torch headers, the torch wrapper in ``cpp_sources``) or KernelBench's usual one
(``--layout torch``: everything in ``cuda_sources`` under ``#include
<torch/extension.h>``). Every answer differs in its kernel (block size, items per
thread, grid cap) and in its wrapper (a check message naming the variant), so each
candidate is a full build of both files: nothing is served from a cache. Then

    kf run FOLDER --device cuda:0 --llm-url <scripted> --model scripted --budget B
           --init I --max-in-flight M --tune-budget 0

while ``nvidia-smi`` samples the GPU's utilisation every 500 ms. From the run's log it
prints and writes to ``OUT/throughput_gpu.json``: candidates per minute (final verdicts
over the span from the first candidate's assignment to the last verdict), how each
candidate ended, the median and spread of the ``load_inline`` build times (kf's own
``kf.cuda.inline: ... built in Xs`` lines in each compile report), the phases kf
recorded per stage, the run summary (``kf.app.run_stats``) and the GPU's mean utilisation
over the same span, and the host's CPU-seconds by kind of process over the whole run
(bench/host_cpu.py: nvcc, the C++ compiler, boxed runners, inductor's workers, ...).

    python bench/throughput_gpu.py --kernelbench shared-kb/kb/level1 --out OUT
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from host_cpu import HostCpu

from kf.app.run_stats import run_stats
from kf.events import decode_event
from kf.log import EventLog
from tests.llm_server import ScriptedServer
from tests.scripted_answers import user_text

#: task stem -> (the elementwise expression of ``v``, constructor arguments)
OPS: dict[str, tuple[str, str]] = {
    "19_ReLU": ("fmaxf(v, 0.0f)", ""),
    "20_LeakyReLU": ("v > 0.0f ? v : 0.01f * v", ""),
    "21_Sigmoid": ("1.0f / (1.0f + expf(-v))", ""),
    "22_Tanh": ("tanhf(v)", ""),
    "25_Swish": ("v / (1.0f + expf(-v))", ""),
    "26_GELU_": ("0.5f * v * (1.0f + erff(v * 0.70710678118654752f))", ""),
    "27_SELU_": (
        "1.0507009873554805f * (v > 0.0f ? v : 1.6732632423543772f * expm1f(v))",
        "",
    ),
    "28_HardSigmoid": ("fminf(fmaxf(v / 6.0f + 0.5f, 0.0f), 1.0f)", ""),
    "29_Softplus": ("v > 20.0f ? v : log1pf(expf(v))", ""),
    "30_Softsign": ("v / (1.0f + fabsf(v))", ""),
    "31_ELU": ("v > 0.0f ? v : alpha * expm1f(v)", "alpha"),
    "32_HardTanh": ("fminf(fmaxf(v, -1.0f), 1.0f)", ""),
}
_TASK = re.compile(r"^#+ Task `([^`]+)`", re.MULTILINE)
_BUILT = re.compile(r"kf\.cuda\.inline: \S+ \S+ built in ([0-9.]+)s")
#: a build's report line and its note on how ``cuda.cu`` was built (kf.cuda.inline)
_BUILT_NOTE = re.compile(r"kf\.cuda\.inline: \S+ \S+ built in [0-9.]+s([^\n\\]*)")


def prelude_of(note: str) -> str:
    """How ``cuda.cu`` was built, from a report line's note (``cuda_prelude``)."""
    for words, prelude in (
        ("it did not build split", "split-fallback"),
        ("(split:", "split"),
        ("it did not build without it", "torch-fallback"),
        ("without PyTorch's", "none"),
    ):
        if words in note:
            return prelude
    return "torch"


_KERNEL = r"""
__global__ void ew_kernel(const float* __restrict__ x, float* __restrict__ y, long long n,
                          float alpha) {
    const long long stride = (long long)gridDim.x * blockDim.x * ITEMS;
    for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * ITEMS; i < n;
         i += stride) {
#pragma unroll
        for (int k = 0; k < ITEMS; ++k) {
            const long long j = i + k;
            if (j < n) {
                const float v = x[j];
                y[j] = EXPR;
            }
        }
    }
}

void ew_launch(const float* x, float* y, long long n, float alpha, cudaStream_t stream) {
    long long blocks = (n + BLOCK * ITEMS - 1) / (BLOCK * ITEMS);
    if (blocks > CAP) blocks = CAP;
    if (blocks < 1) blocks = 1;
    if (n > 0) ew_kernel<<<(unsigned)blocks, BLOCK, 0, stream>>>(x, y, n, alpha);
}
"""

_WRAPPER = r"""
void ew_launch(const float* x, float* y, long long n, float alpha, cudaStream_t stream);

torch::Tensor ew_cuda(torch::Tensor x, double alpha) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32,
                "VARIANT: x must be a float32 CUDA tensor");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    ew_launch(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel(), (float)alpha,
              c10::cuda::getCurrentCUDAStream());
    return y;
}
"""


def module(task: str, variant: int, layout: str) -> str:
    """A distinct load_inline module for ``task``: its ``variant``-th configuration."""
    expr, init = OPS[task]
    block, items, cap = list(itertools.product((128, 256, 512, 1024), (1, 2, 4), (264, 1056)))[
        variant % 24
    ]
    tag = f"{task} v{variant} b{block} i{items} c{cap}"
    kernel = (
        _KERNEL.replace("EXPR", expr)
        .replace("ITEMS", str(items))
        .replace("BLOCK", str(block))
        .replace("CAP", str(cap))
    )
    wrapper = _WRAPPER.replace("VARIANT", tag)
    heads = "#include <torch/extension.h>\n#include <c10/cuda/CUDAStream.h>\n"
    if layout == "split":
        cuda, cpp = "#include <cuda_runtime.h>\n" + kernel, heads + wrapper
    else:  # KernelBench's usual layout: everything under torch/extension.h in the .cu
        cuda = heads + kernel + wrapper
        cpp = "torch::Tensor ew_cuda(torch::Tensor x, double alpha);"
    ctor = (
        "    def __init__(self, alpha: float = 1.0) -> None:\n"
        "        super().__init__()\n        self.alpha = alpha\n"
        if init
        else "    def __init__(self) -> None:\n        super().__init__()\n"
        "        self.alpha = 1.0\n"
    )
    return f'''import torch
from torch import nn
from torch.utils.cpp_extension import load_inline

# {tag}
cuda_source = r"""{cuda}"""
cpp_source = r"""{cpp}"""

ext = load_inline(
    name="kf_tp_{task.lower()}_{variant}",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["ew_cuda"],
    extra_cuda_cflags=["-O3"],
    verbose=False,
)


class ModelNew(nn.Module):
{ctor}
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ext.ew_cuda(x, self.alpha)
'''


class Responder:
    """Answers each request with the next variant of the task's module; prompt-region
    rewrites get a one-line region. Counts what it answered."""

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.lock = threading.Lock()
        self.count: dict[str, int] = {}

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        text = user_text(body)
        if "Rewrite ONE region" in text:
            return {"content": "```\nOne pass per element; coalesced loads.\n```"}
        m = _TASK.search(text)
        task = m.group(1) if m else ""
        if task not in OPS:
            return {"content": f"I have no kernel for {task or 'this task'}."}
        with self.lock:
            n = self.count.get(task, 0)
            self.count[task] = n + 1
        return {"content": f"```python\n{module(task, n, self.layout)}```\n"}


def write_tasks(kernelbench: Path, folder: Path, tasks: list[str], real_sizes: bool) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name in tasks:
        text = (kernelbench / f"{name}.py").read_text()
        if not real_sizes:  # KernelBench's original sizes
            text = re.sub(r"^batch_size = \d+$", "batch_size = 16", text, flags=re.M)
            text = re.sub(r"^dim = \d+$", "dim = 16384", text, flags=re.M)
        (folder / f"{name}.py").write_text(text)


class GpuSampler:
    """``nvidia-smi`` utilisation every 500 ms, with this process's monotonic times."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.proc: subprocess.Popen[str] | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                [
                    *("nvidia-smi", "--query-gpu=utilization.gpu"),
                    *("--format=csv,noheader,nounits", "-lms", "500"),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            self.thread.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip().split(",")[0])))
            except ValueError:
                continue

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def mean(self, start: float, end: float) -> float | None:
        inside = [u for t, u in self.samples if start <= t <= end]
        return statistics.mean(inside) / 100 if inside else None


def analyse(db: Path) -> dict[str, Any]:
    """Per candidate: its end, its build time; the verdicts' span; the stages' phases."""
    ends: dict[str, str] = {}
    assigned: dict[str, float] = {}
    done: dict[str, float] = {}
    builds: list[float] = []
    preludes: list[str] = []
    phases: dict[str, dict[str, float]] = {}
    envelopes = []
    with EventLog(db, readonly=True) as log:
        for env in log.read():
            envelopes.append(env)
            if not env.type.startswith(("kernel.candidate_", "search.candidate_assigned")):
                continue
            event = decode_event(env)
            cid = str(getattr(event, "candidate_id", ""))
            if env.type == "search.candidate_assigned":
                assigned.setdefault(cid, env.time)
                continue
            text = json.dumps(_builtins(event))
            builds += [float(s) for s in _BUILT.findall(text)]
            preludes += [prelude_of(note) for note in _BUILT_NOTE.findall(text)]
            for stage_phases in re.findall(r'"phases": (\{[^{}]*\})', text):
                bucket = phases.setdefault(env.type, {})
                for k, v in json.loads(stage_phases).items():
                    if isinstance(v, int | float):
                        bucket[k] = bucket.get(k, 0.0) + float(v)
            final = env.type in ("kernel.candidate_profiled", "kernel.candidate_rejected") or (
                env.type == "kernel.candidate_compiled" and '"ok": false' in text
            )
            ends[cid] = env.type.removeprefix("kernel.candidate_")
            if final:
                done[cid] = env.time
    first = min(assigned.values()) if assigned else 0.0
    last = max(done.values()) if done else first
    span = max(last - first, 1e-9)
    # the rate once verdicts flow: the start (first builds, the tasks' baselines) left out
    first_done = min(done.values()) if done else last
    after_first = (len(done) - 1) / (last - first_done) * 60 if last > first_done else None
    return {
        "candidates": len(assigned),
        "final_verdicts": len(done),
        "ends": {k: sum(1 for v in ends.values() if v == k) for k in sorted(set(ends.values()))},
        "span_s": round(span, 1),
        "candidates_per_min": round(len(done) / span * 60, 2),
        "per_min_after_first_verdict": round(after_first, 2) if after_first else None,
        "first_verdict_s": round(first_done - first, 1) if done else None,
        "cuda_preludes": {p: preludes.count(p) for p in sorted(set(preludes))},
        "first_assigned": first,
        "last_verdict": last,
        "builds_s": sorted(round(b, 2) for b in builds),
        "build_median_s": round(statistics.median(builds), 2) if builds else None,
        "phases_s": {k: {p: round(s, 1) for p, s in v.items()} for k, v in phases.items()},
        "run_stats": run_stats(envelopes),
    }


def _builtins(event: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(event)


#: the runner pool's log events counted in kf run's output (``KF_LOG_LEVEL=INFO``)
RUNNER_EVENTS = (
    "reference_runner_started",
    "candidate_runner_not_kept",
    "reference_runner_dropped",
    # the counter collector's new bests that waited for its share of the device, and
    # those a newer best of their task overtook meanwhile (agents/counters.py)
    "counters_deferred",
    "counters_skipped",
)


class TurnLog:
    """The device gate's ``device_turn`` lines (kf.devices.gate): the exclusive holds by
    label (count, seconds waited, seconds held), and what the waits waited on: the
    seconds of the turns that found each kind of shared holder, or another turn, ahead of
    them (a wait behind two counts for both)."""

    def __init__(self) -> None:
        self.by_label: dict[str, dict[str, float]] = {}
        self.waited_on: dict[str, float] = {}
        self.spans: list[tuple[float, float, str]] = []  # (start, end, label) of each turn

    def add(self, line: str) -> None:
        try:
            turn = json.loads(line)
        except ValueError:
            return
        with contextlib.suppress(KeyError, ValueError):
            end = datetime.fromisoformat(turn["timestamp"].replace("Z", "+00:00")).timestamp()
            self.spans.append((end - turn["held_s"], end, turn["label"]))
        mine = self.by_label.setdefault(turn["label"], {"n": 0, "waited_s": 0.0, "held_s": 0.0})
        mine["n"] += 1
        mine["waited_s"] = round(mine["waited_s"] + turn["waited_s"], 3)
        mine["held_s"] = round(mine["held_s"] + turn["held_s"], 3)
        causes = list(turn["waited_on"]) + (["another turn"] if turn["behind_a_turn"] else [])
        for cause in causes:
            self.waited_on[cause] = round(self.waited_on.get(cause, 0.0) + turn["waited_s"], 3)

    def gaps(self) -> dict[str, Any]:
        """The stretches between the first timing turn and the last in which no turn was
        held (the hardware agent's start-up measurement left out): their sum and the
        longest five, each as (seconds after the first turn, seconds long, the label of
        the turn that ended it)."""
        spans = sorted(t for t in self.spans if t[2] != "hardware")
        if not spans:
            return {}
        first, reach, found = spans[0][0], spans[0][1], []
        for start, end, label in spans[1:]:
            if start > reach:
                found.append((round(reach - first, 1), round(start - reach, 2), label))
            reach = max(reach, end)
        longest = sorted(found, key=lambda g: -g[1])[:5]
        return {
            "first_to_last_s": round(reach - first, 1),
            "held_s": round(sum(end - start for start, end, _ in spans), 1),
            "gaps_s": round(sum(g[1] for g in found), 1),
            "longest_gaps": longest,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "by_label": self.by_label,
            "waits_by_what_was_ahead_s": self.waited_on,
            "timeline": self.gaps(),
        }


def run_counting(
    cmd: list[str], env: dict[str, str], timeout_s: float
) -> tuple[int, dict[str, int], dict[str, Any]]:
    """Run ``cmd`` (kf run) for at most ``timeout_s``, its output passed through, and
    count the :data:`RUNNER_EVENTS` and sum the timing turns (:class:`TurnLog`) in it; its
    exit status (124: stopped at the limit)."""
    counts = dict.fromkeys(RUNNER_EVENTS, 0)
    turns = TurnLog()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            for name in RUNNER_EVENTS:
                if f'"event": "{name}"' in line:
                    counts[name] += 1
            if '"event": "device_turn"' in line:
                turns.add(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = 124
    reader.join(timeout=10)
    sys.stdout.flush()
    return rc, counts, turns.summary()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernelbench", type=Path, default=ROOT.parent / "shared/kernelbench/level1")
    ap.add_argument("--tasks", default=",".join(OPS), help="comma list of task file stems")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--layout", choices=("split", "torch"), default="split")
    ap.add_argument("--real-sizes", action="store_true")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--budget", type=int, default=8, help="candidates per task")
    ap.add_argument("--init", type=int, default=2)
    ap.add_argument("--max-in-flight", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=540.0, help="kf run's wall-clock limit")
    ap.add_argument("--extra", default="", help="more kf run arguments")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in args.tasks.split(",") if t]
    folder = args.out / "throughput_tasks"
    write_tasks(args.kernelbench, folder, tasks, args.real_sizes)
    db = args.out / f"throughput_{args.layout}.db"
    for p in db.parent.glob(db.name + "*"):
        p.unlink()
    responder = Responder(args.layout)
    t0 = time.monotonic()
    cpu = HostCpu(root=os.getpid())  # this process and below: kf run, its boxes, builds
    with ScriptedServer(responder=responder) as server, GpuSampler() as gpu, cpu:
        cmd = [
            sys.executable, "-m", "kf.app.cli", "run", str(folder), "--device", args.device,
            "--llm-url", server.url, "--model", "scripted", "--budget", str(args.budget),
            "--init", str(args.init), "--max-in-flight", str(args.max_in_flight),
            "--tune-budget", "0", "--db", str(db), *args.extra.split(),
        ]  # fmt: skip
        print("$", " ".join(cmd), flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        rc, runner_events, turns = run_counting(cmd, env, args.timeout)
    wall = time.monotonic() - t0
    result = analyse(db) if db.exists() else {}
    if result:
        result["gpu_busy"] = gpu.mean(result.pop("first_assigned"), result.pop("last_verdict"))
    result["host_cpu"] = cpu.summary()
    result.update(
        exit=rc, wall_s=round(wall, 1), layout=args.layout, tasks=tasks,
        sizes="real" if args.real_sizes else "v0 (batch_size=16, dim=16384)",
        answers=responder.count, command=" ".join(sys.argv),
        # candidate runners kept from build to profile (unset: a GPU's pool size, >= 8)
        kept_runners=os.environ.get("KF_KEPT_RUNNERS"),
        runner_events=runner_events,
        device_turns=turns,
    )  # fmt: skip
    (args.out / f"throughput_gpu_{args.layout}.json").write_text(json.dumps(result, indent=2))
    print(
        f"\nkf run exit {rc} after {wall:.1f} s ({args.layout} layout; "
        f"KF_KEPT_RUNNERS={result['kept_runners'] or 'unset'})"
    )
    keys = ("candidates", "final_verdicts", "ends", "span_s", "candidates_per_min")
    for key in (*keys, "per_min_after_first_verdict", "first_verdict_s", "cuda_preludes"):
        print(f"{key}: {result.get(key)}")
    print(f"build median: {result.get('build_median_s')} s over {len(result.get('builds_s', []))}")
    print(f"GPU busy (nvidia-smi utilisation, mean over the span): {result.get('gpu_busy')}")
    print(
        "host CPU-seconds by kind of process (bench/host_cpu.py):",
        json.dumps(result["host_cpu"], indent=1),
    )
    print(
        "runner pool and counters events in kf run's log (fresh reference runners, "
        "candidate runners not kept, reference runners dropped, counters deferred and "
        "skipped):",
        json.dumps(result["runner_events"]),
    )
    print(
        "the device's exclusive turns (kf.devices.gate's device_turn lines):",
        json.dumps(result["device_turns"], indent=1),
    )
    print("phases:", json.dumps(result.get("phases_s"), indent=1))
    print("run stats:", json.dumps(result.get("run_stats"), indent=1))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
