"""Does CUDA IPC cross kf's runner boxes? One boxed process exports a CUDA tensor with
kf.evaluation.runner.transport.pack, another (in its own box) opens it with unpack and checks
its sum; tried with the box's namespaces as kf sets them and with one namespace left
shared at a time, so the result names the namespace that breaks it.

    python bench/box_ipc_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kf.evaluation.grader import box

EXPORT = r"""
import sys, torch
from kf.evaluation import transport
x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
ex = transport.Exports()
sys.stdout.write(transport.pack(torch, [x], ex).hex() + "\n"); sys.stdout.flush()
sys.stdin.readline()
"""
IMPORT = r"""
import sys, torch
from kf.evaluation import transport
data = bytes.fromhex(sys.stdin.readline().strip())
(y,) = transport.unpack(torch, data)
print("sum", float(y.sum()), "expected", float((1 << 20) * ((1 << 20) - 1) / 2))
"""

NS = [
    "--unshare-user",
    "--unshare-ipc",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-uts",
    "--unshare-cgroup-try",
]


def prefix(variant: str, scratch: Path) -> list[str]:
    if variant == "unboxed":
        return []
    env = box.environment(os.environ, scratch, {})
    args = box.command(python=sys.executable, scratch=scratch, log_path=None, env=env)
    i = args.index("--unshare-all")
    shared = set(variant.removeprefix("share-").split("+")) if variant != "all" else set()
    args[i : i + 1] = [f for f in NS if f.removeprefix("--unshare-") not in shared]
    if "user" in shared:  # --uid needs a user namespace of its own
        j = args.index("--uid")
        del args[j : j + 4]
    if variant == "share-shm":
        j = args.index("/dev/shm")  # "--size N --tmpfs /dev/shm" -> "--bind /dev/shm /dev/shm"
        args[j - 3 : j + 1] = ["--bind", "/dev/shm", "/dev/shm"]
    return [*args, "--"]


def trial(variant: str) -> str:
    with tempfile.TemporaryDirectory(prefix="kf-ipc-") as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        a.mkdir()
        b.mkdir()
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        exp = subprocess.Popen(
            [*prefix(variant, a), sys.executable, "-c", EXPORT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert exp.stdout is not None and exp.stdin is not None
        line = exp.stdout.readline()
        if not line:
            return "exporter failed: " + (exp.stderr.read() if exp.stderr else "")[-400:]
        imp = subprocess.run(
            [*prefix(variant, b), sys.executable, "-c", IMPORT],
            check=False,
            input=line,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        exp.stdin.write("\n")
        exp.stdin.flush()
        exp.wait(timeout=60)
        err = [ln for ln in imp.stderr.splitlines() if "Error" in ln or "error" in ln]
        out = imp.stdout.strip() or err[-2:]
        return f"rc {imp.returncode}: {out}"


if __name__ == "__main__":
    for v in (
        "unboxed",
        "all",
        "share-pid+ipc",
        "share-pid+user",
        "share-pid+ipc+user",
        "share-shm",
    ):
        print(f"{v:12s}", trial(v), flush=True)
