"""How tensors travel between boxed runners: sealed memory files beside ``torch.save`` bytes.

One task, ``relu(x * 2 + b)`` on a ``rows × cols`` float32 input (``--mb`` sets the
size of one tensor), and one correct candidate (the same expression as ``ModelNew``).
``kf eval TASK CANDIDATE --json`` runs twice per transport, boxed as a user runs it, on
the device given (``--device``, ``cpu`` by default):

- ``KF_TENSOR_TRANSPORT=bytes``: every payload as ``torch.save`` bytes through the grader;
- the default: payloads of 1 MiB and more as sealed memory files whose descriptors the
  grader forwards (kf.evaluation.wire.shared_memory).

Printed per run: the verification's wall time (5 trials, the generalisation gate's
shapes and the three hidden input distributions) and its ``run`` phase (the candidate's
calls with their inputs and outputs moving) and ``check`` phase (the reference's
comparison), the profile's wall time, and the verdict. The torch.compile baseline is
off (``KF_COMPILE_BASELINE=0``): it is the same for both and not what is measured.

    python bench/transport.py --mb 64 --out bench/results/transport.json
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

TASK = """import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        return torch.relu(x * 2.0 + self.bias)


def get_inputs():
    return [torch.randn({rows}, {cols})]


def get_init_inputs():
    return [{cols}]
"""

#: the task's own computation as the candidate (what is timed is the transport, not a kernel)
_MODEL = TASK.partition("\n\n\ndef get_inputs")[0] + "\n"
CANDIDATE = _MODEL.replace("class Model(", "class ModelNew(")


def _run(task: Path, cand: Path, device: str, transport: str, timeout: float) -> dict[str, object]:
    env = dict(os.environ, KF_COMPILE_BASELINE="0")
    env.pop("KF_TENSOR_TRANSPORT", None)
    if transport == "bytes":
        env["KF_TENSOR_TRANSPORT"] = "bytes"
    kf = [sys.executable, "-m", "kf.app.cli"]
    start = time.monotonic()
    done = subprocess.run(
        [*kf, "eval", str(task), str(cand), "--device", device, "--json"],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )  # fmt: skip
    wall = time.monotonic() - start
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"transport": transport, "error": done.stderr[-500:], "wall_s": wall}
    verify = result.get("verify") or {}
    profile = result.get("profile") or {}
    phases = verify.get("phases") or {}
    return {
        "transport": transport,
        "correct": verify.get("correct"),
        "sandbox": verify.get("sandbox"),
        "verify_s": verify.get("duration_s"),
        "verify_run_s": phases.get("run"),
        "verify_check_s": phases.get("check"),
        "verify_make_inputs_s": phases.get("make_inputs"),
        "profile_s": profile.get("duration_s"),
        "speedup": profile.get("speedup"),
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=64.0, help="one tensor's size, MiB")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cols = 4096
    rows = max(1, int(args.mb * (1 << 20) / 4 / cols))
    rows_done: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        task, cand = Path(tmp) / "scale_relu_big.py", Path(tmp) / "candidate.py"
        task.write_text(TASK.format(rows=rows, cols=cols))
        cand.write_text(CANDIDATE)
        size = f"{rows * cols * 4 / 2**20:.0f} MiB"
        print(f"task: relu(x * 2 + b), x {rows} x {cols} float32 ({size})")
        print("| transport | verdict | box | verify s | run s | check s | profile s | wall s |")
        print("|---|---|---|---|---|---|---|---|")
        for _ in range(args.repeat):
            for transport in ("bytes", "shared memory"):
                row = _run(task, cand, args.device, transport, args.timeout)
                row.update(mb=rows * cols * 4 / 2**20, device=args.device)
                rows_done.append(row)
                if "error" in row:
                    print(f"| {transport} | error: {row['error']} |")
                    continue
                verdict = "correct" if row["correct"] else "WRONG"
                figures = " | ".join(
                    f"{row[k]:.1f}"
                    for k in ("verify_s", "verify_run_s", "verify_check_s", "profile_s", "wall_s")
                )
                print(f"| {transport} | {verdict} | {row['sandbox']} | {figures} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows_done, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
