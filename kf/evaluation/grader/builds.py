"""Trusted builds for boxed runners: the grader compiles a candidate's C++ in a box of its own.

Inside kf's runner box the shared build cache is read-only, so no candidate can put a
library under a key that another build will load (docs/sandbox.md). So that candidates
still share builds, :func:`kf.native.build` in a boxed runner asks the grader over the
runner's socket (:class:`~kf.evaluation.wire.protocol.BuildNative`, answered with
:class:`~kf.evaluation.wire.protocol.Built`), and
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

import contextlib
import fcntl
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kf.capture import run_capped
from kf.evaluation.grader import box
from kf.settings import current

__all__ = [
    "MAX_BUILDS_PER_RUNNER",
    "PCH_WAIT_S",
    "build_inline",
    "build_native",
    "cap_text",
    "toolchain",
]

#: builds one runner may ask for (a candidate that asks for more is refused)
MAX_BUILDS_PER_RUNNER = 32
_LOG = 20_000


def _niced(argv: list[str]) -> list[str]:
    """``argv`` run ``$KF_BUILD_NICE`` (10) lower than grading: a build's compilers yield
    the host's cores to the verifications and timings of earlier candidates, which the
    GPU waits on (where no ``nice`` is installed, at the grader's own priority)."""
    niceness = current().build_nice
    found = shutil.which("nice") if niceness > 0 else None
    return [found, "-n", str(niceness), *argv] if found else argv


def _failed(error: str, log: str = "") -> dict[str, Any]:
    return {"ok": False, "error": error, "log": cap_text(log, _LOG)}


def cap_text(text: str, limit: int) -> str:
    """``text`` cut to its first and last ``limit // 2`` characters, saying how many went."""
    if len(text) <= limit:
        return text
    half = limit // 2
    dropped = len(text) - 2 * half
    return f"{text[:half]}\n[... {dropped} characters dropped ...]\n{text[-half:]}"


def build_native(
    source: str, flags: list[str], defines: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Build a ``kf.native`` library into the grader's cache: ``{"ok": True, "path": ...}``
    or ``{"ok": False, "error": ..., "log": ...}`` (the compiler's output)."""
    from kf import native
    from kf.buildlimits import build_timeout_s

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
    boxed = box.command(
        python=sys.executable,
        scratch=scratch,
        log_path=None,
        env=box.environment(os.environ, scratch, {}),
        rw_paths=(str(work),),
        run=[cxx, *argv, str(src), "-o", str(out)],
    )
    code, log = run_capped(
        _niced(boxed),
        timeout_s=timeout_s,
        env={"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"},
    )
    if code is None:
        return _failed(f"{cxx} timed out after {timeout_s:.0f}s", log)
    if code != 0:
        return _failed(f"{cxx} exited with status {code}", log)
    try:
        made = os.lstat(out)
    except OSError:
        return _failed(f"{cxx} wrote no library", log)
    if not stat.S_ISREG(made.st_mode):
        return _failed("the build's output is not a plain file", log)
    _take(out)
    os.replace(out, lib)
    return {"ok": True, "path": str(lib), "cached": False}


#: What runs in the build box for a ``load_inline`` extension: kf's own content-addressed
#: ``load_inline``, into the build's private cache folder (``$KF_CACHE_DIR``).
_INLINE_SCRIPT = """
import json, sys
from kf.cuda import inline
inline.load_inline(**json.loads(sys.stdin.read()))
"""

#: ``TORCH_CUDA_ARCH_LIST``'s syntax: versions such as ``9.0``, ``9.0a``, ``10.0f`` or
#: ``8.6+PTX``, separated by spaces or semicolons
_ARCH = re.compile(r"[0-9]+\.[0-9]+[a-z]?(\+PTX)?([ ;][0-9]+\.[0-9]+[a-z]?(\+PTX)?)*")


def _own_toolchain() -> dict[str, Any]:
    """What :func:`kf.cuda.inline._environment` gives in this process, without touching
    the GPU (the architecture is the runner's to say; it is checked, then used)."""
    import torch

    return {
        "torch": str(torch.__version__),
        "cuda": str(torch.version.cuda),
        "python": sys.version.split()[0],
        "cxx": os.environ.get("CXX", "c++"),
    }


def toolchain(arch: str | None) -> dict[str, Any]:
    """The toolchain a runner of this grader reports (:func:`build_inline`'s
    ``environment``) for the CUDA architecture ``arch`` (None: a host without CUDA)."""
    return {**_own_toolchain(), "arch": arch}


def build_inline(
    arguments: dict[str, Any], environment: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """Build a boxed runner's ``load_inline`` extension into the grader's cache:
    ``{"ok": True, "path": <folder>}`` or ``{"ok": False, "error": ..., "log": ...}``.

    The key is computed here from the arguments and the toolchain the runner reported;
    the toolchain must be this process's own (the same interpreter and PyTorch) and the
    architecture a plain list of versions, and the build box is given exactly those, so
    whatever the build does can only land under the key of the inputs it was given.
    """
    from kf.cuda import inline

    own = _own_toolchain()
    theirs = {k: environment.get(k) for k in own}
    if theirs != own:
        return _failed(f"the runner's toolchain {theirs} is not the grader's {own}")
    arch = environment.get("arch")  # None: a host without CUDA (a C++ extension)
    if arch is not None and (not isinstance(arch, str) or not _ARCH.fullmatch(arch)):
        return _failed(f"malformed CUDA architecture {arch!r}")
    if "name" not in arguments or set(arguments) & {"build_directory", "verbose"}:
        return _failed("malformed load_inline arguments")
    refused = _refused_inline_flag(arguments)
    if refused:
        return _failed(f"load_inline: {refused}")
    try:  # the runner keys the call with PyTorch's defaults filled in: so does this
        arguments = inline.build_material(inline.bound_arguments(**arguments))
    except TypeError as exc:
        return _failed(f"malformed load_inline arguments: {exc}")
    env = {**own, "arch": arch}
    key = inline.cache_key(arguments, env)
    module_name = inline.extension_module_name(
        str(arguments["name"]), inline.binding_key(arguments, env)
    )
    root = inline.cache_dir()
    final = root / key
    if (final / f"{module_name}.so").exists():
        return {"ok": True, "path": str(final), "cached": True, "log": ""}
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / f"{module_name}.so").exists():
            return {"ok": True, "path": str(final), "cached": True, "log": ""}
        work = Path(tempfile.mkdtemp(dir=root, prefix=f"{key}.build-"))
        try:
            begun = time.monotonic()
            wait_s = min(PCH_WAIT_S, timeout_s / 2)
            with _pch_folders(arguments, env, wait_s, timeout_s / 2) as pch_env:
                left = timeout_s - (time.monotonic() - begun)  # the wait is the build's time
                return _build_inline(
                    _Build(arguments, arch, work, final, key, module_name, left, pch_env)
                )
        finally:
            shutil.rmtree(work, ignore_errors=True)


_pch_lock = threading.Lock()
_pch_making: set[str] = set()
#: per header key being made: the builds going on without it meanwhile, and those waiting
_pch_pioneers: dict[str, int] = {}
_pch_waiting: dict[str, int] = {}
#: notified when a header is made (or not), a build stops waiting, or a pioneer is done
_pch_done = threading.Condition(_pch_lock)
#: at most this long (and half the build's own limit) a build waits for the header of its
#: key that the grader's step is making, rather than compile ``torch/extension.h`` itself
#: meanwhile: a first wave of fifteen builds on the H200 took 50-67 s each that way,
#: against 16-34 s where the header was made
PCH_WAIT_S = 120.0
#: builds of a key whose header is being made that go on without it at once (the rest
#: wait): the first candidate's verdict never waits for the header (59 s on the H200),
#: and no more than this many compiles of ``torch/extension.h`` share the host with it
PCH_PIONEERS = 1


def _pch_place(arguments: dict[str, Any], env: dict[str, Any]) -> tuple[str, Path]:
    from kf.cuda import inline

    pch = inline.pch_key(arguments, env)
    return pch, inline.cache_root() / "pch" / pch


def _run_pch_step(
    pch: str, arguments: dict[str, Any], env: dict[str, Any], shared: Path, limit_s: float
) -> str:
    """:func:`_make_pch` for the key ``pch`` this thread registered as being made, then
    the key let go of and every waiting build told; why no header, or ``ok``."""
    try:
        return _make_pch(arguments, env, shared, limit_s)
    finally:
        with _pch_done:
            _pch_making.discard(pch)
            _pch_done.notify_all()


def _start_pch_step(
    pch: str, arguments: dict[str, Any], env: dict[str, Any], shared: Path, limit_s: float
) -> None:
    """The header's step in a thread of its own (``_pch_done`` held, ``pch`` not being
    made): the build that found it missing does not wait for it."""
    _pch_making.add(pch)
    threading.Thread(
        target=_run_pch_step,
        args=(pch, arguments, env, shared, limit_s),
        name="kf-pch-step",
        daemon=True,
    ).start()


def make_pch(arguments: dict[str, Any], env: dict[str, Any], limit_s: float) -> str:
    """Make the precompiled header a build of ``arguments`` (bound) and the toolchain
    ``env`` would read, in this thread, unless it is there (``made already``) or being
    made (then wait for it, at most ``limit_s``); ``ok``, or why there is none
    (:mod:`kf.evaluation.grader.pch_prewarm`)."""
    from kf.cuda import pch as pch_mod

    pch, shared = _pch_place(arguments, env)
    with _pch_done:
        if pch_mod.usable(shared):
            return "made already"
        maker = pch not in _pch_making
        if maker:
            _pch_making.add(pch)
        else:
            _pch_done.wait_for(lambda: pch not in _pch_making, limit_s)
    if maker:
        why = _run_pch_step(pch, arguments, env, shared, limit_s)
        return "ok" if pch_mod.usable(shared) else why
    return "ok" if pch_mod.usable(shared) else "another step did not make it"


def wait_for_pch(arguments: dict[str, Any], env: dict[str, Any], limit_s: float) -> bool:
    """Wait, at most ``limit_s``, until no step is making the header a build of
    ``arguments`` (bound) and ``env`` would read (it is made in the background:
    :func:`_pch_folders`); whether it is there now. Makes nothing itself."""
    from kf.cuda import pch as pch_mod

    pch, shared = _pch_place(arguments, env)
    with _pch_done:
        _pch_done.wait_for(lambda: pch not in _pch_making, limit_s)
    return pch_mod.usable(shared)


@contextlib.contextmanager
def _pch_folders(
    arguments: dict[str, Any], env: dict[str, Any], wait_s: float = 0.0, make_s: float = 0.0
) -> Iterator[dict[str, str]]:
    """The build box's ``KF_PCH_DIR`` (:mod:`kf.cuda.pch`): the shared cache's
    ``pch/<pch>``, read-only, under the key computed here from the call's arguments and
    the toolchain ``env``. No candidate's build box ever makes the header: where the
    cache lacks it, the first build of its key starts the grader's own step
    (:func:`_make_pch`, at most ``make_s``) in the background. While the header is being
    made, :data:`PCH_PIONEERS` builds at a time go on without it (the first verdict does
    not wait for it), and the others wait up to ``wait_s`` for it or for a pioneer's turn
    (then build without it, as they would have)."""
    from kf.cuda import inline
    from kf.cuda import pch as pch_mod

    if not inline.pch_wanted(arguments):
        yield {"KF_PCH": "0"}  # the box would otherwise decide by its own default
        return
    pch, shared = _pch_place(arguments, env)
    deadline = time.monotonic() + wait_s
    pioneer = False
    with _pch_done:
        if not pch_mod.usable(shared) and pch not in _pch_making and make_s >= 1:
            _start_pch_step(pch, arguments, env, shared, make_s)
        _pch_waiting[pch] = _pch_waiting.get(pch, 0) + 1
        _pch_done.notify_all()
        try:
            while pch in _pch_making and not pch_mod.usable(shared):
                if _pch_pioneers.get(pch, 0) < PCH_PIONEERS:
                    pioneer = True
                    _pch_pioneers[pch] = _pch_pioneers.get(pch, 0) + 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                _pch_done.wait(left)
        finally:
            _pch_waiting[pch] -= 1
    try:
        yield {"KF_PCH_DIR": str(shared)}
    finally:
        if pioneer:
            with _pch_done:
                _pch_pioneers[pch] -= 1
                _pch_done.notify_all()


def _make_pch(arguments: dict[str, Any], env: dict[str, Any], shared: Path, limit_s: float) -> str:
    """The grader's own step that makes the header published as ``shared``: the trusted
    writer writes kf's one-function module with the call's header material
    (:func:`kf.cuda.inline.pch_arguments`: its flags, nothing of its sources, CUDA flags
    or link flags), and a build box whose one writable place is a folder of this step's
    compiles that module's ``main.o`` alone (no link), making the header on the way. It
    is published only when that compile succeeded and the header is as the box left it
    (hashed as the box exits, checked again once it is the grader's)."""
    from kf.cuda import inline
    from kf.cuda import pch as pch_mod
    from kf.evaluation.grader import inline_writer

    call = inline.pch_arguments(arguments)
    if limit_s < 1:
        return "no time left for it"
    if not inline_writer.usable(call):
        return "the trusted writer cannot write its build"
    root = inline.cache_dir()
    key = inline.cache_key(call, env)
    step = Path(tempfile.mkdtemp(dir=root, prefix=f"{key}.pch-"))
    try:
        made = step / "pch"
        build = _Build(
            call, env.get("arch"), step, step, key, "kf_pch", limit_s, {"KF_PCH_MAKE": str(made)}
        )
        with _stage(root, key) as stage:
            ask = _write_request(build, stage, None, torch_free=False)
            try:
                reply = inline_writer.writer().write(ask, min(inline_writer.WRITE_LIMIT_S, limit_s))
            except inline_writer.WriterFailed as exc:
                return str(exc)
            if not reply.get("ok"):
                return f"load_inline: {reply.get('error')}"
            folder = step / "ninja"
            folder.mkdir()
            command = [*reply["command"], "-f", str(stage / "build.ninja")]
            code, out = build.run([*command, "-C", str(folder), "main.o"], limit_s)
            digest = _sha256(made / pch_mod.GCH)
            if code != 0 or digest is None or not pch_mod.usable(made):
                return f"its compile exited with status {code}: {out[-300:]}"
            _publish_pch(made, shared, digest)
            return "ok"
    finally:
        shutil.rmtree(step, ignore_errors=True)


def _sha256(path: Path) -> str | None:
    """The sha256 of the plain file ``path`` (never through a link), or None."""
    import hashlib

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        digest = hashlib.sha256()
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _publish_pch(made: Path, shared: Path, digest: str) -> None:
    """The header the grader's step made in ``made``, published as ``shared`` if it is
    still the file of sha256 ``digest``: only the ``.gch``, the link beside it the
    grader's own (to PyTorch's header), the hash recorded beside it."""
    import torch.utils.cpp_extension as ext

    from kf.cuda import pch as pch_mod

    gch = made / pch_mod.GCH
    # the link beside the header is the grader's own, to PyTorch's header: never the box's
    found = [Path(d) / pch_mod.HEADER for d in ext.include_paths()]
    real = next((path for path in found if path.is_file()), None)
    if real is None:
        return
    try:
        shared.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(dir=shared.parent, prefix=".publish-"))
    except OSError:
        return
    try:
        (temp / "torch").mkdir()
        os.replace(gch, temp / pch_mod.GCH)
        _take(temp / pch_mod.GCH)
        if _sha256(temp / pch_mod.GCH) != digest:
            raise OSError("the header changed after its step")
        (temp / pch_mod.HEADER).symlink_to(real)
        (temp / pch_mod.DIGEST).write_text(digest)
        (temp / pch_mod.MARK).write_text("ok")
        for path in (temp, temp / "torch", temp / pch_mod.DIGEST, temp / pch_mod.MARK):
            _take(path)
        os.replace(temp, shared)
    except OSError:
        shutil.rmtree(temp, ignore_errors=True)


def _take(path: Path) -> None:
    """What a build box made, published: the grader's own (a box in the uid mode made it as
    its uid, kf.evaluation.grader.box_limits.next_uid), readable by every box, written by none."""
    os.chown(path, os.geteuid(), os.getegid(), follow_symlinks=False)
    os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _refused_inline_flag(arguments: dict[str, Any]) -> str | None:
    """Why one of a ``load_inline`` call's compiler or linker flags is refused, or None:
    one that runs a program, or that no ninja file can hold as literal text
    (:func:`kf.cuda.inline.literal_arguments`)."""
    from kf import native
    from kf.cuda import inline

    try:
        inline.literal_arguments(arguments)
    except ValueError as exc:
        return str(exc)
    for name in ("extra_cflags", "extra_cuda_cflags", "extra_sycl_cflags", "extra_ldflags"):
        flags = arguments.get(name) or []
        for flag in [flags] if isinstance(flags, str) else flags:
            why = native.refused_flag(str(flag))
            if why:
                return why
    return None


@dataclass(frozen=True)
class _Build:
    """One ``load_inline`` build the grader runs: the call's bound ``arguments``, the
    runner's architecture, the build's private ``work`` folder, where it is published
    (``final``, under ``key``), its module's name, its limit and the precompiled header's
    folders for the box (``pch_env``, :func:`_pch_folders`)."""

    arguments: dict[str, Any]
    arch: str | None
    work: Path
    final: Path
    key: str
    module_name: str
    timeout_s: float
    pch_env: dict[str, str]

    def environment(self) -> dict[str, str]:
        """The build box's environment (``$KF_CACHE_DIR`` its own ``work``)."""
        extra = {
            "KF_CACHE_DIR": str(self.work),
            "TORCH_EXTENSIONS_DIR": str(self.work / "torch_extensions"),
            **({"TORCH_CUDA_ARCH_LIST": self.arch} if self.arch is not None else {}),
            # no GPU for a build: the architecture is the runner's, never one the box's
            # PyTorch finds (which would key the build differently from the grader)
            "CUDA_VISIBLE_DEVICES": "",
            "CXX": os.environ.get("CXX", "c++"),
            "KF_CACHE_SHARED": "",
            # the key computed here has the grader's choice (kf.cuda.torchfree): so must the box's
            "KF_TORCHFREE": "1" if current().torchfree else "0",
            **self.pch_env,
        }
        env = box.environment(os.environ, _BUILD_SCRATCH, extra)
        if self.arch is None:  # the key has none: not the grader's own $TORCH_CUDA_ARCH_LIST
            env.pop("TORCH_CUDA_ARCH_LIST", None)
        return env

    def run(self, run: list[str], timeout_s: float, **kw: Any) -> tuple[int | None, str]:
        """``run`` in a build box whose one writable place is ``work``, niced, its output
        capped; its exit status (None: timed out) and output."""
        boxed = box.command(
            python=sys.executable,
            scratch=_BUILD_SCRATCH,
            log_path=None,
            env=self.environment(),
            rw_paths=(str(self.work),),
            run=run,
        )
        return run_capped(
            _niced(boxed),
            timeout_s=timeout_s,
            env={"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"},
            **kw,
        )

    def publish(self, log: str) -> dict[str, Any]:
        """The build box's result in ``work``, checked and moved to ``final``."""
        return _publish_inline(self.work, self.final, self.key, self.module_name, log)


#: a build box's scratch folder (inside the box only: a tmpfs)
_BUILD_SCRATCH = Path(tempfile.gettempdir()) / "kf-build"


def _build_inline(build: _Build) -> dict[str, Any]:
    """Build in ``work``, then publish the result as ``final``: PyTorch's files written by
    the grader's writer and only their ninja run in the box
    (:mod:`kf.evaluation.grader.inline_writer`), or, where the writer cannot write this
    call, a Python in the box that runs kf's ``load_inline``."""
    from kf.evaluation.grader import inline_writer

    if not inline_writer.usable(build.arguments):
        return _build_inline_in_python(build)
    return _build_inline_written(build)


def _build_inline_in_python(build: _Build) -> dict[str, Any]:
    import json

    script = [sys.executable, "-P", "-c", _INLINE_SCRIPT]
    code, log = build.run(script, build.timeout_s, input_text=json.dumps(build.arguments))
    if code is None:
        return _failed(f"the load_inline build timed out after {build.timeout_s:.0f}s", log)
    if code != 0:
        return _failed(f"the load_inline build exited with status {code}", log)
    return build.publish(log)


def _build_inline_written(build: _Build) -> dict[str, Any]:
    """The build as kf's ``load_inline`` does it (:func:`kf.cuda.inline.load_inline`):
    first without the torch include where :func:`kf.cuda.inline.variant` says (the
    sources as they are, or split: :mod:`kf.cuda.torchsplit`), quietly,
    then PyTorch's way if that failed in any way; what the last attempt said is what
    the runner sees. The writer writes each attempt into a folder of the grader's own
    (:func:`_stage`), which the box reads and never writes, and ninja runs in the box's
    folder from that ninja file (it keeps the identical ``main.o`` of the first): nothing
    a build box leaves (a ``lock``, a link) is ever in the trusted writer's way."""
    from kf.cuda import inline
    from kf.evaluation.grader import inline_writer

    end = time.monotonic() + build.timeout_s
    folder = build.work / "cuda_ext" / build.key
    folder.mkdir(parents=True)
    held = build.work / "held-verdicts.log"
    kind = inline.variant(build.arguments, inline.pytorch_load_inline())
    with _stage(build.work.parent, build.key) as stage:
        for torch_free in (True, False) if kind else (False,):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(held)  # the box's: a link there is removed, never followed
            ask = _write_request(build, stage, held if torch_free else None, torch_free)
            try:
                # a hung writer holds every other build's request: its own limit, not the build's
                limit = min(inline_writer.WRITE_LIMIT_S, max(1.0, end - time.monotonic()))
                reply = inline_writer.writer().write(ask, limit)
            except inline_writer.WriterFailed as exc:
                return _failed(str(exc))
            if not reply["ok"]:
                if torch_free:
                    continue
                return _failed(f"load_inline: {reply['error']}", str(reply.get("log", "")))
            left = max(0.1, end - time.monotonic())
            command = [*reply["command"], "-f", str(stage / "build.ninja"), "-C", str(folder)]
            code, out = build.run(command, left)
            if code is None:
                return _failed(f"the load_inline build timed out after {build.timeout_s:.0f}s", out)
            if code == 0:
                break
            if not torch_free:
                log = f"{reply['warnings']}{reply['error_prefix']}: {out}"
                return _failed(f"the load_inline build exited with status {code}", log)
        refused = _copy_written(stage, folder)
    if refused:
        return _failed(refused)
    return _record_and_publish(build, folder, held, torch_free, kind, str(reply["warnings"]))


def _record_and_publish(
    build: _Build, folder: Path, held: Path, torch_free: bool, kind: str | None, warnings: str
) -> dict[str, Any]:
    """The built ``folder``'s record (how its ``cuda.cu`` was built: ``kind``, the
    :func:`kf.cuda.inline.variant` tried first, or its fallback), then published."""
    from kf.cuda import inline

    if torch_free and kind:
        inline.replay_verdicts(_read_box_file(held, _LOG), False)
        prelude = kind
    elif kind:
        prelude = "split-fallback" if kind == "split" else "torch-fallback"
    else:
        prelude = "torch" if inline.sources_given(build.arguments.get("cuda_sources")) else ""
    record = folder / "kf-build.json"
    if not _clear(record):
        return _failed("the build left kf-build.json, which is not a plain file")
    inline.record_build(folder, prelude)
    return build.publish(warnings)


def _write_request(
    build: _Build, stage: Path, held: Path | None, torch_free: bool
) -> dict[str, Any]:
    """What the trusted writer is asked to write into ``stage`` for ``build``: the
    launchers it makes go under the stage too (``$KF_CACHE_DIR``), never the box's folder."""
    from kf.cuda import inline
    from kf.evaluation.grader import inline_writer

    env = build.environment()
    toolchain = {**_own_toolchain(), "arch": build.arch}
    settings = {k: env.get(k, "") for k in inline_writer.REQUEST_SETTINGS}
    settings["KF_CACHE_DIR"] = str(stage.parent.parent)
    no_pch = build.pch_env.get("KF_PCH") == "0"
    return {
        "arguments": build.arguments,
        "module_name": build.module_name,
        "folder": str(stage),
        # the grader's choice (_pch_folders), for the toolchain the runner reported
        "pch": None if no_pch else inline.pch_key(build.arguments, toolchain),
        "settings": settings,
        "environ": {k: env.get(k) for k in inline_writer.REQUEST_ENVIRON},
        "torch_free": torch_free,
        "held": str(held) if held is not None else None,
    }


@contextlib.contextmanager
def _stage(root: Path, key: str) -> Iterator[Path]:
    """A folder of the grader's own under ``root`` (the shared cache, which every box
    reads and none writes) for the trusted writer: ``<stage>/cuda_ext/<key>``, removed
    afterwards."""
    top = Path(tempfile.mkdtemp(dir=root, prefix=f"{key}.stage-"))
    try:
        os.chmod(top, 0o755)  # a box of the uid mode reads it
        stage = top / "cuda_ext" / key
        stage.mkdir(parents=True)
        for path in (top / "cuda_ext", stage):
            os.chmod(path, 0o755)
        yield stage
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _clear(path: Path) -> bool:
    """Whether nothing of the box's is left at ``path`` (a file or link it left there is
    removed, never followed); False for a folder."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        os.unlink(path)
    except FileNotFoundError:
        pass
    return True


def _copy_written(stage: Path, folder: Path) -> str | None:
    """The files the writer wrote (the sources, ``build.ninja``) copied into the box's
    ``folder`` beside what ninja built, as a ``load_inline`` build folder has them; why
    not, where the box left a folder in the way."""
    for source in sorted(stage.iterdir()):
        if not stat.S_ISREG(os.lstat(source).st_mode):
            continue
        target = folder / source.name
        if not _clear(target):
            return f"the build left {source.name}, which is not a plain file"
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write(source.read_bytes())
    return None


def _read_box_file(path: Path, limit: int) -> str:
    """The text of a plain file a build box wrote, at most ``limit`` bytes of it (never
    through a link, never a FIFO or device); empty where there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return ""
        return f.read(limit).decode(errors="replace")


def _publish_inline(
    work: Path, final: Path, key: str, module_name: str, log: str
) -> dict[str, Any]:
    """The build box's result in ``work``, checked and moved to ``final``."""
    built = work / "cuda_ext" / key
    if not (built / f"{module_name}.so").is_file():
        left = sorted(p.name for p in (work / "cuda_ext").glob("*"))
        return _failed(
            f"the load_inline build left no {module_name}.so under its key {key} (it left {left})",
            log,
        )
    for path in built.rglob("*"):
        mode = os.lstat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return _failed(f"the build left {path.name}, which is not a plain file", log)
    for path in (built, *built.rglob("*")):
        _take(path)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(built, final)
    return {"ok": True, "path": str(final), "cached": False, "log": cap_text(log, _LOG)}
