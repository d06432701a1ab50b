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

The extension's module name (``TORCH_EXTENSION_NAME``) comes from a narrower *binding
key*: only what shapes ``main.cpp`` and its compile command (``name``, ``cpp_sources``,
``functions``, ``extra_cflags``, ...), not ``cuda_sources``. Candidates that differ only
in their kernel therefore compile a byte-identical ``main.cpp`` with identical flags, and
the object cache (:mod:`kf.cuda.objcache`), which builds run through, compiles it once
for all of them. Libraries that share a module name import side by side, each under its
own ``sys.modules`` name.

CUDA sources that name nothing of torch are first built without the
``#include <torch/types.h>`` PyTorch puts in front of them (:mod:`kf.cuda.torchfree`,
``$KF_TORCHFREE``), and PyTorch's way if that fails; sources in KernelBench's usual
layout (the ``torch::Tensor`` wrapper in ``cuda_sources`` too) are first built split,
their kernels so and their host code in ``main.cpp`` (:mod:`kf.cuda.torchsplit`, the
same switch). The key says which was tried (:func:`variant`), the build folder's
``kf-build.json`` and :class:`BuildRecord` which was used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kf.cuda import torchfree, torchsplit
from kf.settings import current

__all__ = [
    "BuildRecord",
    "binding_key",
    "builds",
    "cache_dir",
    "cache_key",
    "cache_root",
    "install",
    "literal_arguments",
    "load_inline",
    "pch_arguments",
    "pch_key",
    "pch_wanted",
    "pytorch_load_inline",
    "record_build",
    "replay_verdicts",
    "sources_given",
    "uninstall",
    "variant",
    "variant_arguments",
    "write_build",
]

#: Arguments that do not change what is built.
_IGNORED = frozenset({"verbose", "build_directory", "keep_intermediates"})

#: Arguments that reach neither ``main.cpp`` nor its compile command: only the other
#: sources' compiles and the link. Every other argument, including any a later PyTorch
#: adds, is in the binding key.
_NOT_IN_MAIN_CPP = frozenset(
    {"cuda_sources", "sycl_sources", "extra_cuda_cflags", "extra_sycl_cflags", "extra_ldflags"}
)

_original: Callable[..., Any] | None = None

#: Set by kf's runner inside its box (``$KF_BUILD_SERVICE``): builds an extension through
#: the grader (``(arguments, environment) -> folder``), which runs the build in a box of
#: its own, within its own build limit, and publishes it in the shared cache under the key
#: it computed itself (:func:`kf.evaluation.grader.builds.build_inline`); raises
#: ``kf.native.NativeCompileError``. Without it, each runner box would build every
#: candidate again into its own cache.
remote_builder: Callable[[dict[str, Any], dict[str, Any]], str] | None = None


class BuildRecord(dict[str, Any]):
    """What one ``load_inline`` call did: ``name``, ``key``, ``cached``, ``seconds``,
    ``torch_in_cuda`` and ``cuda_prelude``: how its ``cuda.cu`` was built, ``torch``
    (PyTorch's way, with ``#include <torch/types.h>``), ``none`` (without it,
    :mod:`kf.cuda.torchfree`), ``split`` (its kernels without it, its host code in
    ``main.cpp``: :mod:`kf.cuda.torchsplit`), ``torch-fallback`` or ``split-fallback``
    (PyTorch's way after the build without it, or split, failed) or ``""`` (no CUDA
    sources)."""


_BUILDS: list[BuildRecord] = []


def builds() -> tuple[BuildRecord, ...]:
    """Every ``load_inline`` call served in this process, in order."""
    return tuple(_BUILDS)


def cache_root() -> Path:
    """``$KF_CACHE_DIR`` or ``~/.cache/kf``: where the build caches live."""
    return current().cache_dir


def cache_dir() -> Path:
    """``$KF_CACHE_DIR/cuda_ext`` or ``~/.cache/kf/cuda_ext``."""
    path = cache_root() / "cuda_ext"
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
    """The build's content address: every argument that shapes the build, the toolchain,
    and whether its CUDA sources are first built without the torch include
    (:mod:`kf.cuda.torchfree`; such a build and PyTorch's own never share a key)."""
    material = {k: v for k, v in arguments.items() if k not in _IGNORED}
    kind = variant(arguments, pytorch_load_inline())
    if kind == "none":
        material[_TORCHFREE_KEY] = torchfree.PLACEHOLDER
    elif kind == "split":
        material[_TORCHFREE_KEY] = f"{torchfree.PLACEHOLDER} split {torchsplit.VERSION}"
    return _digest(material, environment)


#: in the key's material of a build that tries :mod:`kf.cuda.torchfree` (or
#: :mod:`kf.cuda.torchsplit`) first (not an argument name PyTorch uses)
_TORCHFREE_KEY = "kf:torchfree"


def variant(arguments: dict[str, Any], original: Callable[..., Any]) -> str | None:
    """How a call (its bound arguments) is first built without PyTorch's include in
    ``cuda.cu``: ``none`` (its CUDA sources name nothing of torch,
    :mod:`kf.cuda.torchfree`), ``split`` (KernelBench's usual layout, split,
    :mod:`kf.cuda.torchsplit`), or None (only PyTorch's way). ``original``: PyTorch's own
    ``load_inline``, whose implicit lines must be the ones kf knows."""
    if torchfree.wanted(arguments, original):
        return "none"
    if not current().torchfree or not torchfree.prelude_known(original):
        return None
    parts = torchsplit.split(arguments)
    if parts is None or not torchfree.wanted(parts.arguments(arguments), original):
        return None
    return "split"


def variant_arguments(arguments: dict[str, Any], kind: str) -> dict[str, Any]:
    """The call that builds ``arguments`` the :func:`variant` way ``kind`` says."""
    if kind == "split":
        parts = torchsplit.split(arguments)
        if parts is None:
            raise ValueError("variant_arguments: the call is not split (kf.cuda.torchsplit)")
        arguments = parts.arguments(arguments)
    return torchfree.arguments(arguments)


def _digest(material: dict[str, Any], environment: dict[str, Any]) -> str:
    blob = json.dumps({"args": _jsonable(material), "env": _jsonable(environment)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def sources_given(value: Any) -> bool:
    """Whether a ``*_sources`` argument names any source, as PyTorch decides it."""
    return bool([value] if isinstance(value, str) and value else value)


def binding_key(arguments: dict[str, Any], environment: dict[str, Any]) -> str:
    """What ``main.cpp`` and its compile command depend on: the module name comes from it.

    ``with_cuda`` and ``with_sycl`` go in as PyTorch resolves them (from whether there
    are CUDA or SYCL sources), since they pick ``main.cpp``'s include paths.
    """
    material = {
        k: v for k, v in arguments.items() if k not in _IGNORED and k not in _NOT_IN_MAIN_CPP
    }
    return _digest({**material, **_languages(arguments)}, environment)


def _languages(arguments: dict[str, Any]) -> dict[str, Any]:
    """``with_cuda`` and ``with_sycl`` as PyTorch resolves them: as given, else from
    whether there are CUDA or SYCL sources."""
    out = {}
    for flag, sources in (("with_cuda", "cuda_sources"), ("with_sycl", "sycl_sources")):
        given = arguments.get(flag)
        out[flag] = given if given is not None else sources_given(arguments.get(sources))
    return out


#: what of a ``load_inline`` call the precompiled header does not depend on: the texts
#: of ``main.cpp`` (its sources and bindings) and the name (``TORCH_EXTENSION_NAME``,
#: which PyTorch's headers do not use); every other argument that reaches ``main.cpp``
#: is in its key, including any a later PyTorch adds
_NOT_IN_PCH = frozenset({"name", "cpp_sources", "functions"})


def _pch_material(arguments: dict[str, Any]) -> dict[str, Any]:
    skip = _IGNORED | _NOT_IN_MAIN_CPP | _NOT_IN_PCH
    material = {k: v for k, v in arguments.items() if k not in skip}
    return {**material, **_languages(arguments)}


def pch_key(arguments: dict[str, Any], environment: dict[str, Any]) -> str:
    """The key of the precompiled ``torch/extension.h`` a build's ``main.cpp`` can use
    (:mod:`kf.cuda.pch`): every argument that reaches ``main.cpp``'s compile (its flags,
    ``with_cuda``, ``is_standalone``...) and the toolchain, nothing of the sources. The
    header is made from exactly these (:func:`pch_arguments`), so it is a function of
    its key."""
    return _digest({"pch": _pch_material(arguments)}, environment)


#: the module the grader's own step builds a header with (:func:`pch_arguments`)
_PCH_MODULE = "torch::Tensor kf_pch_same(torch::Tensor x) { return x; }\n"


def pch_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The ``load_inline`` call whose ``main.cpp`` compile makes the header of
    ``arguments``' key: kf's own one-function module with the call's :func:`pch_key`
    material, nothing else of the call (not its sources, CUDA flags or link flags)."""
    return {
        **_pch_material(arguments),
        "name": "kf_pch",
        "cpp_sources": _PCH_MODULE,
        "functions": ["kf_pch_same"],
    }


def pch_wanted(arguments: dict[str, Any]) -> bool:
    """Whether this build's ``main.cpp`` gets the precompiled header (``$KF_PCH``): not
    one without PyTorch's include first (``no_implicit_headers``), nor one with include
    paths of its own (what they hold is not in the key)."""
    setting = current().pch
    if setting == "off" or not current().objcache:
        return False
    if arguments.get("no_implicit_headers") or arguments.get("extra_include_paths"):
        return False
    return setting == "all" or bool(_languages(arguments)["with_cuda"])


#: the ``load_inline`` arguments PyTorch writes into ``build.ninja`` as flags, joined
#: by spaces and unquoted, for ninja to run through ``sh -c``
_FLAG_ARGUMENTS = ("extra_cflags", "extra_cuda_cflags", "extra_sycl_cflags", "extra_ldflags")
#: what no line of a ninja file can hold (nor a flag that means one argument)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab"}


def literal_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` with each flag made literal for PyTorch's ``build.ninja``: a flag's
    words (split at spaces, as the shell split them before) each reach the compiler as
    one argument, whatever characters they hold (shell-quoted, then ``$`` escaped for
    ninja); an include path is one path (PyTorch quotes it for the shell; ``$`` escaped
    here). Plain flags come out unchanged. Raises ``ValueError``, one line naming the
    argument, for what no ninja file can hold (a newline or other control character)
    or a flag that is not a string."""
    out = dict(arguments)
    for name in (*_FLAG_ARGUMENTS, "extra_include_paths"):
        value = arguments.get(name)
        if not value:
            continue
        items = [value] if isinstance(value, str) else list(value)
        for item in items:
            if not isinstance(item, str):
                raise ValueError(f"{name}: {item!r} is not a string; give flags as strings")
            bad = _CONTROL.search(item)
            if bad:
                what = _CONTROL_NAMES.get(bad.group(), f"the control character {bad.group()!r}")
                raise ValueError(
                    f"{name}: {item[:80]!r} holds {what}; a flag is literal text on one "
                    "line (its words are passed as they are, never through a shell)"
                )
        if name == "extra_include_paths":
            out[name] = [item.strip().replace("$", "$$") for item in items]
        else:
            words = [word for item in items for word in item.split(" ") if word]
            out[name] = [shlex.quote(word).replace("$", "$$") for word in words]
    return out


def extension_module_name(name: str, binding: str) -> str:
    safe = re.sub(r"\W", "_", name) or "ext"
    return f"{safe}_{binding[:16]}"


def _import(module_name: str, library: Path, key: str) -> types.ModuleType:
    """Import ``library`` under a name of its own, ``kf_ext_<key>.<module_name>``.

    Libraries that share a module name share the ``PyInit_<module_name>`` symbol, which
    is what the loader looks up (by the name's last component); each library is opened
    on its own and answers from its own symbol, so both can be loaded in one process as
    long as their ``sys.modules`` names differ.
    """
    qualified = f"kf_ext_{key}.{module_name}"
    loaded = sys.modules.get(qualified)
    if isinstance(loaded, types.ModuleType) and getattr(loaded, "__file__", None) == str(library):
        return loaded
    spec = importlib.util.spec_from_file_location(qualified, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the extension library {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[qualified] = module
    return module


@contextlib.contextmanager
def _object_cache(pch: str | None = None, log: str | None = None) -> Iterator[None]:
    """Point ``CXX`` and ``PYTORCH_NVCC`` at :mod:`kf.cuda.objcache` launchers meanwhile.

    The real compilers are the ones PyTorch would use: ``$CXX`` (else ``c++``) and
    ``$CUDA_HOME/bin/nvcc``; a ``PYTORCH_NVCC`` the user set is left alone. Nothing
    changes when ``KF_OBJCACHE=0``. ``main.cpp`` gets the precompiled header of key
    ``pch`` (:mod:`kf.cuda.pch`), made in this cache if missing, unless the grader's
    build box named the folders (``$KF_PCH_DIR``, ``$KF_PCH_MAKE``). ``log``: the file
    the launchers' verdicts go to instead of ``$KF_OBJCACHE_LOG``.
    """
    from kf.cuda import objcache

    saved = {name: os.environ.get(name) for name in ("CXX", "PYTORCH_NVCC")}
    settings = current()
    look, make = settings.pch_dir, settings.pch_make
    if look is None and make is None and pch:
        look = make = str(cache_root() / "pch" / pch)
    try:
        if objcache.enabled():
            import torch.utils.cpp_extension as ext

            cxx = shutil.which(os.environ.get("CXX", "c++"))
            cuda_home = getattr(ext, "CUDA_HOME", None)
            nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
            with contextlib.suppress(OSError):  # no cache folder: compile as PyTorch would
                if cxx is not None:
                    # PyTorch quotes it
                    os.environ["CXX"] = str(objcache.launcher(cxx, look, make, log))
                if nvcc and saved["PYTORCH_NVCC"] is None and os.access(nvcc, os.X_OK):
                    # used verbatim in the ninja file, so quoted here
                    os.environ["PYTORCH_NVCC"] = shlex.quote(str(objcache.launcher(nvcc, log=log)))
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _shared_library(key: str, module_name: str) -> Path | None:
    """The build in the read-only shared cache (``$KF_CACHE_SHARED``, in kf's runner
    box), if there is one."""
    from kf.native import shared_cache

    shared = shared_cache("cuda_ext")
    library = shared / key / f"{module_name}.so" if shared is not None else None
    return library if library is not None and library.exists() else None


def _forget_version(module_name: str) -> None:
    """Make PyTorch build ``module_name`` as itself, not as ``<module_name>_v1``.

    PyTorch counts, per process, the different builds of one extension name and appends
    ``_v<n>`` from the second; our module names are shared by builds that differ (in
    their CUDA sources), and each build has its own folder, so the count must not run.
    """
    import torch.utils.cpp_extension as ext

    versioner = getattr(ext, "JIT_EXTENSION_VERSIONER", None)
    entries = getattr(versioner, "entries", None)
    if isinstance(entries, dict):
        entries.pop(module_name, None)


def pytorch_load_inline() -> Callable[..., Any]:
    """PyTorch's own ``load_inline`` (also while :func:`install` has put kf's in its place)."""
    import torch.utils.cpp_extension as ext

    return _original or ext.load_inline


def bound_arguments(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """A ``load_inline`` call's arguments by name, PyTorch's defaults filled in (what the
    keys are computed from); raises ``TypeError`` for arguments it does not take."""
    bound = inspect.signature(pytorch_load_inline()).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def build_material(arguments: dict[str, Any]) -> dict[str, Any]:
    """What of bound ``arguments`` shapes the build, as plain data (sent to the grader)."""
    return dict(_jsonable({k: v for k, v in arguments.items() if k not in _IGNORED}))


#: written into each build's folder: how its ``cuda.cu`` was built (``cuda_prelude``)
_META = "kf-build.json"

#: the build report's words for how ``cuda.cu`` was built (read by the model)
_PRELUDE_NOTES = {
    "none": " (cuda.cu without PyTorch's #include <torch/types.h>)",
    "split": (
        " (split: the kernels in cuda.cu without PyTorch's #include <torch/types.h>, "
        "the host code in main.cpp)"
    ),
    "torch-fallback": (
        " (cuda.cu with PyTorch's #include <torch/types.h>: it did not build without it)"
    ),
    "split-fallback": (
        " (cuda.cu as written, with PyTorch's #include <torch/types.h>: it did not build split)"
    ),
}


def record_build(folder: Path, prelude: str) -> None:
    """Write into a build's ``folder`` how its ``cuda.cu`` was built (:class:`BuildRecord`'s
    ``cuda_prelude``)."""
    (folder / _META).write_text(json.dumps({"cuda_prelude": prelude}))


def _prelude_of(folder: Path, arguments: dict[str, Any]) -> str:
    """How the build in ``folder`` compiled its ``cuda.cu`` (its :data:`_META`); builds
    from before kf recorded it were PyTorch's."""
    try:
        value = json.loads((folder / _META).read_text()).get("cuda_prelude")
    except (OSError, ValueError, AttributeError):
        value = None
    if isinstance(value, str):
        return value
    return "torch" if sources_given(arguments.get("cuda_sources")) else ""


def _build(
    original: Callable[..., Any], arguments: dict[str, Any], module_name: str, pch: str | None
) -> str:
    """Build with PyTorch's ``load_inline`` into ``arguments``' build folder, first without
    the torch include where :func:`variant` says; how ``cuda.cu`` was built.

    The attempt is quiet (``verbose=False``, its warnings and object-cache verdicts held
    back) and, if it fails in any way, forgotten: the standard build then runs in the same
    folder (ninja reuses the identical ``main.o``) and what it raises is what the caller
    sees. Its verdicts and warnings are given out only when it succeeded.
    """
    kind = variant(arguments, original)
    if kind is None:
        with _object_cache(pch):
            original(**literal_arguments(arguments))  # builds and imports from the work folder
        return "torch" if sources_given(arguments.get("cuda_sources")) else ""
    fd, held = tempfile.mkstemp(prefix="kf-torchfree-", suffix=".log")
    os.close(fd)
    ok = False
    with _object_cache(pch, log=held), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(Exception):
            original(**literal_arguments(variant_arguments({**arguments, "verbose": False}, kind)))
            ok = True
    try:
        verdicts = Path(held).read_text(errors="replace")
    finally:
        os.unlink(held)
    if not ok:
        _forget_version(module_name)
        sys.modules.pop(module_name, None)
        with _object_cache(pch):
            original(**literal_arguments(arguments))
        return "split-fallback" if kind == "split" else "torch-fallback"
    replay_verdicts(verdicts, bool(arguments.get("verbose")))
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return kind


def write_build(
    arguments: dict[str, Any],
    module_name: str,
    folder: Path,
    *,
    torch_free: bool,
    pch: str | None,
    held: str | None = None,
) -> None:
    """Write into ``folder`` what the build of a ``load_inline`` call compiles: the
    sources and PyTorch's ``build.ninja``, its compilers the object cache's launchers,
    as :func:`load_inline` would build them, for the ninja to be run elsewhere.

    For a process whose PyTorch neither runs ninja nor imports the result (the grader's
    trusted writer, :mod:`kf.evaluation.grader.inline_writer`). ``arguments``: bound,
    PyTorch's defaults filled in; ``module_name``: its :func:`extension_module_name`;
    ``torch_free``: the variant without the torch include (:func:`variant`: the
    sources as they are, :mod:`kf.cuda.torchfree`, or split, :mod:`kf.cuda.torchsplit`);
    ``pch``: the precompiled header's key, None for none; ``held``: the file the
    launchers' verdicts go to instead of ``$KF_OBJCACHE_LOG``.
    """
    call = {**arguments, "name": module_name, "build_directory": str(folder)}
    if torch_free:
        # the grader chose (variant); sources that name torch can only have been split
        named = torchfree.why_not(arguments.get("cuda_sources")) is not None
        call = variant_arguments({**call, "verbose": False}, "split" if named else "none")
    _forget_version(module_name)
    with _object_cache(pch, log=held):
        pytorch_load_inline()(**literal_arguments(call))


def replay_verdicts(verdicts: str, verbose: bool) -> None:
    """Give the held verdicts where they would have gone: the log, and stderr if verbose."""
    if not verdicts:
        return
    target = current().objcache_log
    if target:
        with contextlib.suppress(OSError), open(target, "a") as log:
            log.write(verdicts)
    if verbose:
        sys.stderr.write(verdicts)
        sys.stderr.flush()


def load_inline(*args: Any, **kwargs: Any) -> Any:
    """Same signature and result as PyTorch's ``load_inline``, built once per content."""
    import torch.utils.cpp_extension as ext

    original: Callable[..., Any] = _original or ext.load_inline
    arguments = bound_arguments(*args, **kwargs)
    requested = str(arguments["name"])
    if not arguments.get("is_python_module", True):
        return original(*args, **kwargs)  # a torch.ops library: leave it to PyTorch
    start = time.perf_counter()
    environment = _environment()
    key = cache_key(arguments, environment)
    module_name = extension_module_name(str(arguments["name"]), binding_key(arguments, environment))
    root = cache_dir()
    final = root / key
    library = final / f"{module_name}.so"
    cached = library.exists()
    shared = _shared_library(key, module_name)
    if not cached and shared is None and remote_builder is not None:
        remote_builder(build_material(arguments), environment)
        shared = _shared_library(key, module_name)
        if shared is None:
            raise RuntimeError(f"the grader built {key} but {module_name}.so is not there")
        cached = False  # built now, for this call
        library = shared
    elif not cached and shared is not None:
        library, cached = shared, True
    if not cached and library != shared:
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = library.exists()
            if not cached:
                work = root / f"{key}.build-{os.getpid()}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir()
                arguments.update(name=module_name, build_directory=str(work))
                _forget_version(module_name)
                pch = pch_key(arguments, environment) if pch_wanted(arguments) else None
                prelude = _build(original, arguments, module_name, pch)
                sys.modules.pop(module_name, None)
                record_build(work, prelude)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(work, final)
    module = _import(module_name, library, key)
    record = BuildRecord(
        name=requested,
        key=key,
        cached=cached,
        seconds=time.perf_counter() - start,
        torch_in_cuda=torch_in_cuda_sources(arguments.get("cuda_sources")),
        cuda_prelude=_prelude_of(library.parent, arguments),
    )
    _BUILDS.append(record)
    if current().cuda_report:
        how = "cache hit" if cached else "built"
        print(
            f"kf.cuda.inline: {record['name']} {key[:12]} {how} in {record['seconds']:.2f}s"
            + _PRELUDE_NOTES.get(record["cuda_prelude"], ""),
            flush=True,
        )
        if record["torch_in_cuda"] and not cached and record["cuda_prelude"] != "split":
            print(_TORCH_IN_CUDA_NOTE, flush=True)
    return module


#: said in a compile report (which the model reads) when CUDA sources include torch
_TORCH_IN_CUDA_NOTE = (
    "kf.cuda.inline: note: cuda_sources include PyTorch headers, which nvcc parses three "
    "times (most of a minute-long build); kernels and a plain launcher without torch "
    "headers in cuda_sources, with the torch::Tensor wrapper in cpp_sources, build in "
    "seconds"
)
_TORCH_INCLUDE = re.compile(r"^\s*#\s*include\s*[<\"](torch|ATen|c10)/", re.MULTILINE)


def torch_in_cuda_sources(cuda_sources: Any) -> bool:
    """Whether a ``load_inline`` call's CUDA sources include PyTorch's headers."""
    texts = [cuda_sources] if isinstance(cuda_sources, str) else list(cuda_sources or [])
    return any(isinstance(t, str) and _TORCH_INCLUDE.search(t) for t in texts)


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
