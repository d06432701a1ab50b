"""The grader's trusted writer of ``load_inline`` builds: PyTorch's files, no PyTorch in the box.

A boxed ``load_inline`` build used to run a Python in the build box that imported torch
(5.4 CPU-seconds of a CUDA build on the H200 machine, more than the compile of a
torch-free ``cuda.cu``) only to write three files and run ninja. This process writes
them instead: it runs PyTorch's own ``load_inline`` with its ninja run and its import
replaced (:func:`serve`), so ``main.cpp``, ``cuda.cu`` and ``build.ninja`` are exactly
PyTorch's, and the build box then runs nothing but that ninja file
(:func:`kf.evaluation.grader.builds.build_inline`).

It is one process per grader, started on first use, its torch imported once. It is
trusted: it compiles and runs nothing of a candidate's. A candidate's strings become
files and lines of a ninja file, which only the build box runs, each flag as literal
words (:func:`kf.cuda.inline.literal_arguments`: never shell or ninja syntax), in a
folder of the grader's own that no box can write (a ``lock`` or a link a box left is
never in its way). What of PyTorch's
``load_inline`` would run a program with a candidate's flags outside the box is
replaced here or refused by the grader (``use_pch``, which makes PyTorch's own
precompiled header), and a PyTorch without the functions replaced here is not used:
the grader then builds the old way, with a Python in the box (:func:`usable`).

One request a line on stdin, one JSON reply a line on stdout, in order; it exits at
end of input, so it goes with the grader whatever kills the grader.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import IO, Any

from kf import settings

__all__ = [
    "HOOKS",
    "WRITE_LIMIT_S",
    "InlineWriter",
    "WriterFailed",
    "main",
    "prewarm",
    "serve",
    "usable",
    "writer",
]

#: PyTorch's functions this process replaces or calls (``torch.utils.cpp_extension``)
HOOKS = (
    "_run_ninja_build",
    "_import_module_from_library",
    "remove_extension_h_precompiler_headers",
    "_get_num_workers",
)

#: the settings a request sets (the rest are the grader's, as the build box gets them;
#: the torch-free variant and the precompiled header are the request's own)
REQUEST_SETTINGS = ("KF_CACHE_DIR", "KF_CACHE_SHARED", "KF_PCH_DIR", "KF_PCH_MAKE")
#: the other variables a request sets; None: unset
REQUEST_ENVIRON = ("TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR", "CXX")
#: the longest a request may take (it takes about 0.1 s; one at a time, so a writer that
#: hangs would hold every build's request behind it)
WRITE_LIMIT_S = 60.0


class WriterFailed(RuntimeError):
    """The writer did not answer (it died, or took longer than the request's limit)."""


def usable(arguments: dict[str, Any]) -> bool:
    """Whether a build of these (bound) arguments can be written here: not one asking
    for PyTorch's own precompiled header, which PyTorch makes by running the compiler
    with the call's flags; and a PyTorch that has every function replaced here."""
    if arguments.get("use_pch"):
        return False
    import torch.utils.cpp_extension as ext

    return all(callable(getattr(ext, name, None)) for name in HOOKS)


def _apply(request: dict[str, Any]) -> None:
    settings.apply({name: str(request["settings"].get(name, "")) for name in REQUEST_SETTINGS})
    for name in REQUEST_ENVIRON:
        value = request["environ"].get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)


def _write(request: dict[str, Any], ran: list[dict[str, Any]]) -> dict[str, Any]:
    from kf.cuda import inline

    _apply(request)
    folder = Path(request["folder"])
    ran.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inline.write_build(
            request["arguments"],
            request["module_name"],
            folder,
            torch_free=bool(request["torch_free"]),
            pch=request.get("pch"),
            held=request.get("held"),
        )
    if len(ran) != 1:
        raise RuntimeError(f"PyTorch's load_inline asked for {len(ran)} ninja runs, not one")
    said = "".join(
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught
    )
    return {"ok": True, **ran[0], "warnings": said}


def serve(stdin: IO[str], stdout: IO[str]) -> None:
    """The writer's loop: PyTorch's ``load_inline`` with the ninja run recorded (the
    command it would run: ``ninja -v``, ``-j`` from ``MAX_JOBS``, and its error prefix),
    the import of the result and the removal of PyTorch's precompiled header left out."""
    import torch.utils.cpp_extension as ext

    ran: list[dict[str, Any]] = []
    workers = ext._get_num_workers

    def run_ninja(build_directory: str, verbose: bool, error_prefix: str) -> None:
        # the folder is the request's own: the grader runs ninja there
        jobs = workers(verbose)
        ninja = shutil.which("ninja") or "ninja"
        command = [ninja, "-v", *(["-j", str(jobs)] if jobs is not None else [])]
        ran.append({"command": command, "error_prefix": error_prefix})

    ext._run_ninja_build = run_ninja
    ext._import_module_from_library = lambda *args, **kwargs: None
    ext.remove_extension_h_precompiler_headers = lambda: None
    for line in stdin:
        try:
            reply = _write(json.loads(line), ran)
        except Exception as exc:  # a malformed call fails as PyTorch's load_inline would
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "log": _trace()}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


def _trace() -> str:
    return traceback.format_exc()[-20_000:]


class InlineWriter:
    """The grader's side: one writer process, started on first use, one request at a
    time (a request takes milliseconds; the compiles run in the build boxes meanwhile)."""

    def __init__(self, environment: dict[str, str]) -> None:
        self._environment = environment
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._home: str | None = None
        self.started = 0  #: processes started (a dead one is replaced)

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop_locked()
        self._home = tempfile.mkdtemp(prefix="kf-inline-writer-")
        env = {**self._environment, "HOME": self._home, "TMPDIR": self._home}
        self._proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "kf.evaluation.grader.inline_writer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=self._home,
            start_new_session=True,  # the terminal's Ctrl-C is the grader's to handle
        )
        self.started += 1
        return self._proc

    def start(self) -> None:
        """Start the process now, if none is running (its torch import: 5 s on the H200)."""
        with self._lock:
            self._start()

    def write(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The writer's reply to ``request``; raises :class:`WriterFailed` when it dies
        or does not answer within ``timeout_s`` (it is then killed, and the next request
        starts another)."""
        with self._lock:
            proc = self._start()
            assert proc.stdin is not None
            assert proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                proc.stdin.flush()
                line = _read_line(proc.stdout, timeout_s)
            except (OSError, WriterFailed) as exc:
                self._stop_locked()
                raise WriterFailed(f"the build writer failed: {exc}") from exc
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise WriterFailed(f"the build writer answered {line[:200]!r}")
        return reply

    def _stop_locked(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    def close(self) -> None:
        """Stop the writer (end of its input; killed if it does not go within 2 s). A
        request still waiting for it (a hung writer) does not hold this up: the process
        is killed, and that request fails."""
        if not self._lock.acquire(timeout=2.0):
            proc = self._proc
            if proc is not None:
                with contextlib.suppress(OSError):
                    proc.kill()
            return
        try:
            self._stop_locked()
        finally:
            self._lock.release()


def _read_line(stream: IO[bytes], timeout_s: float) -> str:
    """One line from ``stream`` (a pipe read only here) within ``timeout_s``."""
    fd = stream.fileno()
    data = b""
    end = time.monotonic() + timeout_s
    while not data.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise WriterFailed(f"no answer within {timeout_s:.0f}s")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise WriterFailed("it exited")
        data += chunk
    return data.decode()


_writer: InlineWriter | None = None
_writer_lock = threading.Lock()


def writer() -> InlineWriter:
    """This grader's writer (its environment: the build box's, without the box's paths,
    and no GPU: a build's architecture is the one its request names)."""
    global _writer
    with _writer_lock:
        if _writer is None:
            import atexit

            from kf.evaluation.grader import box

            environment = box.environment(
                os.environ, Path(tempfile.gettempdir()), {"CUDA_VISIBLE_DEVICES": ""}
            )
            _writer = InlineWriter(environment)
            atexit.register(_writer.close)
        return _writer


def main() -> None:
    """Serve stdin; the replies go to the stdout this process was given, and everything
    else that would print there (PyTorch, the compilers it asks for their version) to
    stderr."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


def prewarm() -> None:
    """Start this grader's writer in the background: a CUDA worker's first builds, fifteen
    at once on the H200, then do not all wait for its torch import."""
    threading.Thread(target=writer().start, name="kf-inline-writer-start", daemon=True).start()


if __name__ == "__main__":
    main()
