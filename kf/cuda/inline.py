"""A content-addressed ``torch.utils.cpp_extension.load_inline`` for KernelBench candidates.

KernelBench candidates build their CUDA code with ``load_inline(name=..., cpp_sources=...,
cuda_sources=..., functions=...)``; PyTorch keys its build folder by ``name`` alone, so
two candidates that both call their extension ``elementwise_add`` rebuild each other's
code and race when built at once. :func:`load_inline` keys the build by everything that
goes into it (sources, functions, flags, PyTorch and CUDA versions, the device's
architecture), builds once into a private folder under a file lock, publishes it
atomically, and imports the finished library directly on every later call, in any
process. :func:`install` puts it in place of PyTorch's, which is what the CUDA runner
does before it imports a candidate, so candidates need no change.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["BuildRecord", "builds", "cache_key", "install", "load_inline", "uninstall"]

#: Arguments that do not change what is built.
_IGNORED = frozenset({"verbose", "build_directory", "keep_intermediates"})

_original: Callable[..., Any] | None = None


class BuildRecord(dict[str, Any]):
    """What one ``load_inline`` call did: ``name``, ``key``, ``cached``, ``seconds``."""


_BUILDS: list[BuildRecord] = []


def builds() -> tuple[BuildRecord, ...]:
    """Every ``load_inline`` call served in this process, in order."""
    return tuple(_BUILDS)


def cache_dir() -> Path:
    """``$KF_CACHE_DIR/cuda_ext`` or ``~/.cache/kf/cuda_ext``."""
    root = os.environ.get("KF_CACHE_DIR") or str(Path.home() / ".cache" / "kf")
    path = Path(root) / "cuda_ext"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _environment() -> dict[str, Any]:
    import torch

    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch is None and torch.cuda.is_available():
        arch = ".".join(str(v) for v in torch.cuda.get_device_capability())
    return {
        "torch": str(torch.__version__),
        "cuda": str(torch.version.cuda),
        "arch": arch,
        "python": sys.version.split()[0],
        "cxx": os.environ.get("CXX", "c++"),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return repr(value)


def cache_key(arguments: dict[str, Any], environment: dict[str, Any]) -> str:
    """The build's content address: every argument that shapes the build, and the toolchain."""
    material = {k: v for k, v in arguments.items() if k not in _IGNORED}
    blob = json.dumps({"args": _jsonable(material), "env": _jsonable(environment)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _module_name(name: str, key: str) -> str:
    safe = re.sub(r"\W", "_", name) or "ext"
    return f"{safe}_{key[:16]}"


def _import(module_name: str, library: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the extension library {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[module_name] = module
    return module


def load_inline(*args: Any, **kwargs: Any) -> Any:
    """Same signature and result as PyTorch's ``load_inline``, built once per content."""
    import torch.utils.cpp_extension as ext

    original: Callable[..., Any] = _original or ext.load_inline
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if not arguments.get("is_python_module", True):
        return original(*args, **kwargs)  # a torch.ops library: leave it to PyTorch
    start = time.perf_counter()
    key = cache_key(arguments, _environment())
    module_name = _module_name(str(arguments["name"]), key)
    root = cache_dir()
    final = root / key
    library = final / f"{module_name}.so"
    cached = library.exists()
    if not cached:
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = library.exists()
            if not cached:
                work = root / f"{key}.build-{os.getpid()}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir()
                arguments.update(name=module_name, build_directory=str(work))
                original(**arguments)  # builds and imports from the work folder
                sys.modules.pop(module_name, None)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(work, final)
    module = _import(module_name, library)
    record = BuildRecord(
        name=str(bound.arguments["name"]),
        key=key,
        cached=cached,
        seconds=time.perf_counter() - start,
    )
    _BUILDS.append(record)
    if os.environ.get("KF_CUDA_REPORT"):
        how = "cache hit" if cached else "built"
        print(
            f"kf.cuda.inline: {record['name']} {key[:12]} {how} in {record['seconds']:.2f}s",
            flush=True,
        )
    return module


def install() -> None:
    """Replace ``torch.utils.cpp_extension.load_inline`` with :func:`load_inline`."""
    global _original
    import torch.utils.cpp_extension as ext

    if _original is None:
        _original = ext.load_inline
    ext.load_inline = load_inline


def uninstall() -> None:
    """Put PyTorch's own ``load_inline`` back."""
    global _original
    import torch.utils.cpp_extension as ext

    if _original is not None:
        ext.load_inline = _original
        _original = None
