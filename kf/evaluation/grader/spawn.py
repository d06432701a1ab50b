"""Starting a runner process: its command line (in bubblewrap's box, or unboxed where
``$KF_UNSAFE_NO_SANDBOX=1`` asks), its environment, its scratch folder and log, the one
thread every runner is started from, and the limits applied to it for its job.

Each runner is ``python -m kf.evaluation.runner`` started inside bubblewrap's box
(:mod:`kf.evaluation.grader.box`: its own user, PID, network and mount namespaces, uid 65534,
an allow-listed environment, nothing writable but a size-limited scratch tmpfs), in its
own session (process group). Unboxed runners get a private scratch directory as cwd and
``TMPDIR``, and a network namespace of their own where the kernel allows it
(``$KF_EVAL_NETNS=0`` turns that off); their every report is marked.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kf.evaluation.grader import box
from kf.settings import applied, current

__all__ = ["Limits", "Started", "default_threads", "network_namespace_available", "start"]

_netns: bool | None = None


def network_namespace_available() -> bool:
    """Whether runners can start in a fresh network namespace (probed once)."""
    global _netns
    if _netns is None:
        unshare = shutil.which("unshare")
        if not current().eval_netns or unshare is None:
            _netns = False
        else:
            try:
                probe = subprocess.run(
                    [unshare, "-rn", "true"], capture_output=True, timeout=10, check=False
                )
                _netns = probe.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                _netns = False
    return _netns


def default_threads() -> int:
    """Threads for torch and OpenMP in every runner: ``$KF_EVAL_THREADS`` or the usable cores."""
    threads = current().eval_threads
    if threads is not None:
        return threads
    return max(1, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class Limits:
    """Resource limits applied to a runner for its job (0 means no limit)."""

    #: ``$KF_EVAL_MEMORY_MB`` (8192), where an address-space limit applies
    memory_bytes: int = field(default_factory=lambda: current().eval_memory_mb * 2**20)
    cpu_s: int = 0  # derived from the stage's timeout when 0
    #: per file, the runner's own output log included (``$KF_EVAL_FILE_MB``, 256)
    file_bytes: int = field(default_factory=lambda: current().eval_file_mb * 2**20)


def _runner_env(scratch: Path, log_path: Path, threads: int, warm: str | None) -> dict[str, str]:
    """A runner's environment before the box's allow-list: this process's with its settings
    (kf.settings.apply: a command's flags), which the runner reads as its own."""
    env = {**os.environ, **applied()}
    env.update(
        TMPDIR=str(scratch),
        # build tools the runner starts add their verdicts to its log (kf.cuda.objcache)
        KF_OBJCACHE_LOG=str(log_path),
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.pop("KF_RUNNER_WARM", None)
    if warm:
        env["KF_RUNNER_WARM"] = warm
    # Fair timing on a CPU: idle OpenMP threads of one runner must not spin while the
    # other runner is being timed, and big buffers are reused from the heap rather than
    # mmap'ed afresh (page faults) on every call — which helps eager's temporaries most,
    # so the baseline gets stronger, never weaker. The user's own settings win.
    for key, value in (
        ("OMP_WAIT_POLICY", "PASSIVE"),
        ("MALLOC_MMAP_THRESHOLD_", str(1 << 30)),
        ("MALLOC_TRIM_THRESHOLD_", str(1 << 31)),
    ):
        env.setdefault(key, value)
    return env


class Started(NamedTuple):
    """A runner process just started: the grader's end of its socket, and where it runs."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    scratch: Path
    log_path: Path
    #: "bwrap", or "unsafe-no-sandbox": what every report of this runner says
    sandbox: str
    isolated_network: bool


def start(
    python: str,
    threads: int,
    *,
    wrapper: Sequence[str] = (),
    isolate: bool = True,
    warm: str | None = None,
    ro_paths: Sequence[str] = (),
    rw_paths: Sequence[str] = (),
) -> Started:
    """Start a runner in the box; see :class:`kf.evaluation.grader.sandbox.RunnerHandle`."""
    sandbox = box.mode()
    scratch = Path(tempfile.mkdtemp(prefix="kf-runner-"))
    log_path = scratch / "runner.log"
    parent_sock, child_sock = socket.socketpair()
    env = _runner_env(scratch, log_path, threads, warm)
    runner = [python, "-P", "-m", "kf.evaluation.runner", str(child_sock.fileno())]
    if sandbox == box.MODE_BWRAP:
        isolated_network = True
        # the log must exist before bwrap binds it into the box
        log_path.touch()
        argv = box.command(
            python=python,
            scratch=scratch,
            log_path=log_path,
            # kf.native builds go through the grader (kf.evaluation.grader.builds), which
            # keys load_inline builds with its own KF_TORCHFREE: the runner must agree
            env=box.environment(
                env,
                scratch,
                {"KF_BUILD_SERVICE": "1", "KF_TORCHFREE": "1" if current().torchfree else "0"},
            ),
            ro_paths=ro_paths,
            rw_paths=rw_paths,
            # the grader's pid means nothing in the box's PID namespace: 0 says so
            run=[*wrapper, *runner, "0"],
        )
        env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"}
    else:
        isolated_network = isolate and network_namespace_available()
        unshare = [str(shutil.which("unshare")), "-rn"] if isolated_network else []
        argv = [*wrapper, *unshare, *runner, str(os.getpid())]
    # appending: the runner and the build tools it starts write to it side by side
    with open(log_path, "ab") as logf:
        proc = (
            _spawner()
            .submit(
                subprocess.Popen,
                argv,
                pass_fds=(child_sock.fileno(),),
                cwd=scratch,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            .result()
        )
    child_sock.close()
    return Started(proc, parent_sock, scratch, log_path, sandbox, isolated_network)


_spawn_thread: ThreadPoolExecutor | None = None
_spawn_lock = threading.Lock()


def _spawner() -> ThreadPoolExecutor:
    """The one thread that starts every runner, alive as long as this process.

    bwrap's ``--die-with-parent`` is the kernel's parent-death signal, which fires when
    the *thread* that started bwrap ends, not the process: a runner started from a
    short-lived worker thread would be killed with that thread.
    """
    global _spawn_thread
    with _spawn_lock:
        if _spawn_thread is None:
            _spawn_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kf-spawner")
        return _spawn_thread


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (empty when /proc cannot say)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]
