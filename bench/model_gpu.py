"""The example decoder block end to end on a GPU (issue 45): extract, run, export, check.

1. ``kf extract examples/models/decoder_block.py:build -o OUT/tasks --device cuda:0
   --top 6 --min-share 0`` (``DECODER_BLOCK_SIZE=full``: bf16, hidden 4096, 32 heads, MLP
   11008, batch 1, sequences 2048 and 1024);
2. ``kf run OUT/tasks --device cuda:0 --budget B``: with ``--llm-url`` and ``--model``
   a real model writes the kernels; without, the *scripted* model server
   (tests/llm_server.py, answers written by kf's developers, not by a model) answers each
   task with its own reference as ``ModelNew``, so the kernels are PyTorch's own ops and
   what is measured is the machinery (dispatch, fallbacks, the check), not a search;
3. ``kf export OUT/run.db --model OUT/tasks/manifest.json -o OUT/kf_patch.py
   --min-speedup X`` (default 1.0: only kernels kf verified faster than eager);
4. ``kf check-model examples/models/decoder_block.py:build --patch OUT/kf_patch.py
   --device cuda:0 -o OUT/check.json``: the patched block against the original on its two
   inputs and seven unseen sets (numerics rule of a candidate, bf16), and per example
   input the end-to-end time of eager, ``torch.compile`` and the patched block (CUDA
   events around one forward, L2 flushed before each sample, rounds in turn), each
   region's share of the gain, and the fallbacks;
5. prints the check (``kf report OUT/check.json``) and writes OUT/model_gpu.json.

    python bench/model_gpu.py --out bench/results/model_gpu            # scripted kernels
    python bench/model_gpu.py --llm-url http://host:8000/v1 --model M  # a model's kernels
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.llm_server import ScriptedServer
from tests.test_extract import _echo_reference

ENTRY = "examples/models/decoder_block.py:build"


def _kf(*args: str, env: dict[str, str], timeout: float = 7200) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kf.app.cli", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    print(f"$ kf {' '.join(args)}  [{time.monotonic() - t0:.0f} s, exit {proc.returncode}]")
    print(proc.stdout[-6000:], end="")
    if proc.stderr.strip():
        print(proc.stderr[-3000:], end="", file=sys.stderr)
    return proc


def _run(args: argparse.Namespace, out: Path, env: dict[str, str]) -> int:
    run = ["run", str(out / "tasks"), "--device", args.device, "--budget", str(args.budget)]
    run += ["--db", str(out / "run.db")]
    if args.llm_url:
        return _kf(*run, "--llm-url", args.llm_url, "--model", args.model, env=env).returncode
    with ScriptedServer(responder=_echo_reference) as server:
        return _kf(*run, "--llm-url", server.url, "--model", "scripted", env=env).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/model_gpu")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--budget", type=int, default=2)
    p.add_argument("--min-speedup", type=float, default=1.0)
    p.add_argument("--llm-url", default="")
    p.add_argument("--model", default="")
    p.add_argument("--time-s", type=float, default=0.5)
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DECODER_BLOCK_SIZE": "full"}
    if (out / "run.db").exists():
        (out / "run.db").unlink()
    steps: dict[str, Any] = {"scripted": not args.llm_url, "budget": args.budget}
    ex = _kf("extract", ENTRY, "-o", str(out / "tasks"), "--device", args.device,
             "--top", "6", "--min-share", "0", env=env)  # fmt: skip
    if ex.returncode != 0:
        return ex.returncode
    if _run(args, out, env) != 0:
        return 1
    _kf("report", str(out / "run.db"), env=env)
    manifest = str(out / "tasks/manifest.json")
    exp = _kf("export", str(out / "run.db"), "--model", manifest, "-o", str(out / "kf_patch.py"),
              "--min-speedup", str(args.min_speedup), env=env)  # fmt: skip
    steps["export"] = exp.stdout.strip() or exp.stderr.strip()
    if exp.returncode != 0:
        (out / "model_gpu.json").write_text(json.dumps(steps, indent=2) + "\n")
        return exp.returncode
    chk = _kf("check-model", ENTRY, "--patch", str(out / "kf_patch.py"), "--device", args.device,
              "-o", str(out / "check.json"), "--time-s", str(args.time_s), env=env)  # fmt: skip
    if (out / "check.json").exists():
        check = json.loads((out / "check.json").read_text())
        steps["gains"] = check["gains"]
        steps["fallbacks"] = check["fallbacks"]
        steps["passed"] = check["passed"]
    (out / "model_gpu.json").write_text(json.dumps(steps, indent=2) + "\n")
    return chk.returncode


if __name__ == "__main__":
    sys.exit(main())
