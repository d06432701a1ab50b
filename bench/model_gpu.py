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

``--seeds DIR`` (e.g. bench/seeds/decoder_block): before the run, each task whose region
class has a seed in DIR (``RMSNorm.py``, ``SiluMul.py``: bf16 CUDA kernels *written by
kf's developers, not by a model*) gets it in ``OUT/tasks/seeds/`` (bench/model_seeds.py),
and ``kf run`` runs without an LLM: kf's offline mutator proposes the seeds and tunes the
parameters they declare; a task without a seed is skipped by kf, and the patched block
keeps its own code there (cuBLAS for the projections, SDPA for the attention core). With
``--llm-url`` as well, a model starts from the seeds. The bench prints which regions got
a developer seed and which did not.

    python bench/model_gpu.py --out bench/results/model_gpu            # scripted kernels
    python bench/model_gpu.py --llm-url http://host:8000/v1 --model M  # a model's kernels
    python bench/model_gpu.py --seeds bench/seeds/decoder_block --budget 8  # developer seeds
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
sys.path.insert(0, str(ROOT / "bench"))

from model_seeds import SEED_NOTE, check_seed_dir, install_seeds, summary_lines

from tests.llm_server import ScriptedServer, echo_reference

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
    if args.seeds:  # kf's offline mutator: the developer seeds, tuned; no model at all
        return _kf(*run, env=env).returncode
    print("every task runs the scripted echo (its own reference as ModelNew; no kernel)")
    with ScriptedServer(responder=echo_reference) as server:
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
    p.add_argument(
        "--seeds",
        type=Path,
        help=f"a folder of developer seeds per region class ({SEED_NOTE}), e.g. "
        "bench/seeds/decoder_block; without --llm-url kf's offline mutator runs them",
    )
    p.add_argument("--size", choices=("tiny", "small", "full"), default="full",
                   help="DECODER_BLOCK_SIZE (default full: bf16, hidden 4096)")  # fmt: skip
    args = p.parse_args()
    try:
        if args.seeds:
            check_seed_dir(args.seeds)
    except ValueError as exc:
        print(f"model_gpu: {exc}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DECODER_BLOCK_SIZE": args.size}
    if (out / "run.db").exists():
        (out / "run.db").unlink()
    kernels = "llm" if args.llm_url else "developer seeds" if args.seeds else "scripted echo"
    steps: dict[str, Any] = {
        "scripted": not args.llm_url and not args.seeds, "kernels": kernels,
        "budget": args.budget, "size": args.size,
    }  # fmt: skip
    ex = _kf("extract", ENTRY, "-o", str(out / "tasks"), "--device", args.device,
             "--top", "6", "--min-share", "0", env=env)  # fmt: skip
    if ex.returncode != 0:
        return ex.returncode
    if args.seeds:
        try:
            installed = install_seeds(out / "tasks", args.seeds.resolve())
        except ValueError as exc:
            print(f"model_gpu: {exc}", file=sys.stderr)
            return 2
        print("\n".join(summary_lines(installed, args.seeds, llm=bool(args.llm_url))))
        steps["seeds"] = {t.task: t.seeds for t in installed}
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
