"""The box every runner process starts in: bubblewrap (``bwrap``), not a hand-rolled one.

A runner is started as ``bwrap <options> -- python -P -m kf.evaluation.runner FD 0``
with (see docs/sandbox.md for the why of each):

- its own user, PID, network, IPC, UTS and cgroup namespaces (``--unshare-all``), uid
  and gid 65534 inside, ``--die-with-parent`` and ``--new-session``: nothing the
  candidate starts outlives the runner, and it has no network (not even loopback that
  reaches the host's);
- a mount namespace built from nothing: an empty, read-only root holding only what the
  runner needs, bound read-only (the system directories, a few files of ``/etc``, the
  Python installation, kf's own package, the shared build cache, GPU device nodes);
  the run's log, the user's home, the repository, ``/tmp`` and other processes are not
  there;
- one writable place: the scratch folder, a tmpfs of ``$KF_SANDBOX_SCRATCH_MB`` (1024)
  MiB at the same path as the runner's host-side folder (its cwd, ``$HOME``,
  ``$TMPDIR`` and ``/tmp``), plus a small ``/dev/shm``; it vanishes with the box;
- an environment reduced to an allow-list (``--clearenv`` and ``--setenv``): no
  token or key of kf's reaches a candidate.

Where the box cannot be set up (no bwrap, or its start-up probe fails, e.g. because
user namespaces are unavailable), :func:`mode` raises :class:`SandboxUnavailable`
with a one-line reason, unless ``$KF_UNSAFE_NO_SANDBOX=1`` asks for runners without
the box; every stage report then says ``sandbox="unsafe-no-sandbox"`` and carries an
``unsandboxed`` flag. ``$KF_BWRAP`` names the bwrap binary (e.g. one unpacked from the
Debian package with ``dpkg -x``); otherwise ``bwrap`` is looked up on ``PATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from kf.cuda.objcache import KEY_ENVIRONMENT
from kf.evaluation.grader.box_binds import (
    gpu_binds,
    kf_package_root,
    library_folders,
    pythonpath_folders,
    readonly_binds,
    shared_cache,
    system_binds,
)
from kf.evaluation.grader.box_limits import (
    BOX_UID,
    PROBE_PIDS,
    UID_MODE_OPTIONS,
    SandboxUnavailable,
    box_uids,
    give_to,
    in_cgroup,
    limited,
    next_uid,
    open_parents,
    open_perms,
    pids_limit,
    probe_findings,
    sweep_cgroups,
    wanted_limit,
)
from kf.settings import SettingError, current

__all__ = [
    "BOX_UID",
    "MODE_BWRAP",
    "MODE_UNSAFE",
    "UNSANDBOXED_FLAG",
    "SandboxUnavailable",
    "box_uids",
    "bwrap_path",
    "command",
    "environment",
    "limited",
    "mode",
    "pids_limit",
    "probe",
    "process_limit",
    "process_limit_note",
    "require",
    "reset",
    "sweep_cgroups",
    "uid_mode_problem",
    "unsafe_requested",
    "wanted_limit",
]

MODE_BWRAP = "bwrap"
MODE_UNSAFE = "unsafe-no-sandbox"
#: The flag every stage report of an unsandboxed evaluation carries.
UNSANDBOXED_FLAG = "unsandboxed: the runners ran outside kf's box (--unsafe-no-sandbox)"

_SCRATCH_MB = 1024
_SHM_MB = 64

#: Environment variables a runner gets (when set in the grader's environment); the box
#: sets its own HOME, TMPDIR, USER, LOGNAME, PYTHONPATH and the cache paths.
ALLOWED_ENV = frozenset(
    {
        "PATH",
        "TZ",
        "LD_LIBRARY_PATH",
        # compilers and the variables that change what they do (the locale included): the
        # object cache's key hashes these, so a build in the box sees what the key says
        "CXX",
        "CC",
        *KEY_ENVIRONMENT,
        "MAX_JOBS",
        "KF_BUILD_TIMEOUT_S",
        # CUDA and PyTorch
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "CUDA_MODULE_LOADING",
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_DRIVER_CAPABILITIES",
        "TORCH_CUDA_ARCH_LIST",
        "TRITON_LIBCUDA_PATH",
        "TRITON_PTXAS_PATH",
        # kept off on the H200 machines (KINDS.md): a program must not turn it on
        "NCCL_NVLS_ENABLE",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
        "NVSHMEM_DISABLE_NVLS",
        # threads and allocator (set by kf.evaluation.grader.sandbox, or the user's own)
        "OMP_NUM_THREADS",
        "OMP_WAIT_POLICY",
        "OMP_PROC_BIND",
        "OMP_PLACES",
        "MKL_NUM_THREADS",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONHASHSEED",
        # kf's own settings that runner-side code reads
        "KF_RUNNER_WARM",
        "KF_OBJCACHE",
        "KF_OBJCACHE_LOG",
        "KF_CUDA_ARCH",
        "KF_CUDA_REPORT",
    }
)
# Never passed, whatever an allow-list says (``$KF_SANDBOX_ENV`` included).
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "NKEY")

_lock = threading.RLock()  # probe() may probe the uid mode first
_probed: dict[str, str | None] = {}
_uid_probed: dict[str, str | None] = {}


def unsafe_requested() -> bool:
    """Whether ``$KF_UNSAFE_NO_SANDBOX=1`` asks for runners without the box."""
    return current().unsafe_no_sandbox


def bwrap_path() -> str | None:
    """``$KF_BWRAP`` when set (even if it does not exist: the probe says so), else
    ``bwrap`` on ``PATH``, else None."""
    given = current().bwrap
    if given:
        return given
    return shutil.which("bwrap")


def _megabytes(name: str, default: int) -> int:
    try:
        mb = current().megabytes(name)
    except SettingError as exc:
        raise SandboxUnavailable(str(exc)) from exc
    return default if mb is None else mb


def scratch_bytes() -> int:
    """The size of a box's scratch tmpfs: ``$KF_SANDBOX_SCRATCH_MB`` MiB (1024)."""
    return _megabytes("KF_SANDBOX_SCRATCH_MB", _SCRATCH_MB) << 20


def _allowed(name: str) -> bool:
    upper = name.upper()
    return not any(word in upper for word in _SECRET_WORDS)


def environment(base: Mapping[str, str], scratch: Path, extra: Mapping[str, str]) -> dict[str, str]:
    """The runner's environment: the allow-listed names of ``base``, the names listed
    in ``$KF_SANDBOX_ENV`` (comma-separated, never one that looks like a secret), the
    box's own paths, then ``extra``."""
    names = set(ALLOWED_ENV)
    names |= set(current().sandbox_env)
    env = {k: v for k, v in base.items() if k in names and _allowed(k)}
    cache = shared_cache()
    env.update(
        HOME=str(scratch),
        TMPDIR=str(scratch),
        USER="nobody",
        LOGNAME="nobody",
        PYTHONPATH=os.pathsep.join(map(str, [kf_package_root(), *pythonpath_folders()])),
        # the box's own build caches (writable, gone with it); the shared one is read-only
        KF_CACHE_DIR=str(scratch / ".kf-cache"),
        TORCH_EXTENSIONS_DIR=str(scratch / ".torch_extensions"),
    )
    if cache is not None:
        env["KF_CACHE_SHARED"] = str(cache)
    if "LD_LIBRARY_PATH" in env:  # only the folders whose libraries the box has
        bound = library_folders(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(map(str, bound))
        if not bound:
            del env["LD_LIBRARY_PATH"]
    env.update({k: v for k, v in extra.items() if _allowed(k)})
    return env


def command(
    *,
    python: str,
    scratch: Path,
    log_path: Path | None,
    env: Mapping[str, str],
    ro_paths: Sequence[str] = (),
    rw_paths: Sequence[str] = (),
    bwrap: str | None = None,
    run: Sequence[str] | None = None,
    limit: str | None = None,
    pids: int | None = None,
) -> list[str]:
    """bwrap's argv for a runner whose scratch folder is ``scratch`` (its host-side folder,
    holding ``log_path``, the runner's output, which stays writable in the box; none for a
    build box) and whose environment is ``env``; ``ro_paths`` and ``rw_paths`` are bound in
    besides (a tool such as ncu, its output folder).

    With ``run``, the whole command line, ``run`` inside the box under its process limit
    (``limit``, :func:`process_limit`'s by default; ``pids`` processes, :func:`pids_limit`'s
    by default): in the uid mode the box has no user namespace and ``run`` starts as a host
    uid of the box's own (:func:`kf.evaluation.grader.box_limits.next_uid`), to which the
    log and ``rw_paths`` are given. Without ``run``, bwrap's options up to ``--``, for a
    box in a user namespace of its own (the caller adds ``--`` and its command)."""
    exe = bwrap or bwrap_path()
    if exe is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
    mode = (limit or process_limit()) if run is not None else None
    uid = next_uid() if mode == "uid" else None
    if uid is None:
        head = ["--unshare-all", "--uid", str(BOX_UID), "--gid", str(BOX_UID)]
    else:
        head = list(UID_MODE_OPTIONS)
    args = [*in_cgroup(), exe, *head, "--die-with-parent", "--new-session", "--hostname"]
    args += ["kf-box", "--clearenv"]
    for key, value in sorted(env.items()):
        args += ["--setenv", key, value]
    for top in ("/etc", "/sys") if uid is not None else ():  # the box's uid reads in them
        args += [*open_perms(uid, "0755"), "--dir", top]
    system_binds(args)
    args += ["--proc", "/proc", "--dev", "/dev"]
    shm = str(_megabytes("KF_SANDBOX_SHM_MB", _SHM_MB) << 20)
    args += [*open_perms(uid, "1777"), "--size", shm, "--tmpfs", "/dev/shm"]
    gpu_binds(args)
    made = _writable_places(args, scratch, uid)
    for path in readonly_binds(python, ro_paths):
        args += [*open_parents(path, uid, made), "--ro-bind", str(path), str(path)]
    for rw in [*([log_path] if log_path is not None else []), *map(Path, rw_paths)]:
        give_to(rw, uid)
        args += [*open_parents(rw, uid, made), "--bind", str(rw), str(rw)]
    args += ["--chdir", str(scratch), "--remount-ro", "/"]
    if run is None:
        return args
    return [*args, "--", *limited(run, uid, mode, pids)]


def _writable_places(args: list[str], scratch: Path, uid: int | None) -> set[Path]:
    """The one writable place: ``/tmp``, a size-limited tmpfs holding the scratch folder
    (or the scratch folder itself, with ``/tmp`` a link to it, when it is elsewhere);
    mounted before the read-only binds, so that one under ``/tmp`` (a test's cache) stays
    visible. The folders it made (for :func:`~kf.evaluation.grader.box_limits.open_parents`)."""
    size = str(scratch_bytes())
    made = {Path("/tmp"), scratch}
    if scratch.is_relative_to("/tmp"):
        args += [*open_perms(uid, "1777"), "--size", size, "--tmpfs", "/tmp"]
        args += [*open_parents(scratch, uid, {Path("/tmp")}), *open_perms(uid, "1777"), "--dir"]
        args.append(str(scratch))
    else:
        args += [*open_parents(scratch, uid, set()), *open_perms(uid, "1777"), "--size", size]
        args += ["--tmpfs", str(scratch), "--symlink", str(scratch), "/tmp"]
    made.update(scratch.parents)
    return made


#: what the start-up probe runs in a box: who and where it is, whether it reaches the
#: host's loopback, its capabilities, GPU nodes it may not open, and (``argv[1]``, a
#: process limit, not 0) how far a fork bomb gets
_CHECK = """\
import glob, json, os, signal, socket, sys
import kf.evaluation.wire.protocol
found = {"uid": os.getuid(), "pid": os.getpid(), "net": False}
s = socket.socket(); s.settimeout(1)
try:
    s.connect(("127.0.0.1", 9)); found["net"] = True
except OSError:
    pass
with open("/proc/self/status") as f:
    found["caps"] = [int(v, 16) for k, v in (l.split(":") for l in f) if k.startswith("Cap")]
nodes = [n for n in sorted(glob.glob("/dev/nvidia*")) if not os.path.isdir(n)]
found["gpu"] = [n for n in nodes if not os.access(n, os.R_OK | os.W_OK)]
found["unreadable"] = [d for d in sys.argv[2:] if not os.access(d, os.R_OK | os.X_OK)]
kids, found["fork_error"] = [], ""
for _ in range(4 * int(sys.argv[1])):
    try:
        pid = os.fork()
    except OSError as exc:
        found["fork_error"] = str(exc)
        break
    if pid == 0:
        signal.pause()
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
found["forked"] = len(kids)
print(json.dumps(found))
"""


def _readable() -> list[str]:
    """Folders a box's programs read in, as the host has them (a compiler's alternatives,
    the system's devices, the shared build cache): the probe checks the box's uid may."""
    cache = shared_cache()
    wanted = ["/etc/alternatives", "/etc/ld.so.conf.d", "/sys/devices"]
    return [p for p in [*wanted, *([str(cache)] if cache else [])] if os.path.isdir(p)]


def _probe_now(exe: str, limit: str | None = None) -> str | None:
    """Start one box as a runner would (under the process limit ``limit``, by default
    :func:`process_limit`'s) and check what is inside; None when it works. In the uid mode
    it also checks that the box has no capability, may open the GPU's nodes, and that a
    fork bomb stops at the limit (where the kernel does not enforce ``RLIMIT_NPROC``, as
    some sandboxing kernels may not, the mode gives no limit)."""
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        return f"bubblewrap not found at {exe}"
    scratch = Path(tempfile.mkdtemp(prefix="kf-box-probe-"))
    try:
        log_path = scratch / "runner.log"
        log_path.touch()
        mode = limit or process_limit()
        pids = PROBE_PIDS if mode == "uid" else 0
        argv = command(
            python=sys.executable,
            scratch=scratch,
            log_path=log_path,
            env=environment(os.environ, scratch, {}),
            bwrap=exe,
            run=[sys.executable, "-P", "-c", _CHECK, str(pids), *_readable()],
            limit=mode,
            pids=pids or None,
        )
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{exe} could not run: {exc}"
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            return f"{exe} failed its start-up probe: {why}"
        return probe_findings(exe, json.loads(lines[-1]), mode, pids)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def probe() -> str | None:
    """Why the box cannot be set up here, or None when it can (probed once per bwrap)."""
    exe = bwrap_path()
    if exe is None:
        return "bubblewrap (bwrap) is not installed"
    with _lock:
        if exe not in _probed:
            _probed[exe] = _probe_now(exe)
        return _probed[exe]


def uid_mode_problem() -> str | None:
    """Why a box cannot run as a host uid of its own under ``RLIMIT_NPROC`` here (the uid
    mode, :func:`kf.evaluation.grader.box_limits.wanted_limit`), or None when it can
    (probed once per bwrap and ``$KF_BOX_UIDS``)."""
    exe = bwrap_path()
    if exe is None:
        return "bubblewrap (bwrap) is not installed"
    key = f"{exe}|{box_uids()}"
    with _lock:
        if key not in _uid_probed:
            _uid_probed[key] = _probe_now(exe, "uid")
        return _uid_probed[key]


def process_limit() -> str:
    """How a box's processes are bounded here: ``"cgroup"`` (a pids cgroup per box),
    ``"uid"`` (root without one: each box's processes run as a host uid of their own from
    ``$KF_BOX_UIDS``, under ``RLIMIT_NPROC``), ``"rlimit"`` (another user: ``RLIMIT_NPROC``
    inside the box's user namespace), or ``"none"`` (:func:`process_limit_note` says why)."""
    wanted = wanted_limit()
    if wanted == "uid" and uid_mode_problem() is not None:
        return "none"
    return wanted


def process_limit_note() -> str:
    """One line: how a box's processes are bounded here, and why not where they are not."""
    limit, n = process_limit(), pids_limit()
    if limit == "cgroup":
        return f"cgroup: a pids cgroup per box, pids.max={n}"
    if limit == "uid":
        first, last = box_uids()
        return f"uid: each box as a host uid of its own ({first}-{last}), RLIMIT_NPROC={n}"
    if limit == "rlimit":
        return f"rlimit: RLIMIT_NPROC={n} inside the box's user namespace"
    if wanted_limit() == "uid":
        why = uid_mode_problem()
    elif os.geteuid() == 0 and not current().box_uid_mode:
        why = "KF_BOX_UIDS=off (root without a pids cgroup)"
    else:
        why = "no pids cgroup, setpriv or prlimit"
    return f"none: {why}"


def reset() -> None:
    """Forget earlier probes (after ``$KF_BWRAP`` or ``PATH`` changed)."""
    with _lock:
        _probed.clear()
        _uid_probed.clear()


def mode() -> str:
    """``"bwrap"`` when runners start in the box; ``"unsafe-no-sandbox"`` when
    ``$KF_UNSAFE_NO_SANDBOX=1`` asks for none; else :class:`SandboxUnavailable`."""
    if unsafe_requested():
        return MODE_UNSAFE
    why = probe()
    if why is None:
        return MODE_BWRAP
    raise SandboxUnavailable(
        f"refusing to evaluate: the runner sandbox cannot be set up ({why}); install "
        "bubblewrap (apt-get install bubblewrap) or point KF_BWRAP at a bwrap binary, or "
        "evaluate without it, marked, with --unsafe-no-sandbox (KF_UNSAFE_NO_SANDBOX=1)"
    )


def require() -> str:
    """:func:`mode`, for a command to call before it starts evaluating."""
    return mode()
