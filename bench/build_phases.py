"""One `load_inline` build at a time, alone: how long each layout and option takes.

Builds bench/throughput_gpu.py's candidate modules for one task through kf's own
content-addressed ``load_inline`` (unboxed, in this process, ``verbose=True``), each into
a fresh cache (``KF_CACHE_DIR``) unless told to share one, and prints per build its wall
seconds and the object cache's verdict lines (which compile took how long, and whether
it had the precompiled header). Runs in order:

1. ``split`` layout, fresh cache: makes the precompiled header on the way;
2. ``split``, another variant, same cache: uses it;
3. ``split`` with ``KF_PCH=0``;
4. ``torch`` layout (kernel and wrapper in the ``.cu`` under ``torch/extension.h``).

    python bench/build_phases.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time, torch.utils.cpp_extension as ext
from kf.cuda import inline
inline.install()
sys.path.insert(0, sys.argv[2])
import throughput_gpu
source = throughput_gpu.module(sys.argv[3], int(sys.argv[4]), sys.argv[5])
start = time.perf_counter()
exec(compile(source.replace("verbose=False", "verbose=True"), "candidate", "exec"), {})
print("KF_BUILD_SECONDS", time.perf_counter() - start)
"""


def build(cache: Path, task: str, variant: int, layout: str, env: dict[str, str]) -> dict:
    """Build one module in a fresh interpreter; its seconds and verdict lines."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ROOT), str(ROOT / "bench"), task, str(variant), layout],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "KF_CACHE_DIR": str(cache), "KF_CUDA_REPORT": "1"},
        cwd=ROOT,
        check=False,
    )
    text = proc.stdout + proc.stderr
    seconds = re.findall(r"KF_BUILD_SECONDS ([0-9.]+)", text)
    return {
        "layout": layout,
        "variant": variant,
        "env": env,
        "exit": proc.returncode,
        "build_s": float(seconds[0]) if seconds else None,
        "process_s": round(time.perf_counter() - start, 2),
        "verdicts": re.findall(r"kf\.cuda\.objcache: .*", text),
        "tail": text[-1500:] if proc.returncode else "",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--task", default="19_ReLU")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shared = Path(tmp) / "shared"
        plan = [
            (shared, 0, "split", {}),
            (shared, 1, "split", {}),
            (Path(tmp) / "nopch", 2, "split", {"KF_PCH": "0"}),
            (Path(tmp) / "torch", 3, "torch", {}),
        ]
        for cache, variant, layout, env in plan:
            row = build(cache, args.task, variant, layout, env)
            rows.append(row)
            print(json.dumps(row, indent=1), flush=True)
    (args.out / "build_phases.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
