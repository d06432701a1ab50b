"""Trusted builds for boxed runners: the grader compiles a candidate's C++ in a box of its own.

Inside kf's runner box the shared build cache is read-only, so no candidate can put a
library under a key that another build will load (docs/sandbox.md). So that candidates
still share builds, :func:`kf.native.build` in a boxed runner asks the grader over the
runner's socket (``{"op": "build", ...}``, answered with ``{"op": "built", ...}``), and
:func:`build_native` here:

1. computes the key itself (:func:`kf.native.build_key`), from the source, flags and
   defines it was sent, and answers at once when the cache has it;
2. otherwise writes the source into a fresh folder of its own under the cache and runs
   the compiler in a *build box*: the runner box's read-only view of the system, no
   network, uid 65534, an allow-listed environment, that folder the one writable place
   besides a tmpfs; the cache itself is read-only there too;
3. accepts only a plain file as the result and moves it to ``<key>.so``.

Whatever the compiler does (a candidate controls its flags, and ``-wrapper`` or a plugin
runs programs), its output can only ever land under the key of the very inputs it was
given: a candidate can fill the entry for its own build, never another's.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kf.evaluation import box

__all__ = ["MAX_BUILDS_PER_RUNNER", "build_native"]

#: builds one runner may ask for (a candidate that asks for more is refused)
MAX_BUILDS_PER_RUNNER = 32
_LOG = 20_000


def _failed(error: str, log: str = "") -> dict[str, Any]:
    return {"ok": False, "error": error, "log": log[-_LOG:]}


def build_native(
    source: str, flags: list[str], defines: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Build a ``kf.native`` library into the grader's cache: ``{"ok": True, "path": ...}``
    or ``{"ok": False, "error": ..., "log": ...}`` (the compiler's output)."""
    from kf import native
    from kf.evaluation.buildlimits import build_timeout_s

    timeout_s = min(float(timeout_s), build_timeout_s())  # the runner asks; kf's limit caps
    try:
        key, cxx, argv = native.build_key(source, flags=flags, defines=defines)
    except native.NativeCompileError as exc:
        return _failed(str(exc).splitlines()[0], exc.log)
    root = native.cache_dir()
    lib = root / f"{key}.so"
    if lib.exists():
        return {"ok": True, "path": str(lib), "cached": True}
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return {"ok": True, "path": str(lib), "cached": True}
        work = Path(tempfile.mkdtemp(dir=root, prefix=f"{key}.build-"))
        try:
            return _compile(source, cxx, argv, work, lib, timeout_s)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _compile(
    source: str, cxx: str, argv: list[str], work: Path, lib: Path, timeout_s: float
) -> dict[str, Any]:
    src, out = work / "kernel.cpp", work / "kernel.so"
    src.write_text(source)
    scratch = Path(tempfile.gettempdir()) / "kf-build"  # inside the box only (a tmpfs)
    prefix = box.command(
        python=sys.executable,
        scratch=scratch,
        log_path=None,
        env=box.environment(os.environ, scratch, {}),
        rw_paths=(str(work),),
    )
    try:
        done = subprocess.run(
            [*prefix, "--", cxx, *argv, str(src), "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env={"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"},
        )
    except subprocess.TimeoutExpired:
        return _failed(f"{cxx} timed out after {timeout_s:.0f}s")
    if done.returncode != 0:
        return _failed(f"{cxx} exited with status {done.returncode}", done.stderr + done.stdout)
    try:
        made = os.lstat(out)
    except OSError:
        return _failed(f"{cxx} wrote no library", done.stderr + done.stdout)
    if not stat.S_ISREG(made.st_mode):
        return _failed("the build's output is not a plain file", done.stderr + done.stdout)
    os.chmod(out, 0o644)
    os.replace(out, lib)
    return {"ok": True, "path": str(lib), "cached": False}
