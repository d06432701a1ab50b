"""The CPU fast path: C++ source → shared library by a direct compiler call, cached by content.

A candidate module embeds C++ as a string and calls :func:`build`; the library comes
back as a :class:`ctypes.CDLL`. Builds are content-addressed (source, flags, compiler,
host CPU), written atomically and guarded by a file lock, so parallel processes building
the same source compile it once.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path

from kf.settings import current

__all__ = [
    "NativeCompileError",
    "build",
    "build_key",
    "build_path",
    "cache_dir",
    "check_flags",
    "compiler_version",
    "refused_flag",
    "shared_cache",
]

DEFAULT_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c++17", "-fopenmp")


#: The compiler flags a candidate may pass (after the defaults): optimisation, debug
#: information, warnings, the language standard, machine and code-generation options,
#: macros and libraries by name. Nothing that runs another program (``-wrapper``,
#: ``-fplugin``, ``-B``, ``-specs``, ``-Wl,``/``-Wa,``/``-Wp,``, ``-X...``), reads
#: arguments from a file (``@file``), changes the system root, or names a path.
_ALLOWED_FLAG = re.compile(
    r"-O[0-3sgz]?|-Ofast|-g[0-3]?|-ggdb[0-3]?|-w|-pedantic(-errors)?|-pthread|-shared"
    r"|-std=[a-z0-9+]+|-m[a-z0-9][a-z0-9=._+-]*"
    r"|-f(?!plugin|dump|profile|auto-profile|record|opt-info|save-optimization|stack-usage"
    r"|callgraph-info|[a-z-]*prefix-map|diagnostics)[a-z0-9][a-z0-9=._,+-]*"
    r"|-W(?![lap],)[a-z][a-z0-9=._+-]*|-[DU][A-Za-z_][A-Za-z0-9_]*(=[^/@\s]*)?|-l[A-Za-z0-9_+.-]+"
)
_DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_flags(flags: Sequence[str], defines: Mapping[str, object] | None = None) -> None:
    """Refuse a compiler flag that is not on the allow-list, or a macro name that is not an
    identifier, with :class:`NativeCompileError` saying which (one line)."""
    for flag in flags:
        if not isinstance(flag, str) or not _ALLOWED_FLAG.fullmatch(flag) or refused_flag(flag):
            raise NativeCompileError(
                f"kf.native: refusing compiler flag {flag!r}: only optimisation, warning, "
                "-std, -m, -f (no plugins or dumps), -D/-U and -l flags are allowed "
                "(nothing that runs a program, names a path or reads @file)",
                "",
            )
    for name in defines or {}:
        if not _DEFINE_NAME.fullmatch(str(name)):
            raise NativeCompileError(f"kf.native: refusing macro name {str(name)!r}", "")


#: What no build flag may do, ``load_inline``'s (g++ and nvcc) included: run another
#: program, load a plugin, read options from a file or change the system root.
_REFUSED = re.compile(
    r"-?-wrapper|-B.*|-i?prefix.*|-fplugin.*|--?sysroot.*|-i?sysroot.*|--?specs.*|@.*"
    r"|.*-plugin.*|-ccbin.*|--compiler-bindir.*|-optf.*|--options-file.*|-Xnvlink.*"
)


def refused_flag(flag: str) -> str | None:
    """Why a build flag (g++ or nvcc; each ``,``- or ``=``-separated part of it too, as
    in ``-Wl,...`` or ``-Xcompiler=...``) is refused, or None."""
    for part in (flag, *re.split(r"[,=]", flag)):
        if _REFUSED.fullmatch(part.strip()):
            return (
                f"refusing build flag {flag!r}: it runs a program, loads a plugin or reads a file"
            )
    return None


class NativeCompileError(RuntimeError):
    """The C++ compiler rejected a kernel; ``log`` holds its full output."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n{log}")
        self.log = log


def cache_dir() -> Path:
    """The build cache: ``$KF_CACHE_DIR/native`` or ``~/.cache/kf/native``."""
    path = current().cache_dir / "native"
    path.mkdir(parents=True, exist_ok=True)
    return path


def shared_cache(kind: str) -> Path | None:
    """``$KF_CACHE_SHARED/<kind>``: in kf's runner box, the grader's build cache, bound
    read-only. Builds are looked up there first; a miss is built into the box's own
    ``$KF_CACHE_DIR``, so no candidate can rewrite an entry another build will load."""
    root = current().cache_shared
    return root / kind if root else None


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise NativeCompileError(
            f"C++ compiler {cxx!r} not found on PATH; install g++ or set CXX", ""
        )
    return cxx


@cache
def compiler_version(cxx: str | None = None) -> str:
    """First line of ``CXX --version`` (part of the cache key)."""
    out = subprocess.run(
        [cxx or _compiler(), "--version"], capture_output=True, text=True, check=False
    )
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


@cache
def _host_id() -> str:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                model += line
    except OSError:
        pass
    return f"{platform.machine()}|{model}"


#: Set by kf's runner inside its box (``$KF_BUILD_SERVICE``): builds a library through
#: the grader (``(source, flags, defines, timeout_s) -> path``), which compiles it in a
#: box of its own and stores it in the shared cache under the key it computed itself
#: (kf.evaluation.grader.builds); raises :class:`NativeCompileError`.
remote_builder: Callable[[str, list[str], dict[str, str], float], str] | None = None


def build_key(
    source: str,
    *,
    flags: Sequence[str] = (),
    defines: Mapping[str, object] | None = None,
) -> tuple[str, str, list[str]]:
    """A build's content address, its compiler and the compiler's arguments (without
    the source and output paths)."""
    check_flags(flags, defines)
    cxx = _compiler()
    argv = [*DEFAULT_FLAGS, *(f"-D{k}={v}" for k, v in sorted((defines or {}).items())), *flags]
    key_material = "\0".join([source, *argv, compiler_version(cxx), _host_id()])
    return hashlib.sha256(key_material.encode()).hexdigest()[:32], cxx, argv


def build(
    source: str,
    *,
    flags: Sequence[str] = (),
    defines: Mapping[str, object] | None = None,
    timeout_s: float | None = None,
) -> ctypes.CDLL:
    """Compile ``source`` into a shared library (or reuse the cached one) and load it.

    ``defines`` become ``-DNAME=VALUE``; ``flags`` are appended after the defaults.
    ``timeout_s`` None is the build limit (``$KF_BUILD_TIMEOUT_S``, default 600 s).
    Raises :class:`NativeCompileError` with the compiler's output when it fails.
    """
    return ctypes.CDLL(str(build_path(source, flags=flags, defines=defines, timeout_s=timeout_s)))


def build_path(
    source: str,
    *,
    flags: Sequence[str] = (),
    defines: Mapping[str, object] | None = None,
    timeout_s: float | None = None,
) -> Path:
    """Like :func:`build` but return the library's path without loading it."""
    from kf.buildlimits import build_timeout_s

    timeout_s = build_timeout_s(timeout_s)
    key, cxx, argv = build_key(source, flags=flags, defines=defines)
    shared = shared_cache("native")
    if shared is not None and (shared / f"{key}.so").exists():
        return shared / f"{key}.so"
    if remote_builder is not None:  # in kf's runner box: the grader builds it
        fields = {str(k): str(v) for k, v in (defines or {}).items()}
        return Path(remote_builder(source, list(flags), fields, timeout_s))
    root = cache_dir()
    lib = root / f"{key}.so"
    if lib.exists():
        return lib
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src = Path(tmp) / "kernel.cpp"
            src.write_text(source)
            out = Path(tmp) / "kernel.so"
            from kf.capture import run_capped

            code, log = run_capped([cxx, *argv, str(src), "-o", str(out)], timeout_s=timeout_s)
            if code is None:
                raise NativeCompileError(f"{cxx} timed out after {timeout_s:.0f}s", log)
            if code != 0:
                raise NativeCompileError(f"{cxx} exited with status {code}", log)
            os.replace(out, lib)
    return lib
