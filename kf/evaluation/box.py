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

import contextlib
import functools
import glob
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from kf.settings import SettingError, current

__all__ = [
    "BOX_UID",
    "MODE_BWRAP",
    "MODE_UNSAFE",
    "UNSANDBOXED_FLAG",
    "SandboxUnavailable",
    "bwrap_path",
    "command",
    "environment",
    "limited",
    "mode",
    "pids_limit",
    "probe",
    "process_limit",
    "require",
    "reset",
    "sweep_cgroups",
    "unsafe_requested",
]

BOX_UID = 65534
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
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "LD_LIBRARY_PATH",
        # compilers and the variables that change what they do (kf.cuda.objcache's key)
        "CXX",
        "CC",
        "CPATH",
        "C_INCLUDE_PATH",
        "CPLUS_INCLUDE_PATH",
        "OBJC_INCLUDE_PATH",
        "GCC_EXEC_PREFIX",
        "COMPILER_PATH",
        "SOURCE_DATE_EPOCH",
        "NVCC_PREPEND_FLAGS",
        "NVCC_APPEND_FLAGS",
        "NVCC_CCBIN",
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
        # threads and allocator (set by kf.evaluation.sandbox, or the user's own)
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

_lock = threading.Lock()
_probed: dict[str, str | None] = {}


class SandboxUnavailable(RuntimeError):
    """The runner sandbox cannot be set up here; the message is one line saying why."""


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
        PYTHONPATH=os.pathsep.join(map(str, [_kf_root(), *_pythonpath_folders()])),
        # the box's own build caches (writable, gone with it); the shared one is read-only
        KF_CACHE_DIR=str(scratch / ".kf-cache"),
        TORCH_EXTENSIONS_DIR=str(scratch / ".torch_extensions"),
    )
    if cache is not None:
        env["KF_CACHE_SHARED"] = str(cache)
    if "LD_LIBRARY_PATH" in env:  # only the folders whose libraries the box has
        bound = _library_folders(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(map(str, bound))
        if not bound:
            del env["LD_LIBRARY_PATH"]
    env.update({k: v for k, v in extra.items() if _allowed(k)})
    return env


def shared_cache() -> Path | None:
    """The grader's build cache (``$KF_CACHE_DIR`` or ``~/.cache/kf``), if it exists:
    bound read-only into every box, so runners reuse builds but cannot rewrite them."""
    root = current().cache_dir.absolute()
    # made here, so that it is bound from the first box on and builds the grader does
    # for boxed runners (kf.evaluation.builds) show up in every box
    with contextlib.suppress(OSError):
        (root / "native").mkdir(parents=True, exist_ok=True)
    return root if root.is_dir() else None


def _kf_root() -> Path:
    """The folder holding kf's package (a checkout for an editable install)."""
    import kf

    return Path(kf.__file__).resolve().parent.parent


def _pythonpath_folders() -> dict[Path, list[Path]]:
    """The grader's ``$PYTHONPATH`` folders that hold installed packages (``pip --target``,
    as on a machine without a registry), each with what is bound of it: only what pip
    installed there (:func:`installed_entries`), never the folder itself. A project folder
    on ``PYTHONPATH`` (its ``.env``, ``.ssh``, the run's log) is not bound; neither is a
    folder holding kf's checkout (the box sees only the checkout's ``kf`` package)."""
    kf_root = _kf_root()
    out: dict[Path, list[Path]] = {}
    for part in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if not part:
            continue
        path = Path(part).resolve()
        if path in out or not path.is_dir() or kf_root.is_relative_to(path):
            continue
        entries = installed_entries(path)
        if entries:
            out[path] = entries
    return out


def installed_entries(folder: Path) -> list[Path]:
    """What pip installed into ``folder``: each distribution's metadata folder and the
    top-level names its ``RECORD`` lists (``top_level.txt`` for an ``.egg-info``)."""
    try:
        stamp = folder.stat().st_mtime_ns
    except OSError:
        return []
    return [folder / name for name in _installed_names(folder, stamp)]


@functools.lru_cache(maxsize=64)
def _installed_names(folder: Path, _stamp: int) -> tuple[str, ...]:
    names: set[str] = set()
    for meta in folder.glob("*.dist-info"):
        names.add(meta.name)
        with contextlib.suppress(OSError, UnicodeDecodeError):
            for row in (meta / "RECORD").read_text().splitlines():
                top = row.split(",", 1)[0].split("/", 1)[0]
                if top and top not in {".", ".."}:
                    names.add(top)
    for meta in folder.glob("*.egg-info"):
        names.add(meta.name)
        with contextlib.suppress(OSError, UnicodeDecodeError):
            for top in (meta / "top_level.txt").read_text().split():
                names.update(n.name for n in folder.glob(f"{glob.escape(top)}*"))
    return tuple(sorted(n for n in names if (folder / n).exists() and not n.startswith(".")))


def _python_paths(python: str) -> list[Path]:
    """The Python installation(s) the runner's interpreter needs, read-only."""
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)}
    for entries in _pythonpath_folders().values():
        paths.update(entries)
    for exe in (Path(python), Path(python).resolve()):
        root = exe.parent.parent
        if exe.parent.name == "bin" and _is_python_installation(root):
            paths.add(root)
    return sorted(p for p in paths if p.exists())


def _is_python_installation(root: Path) -> bool:
    """A venv or an interpreter's prefix (not, say, a home folder with a ``bin/python``)."""
    return (root / "pyvenv.cfg").is_file() or any(root.glob("lib/python3*/os.py"))


_ETC = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
)
_SYS = ("/sys/block", "/sys/bus", "/sys/class", "/sys/dev", "/sys/devices")


def _system(args: list[str]) -> None:
    """The system directories: merged-/usr symlinks as symlinks, directories bound."""
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in (*_ETC, *_SYS):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]


def _gpu(args: list[str]) -> None:
    """GPU device nodes (read-write, as a device needs) when the host has any."""
    for node in sorted(glob.glob("/dev/nvidia*")):
        args += ["--dev-bind", node, node]
    for node in sorted(glob.glob("/dev/dri")):
        args += ["--dev-bind", node, node]


# bound otherwise (``/usr`` whole, ``--proc``, ``--dev``)
_NOT_BOUND = ("/usr/", "/proc", "/dev")


_TOOLS = ("gcc", "g++", "cc", "c++", "nvcc", "ninja", "ld")
#: what of a compiler's installation prefix outside ``/usr`` is bound: its standard parts
#: (and ``<prefix>/<target triplet>``, where gcc keeps its assembler and linker), never
#: the prefix itself, which may be a user's folder
_PREFIX_PARTS = ("bin", "lib", "lib32", "lib64", "libexec", "include")
_LIBRARY = re.compile(r".+\.so(\.[0-9]+)*")


def _tool_paths() -> list[Path]:
    """Installations of the compilers a runner calls (``load_inline``'s g++ and nvcc,
    Triton's launcher build) that live outside ``/usr``: e.g. ``/opt/gcc`` on the H200
    image, where a boxed ``load_inline`` otherwise failed with "No such file" for g++.
    Only the prefix's standard parts are bound (a compiler outside a ``bin`` folder: the
    program alone)."""
    out: list[Path] = []
    names = [*_TOOLS, *(os.environ[v] for v in ("CC", "CXX") if os.environ.get(v))]
    kf_root = _kf_root()
    for name in names:
        found = shutil.which(name)
        if found is None:
            continue
        for exe in {Path(found), Path(found).resolve()}:
            if str(exe).startswith("/usr/"):
                continue
            root = exe.parent.parent
            if exe.parent.name != "bin" or root == Path("/"):
                parts = [exe]
            else:
                parts = [root / p for p in _PREFIX_PARTS]
                parts += [d for d in root.glob("*-linux*") if d.is_dir()]
            for part in parts:
                if part.exists() and not kf_root.is_relative_to(part) and part not in out:
                    out.append(part)
    return out


def _whole_roots(python: str, extra: Iterable[str]) -> list[Path]:
    """What is bound whole (besides the system folders): Python, kf's package, the
    compilers' parts, CUDA, ``$KF_SANDBOX_RO_PATHS``, ``extra`` and the build cache."""
    paths: list[Path] = [*_python_paths(python), Path(_kf_root()) / "kf", *_tool_paths()]
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(name):
            paths.append(Path(os.environ[name]))
    paths += current().sandbox_ro_paths
    paths += [Path(p) for p in extra]
    cache = shared_cache()
    if cache is not None:
        paths.append(cache)
    return paths


def _library_folders(value: str) -> dict[Path, list[Path]]:
    """The folders of an ``LD_LIBRARY_PATH`` value whose libraries the box has, each with
    the files to bind for it: none for a folder under something bound whole, else the
    shared libraries (``*.so``, ``*.so.N``) it holds, never the folder itself (a user's
    folder on ``LD_LIBRARY_PATH`` is not bound; its libraries are)."""
    roots = [Path(p) for p in ("/usr", "/lib", "/lib32", "/lib64")]
    roots += [p.absolute() for p in _whole_roots(sys.executable, ())]
    out: dict[Path, list[Path]] = {}
    for entry in value.split(":"):
        folder = Path(entry).absolute() if entry else None
        if folder is None or folder in out or not folder.is_dir():
            continue
        if any(folder.is_relative_to(root) for root in roots):
            out[folder] = []
            continue
        with contextlib.suppress(OSError):
            files = [p for p in folder.iterdir() if _LIBRARY.fullmatch(p.name) and p.is_file()]
            if files:
                out[folder] = sorted(files)
    return out


def _ro_paths(python: str, extra: Iterable[str]) -> list[Path]:
    paths = _whole_roots(python, extra)
    for files in _library_folders(os.environ.get("LD_LIBRARY_PATH", "")).values():
        paths += files
    out: list[Path] = []
    for path in (p.absolute() for p in paths):
        if path.exists() and path not in out and not str(path).startswith(_NOT_BOUND):
            out.append(path)
    return out


#: processes (threads included) one box may hold at once: ``$KF_SANDBOX_PIDS``, else
#: 256, or 8 per core and 64 more where that is more (a runner's thread pools and a
#: build's compiler processes grow with the cores)
def pids_limit() -> int:
    raw = (current().get("KF_SANDBOX_PIDS") or "").strip()
    if raw:
        try:
            return max(8, int(raw))
        except ValueError as exc:
            raise SandboxUnavailable(f"$KF_SANDBOX_PIDS={raw!r} is not a whole number") from exc
    return max(256, 8 * len(os.sched_getaffinity(0)) + 64)


_pids_base: list[Path | None] = []
_box_count = itertools.count()
_CGROUP_PREFIX = "kf-box-"


def _cgroup_dir(controller: str) -> Path | None:
    """This process's cgroup folder in the hierarchy of ``controller`` (v1), or in the
    unified (v2) one where ``controller`` is enabled for its children; None otherwise."""
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    paths = {}
    for line in own:
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            paths[name] = path
    for line in mounts:
        fields, _, tail = line.partition(" - ")
        parts, kind = fields.split(), tail.split()
        if len(parts) < 5 or len(kind) < 3:
            continue
        root, point = parts[3], parts[4]
        if kind[0] == "cgroup" and controller in kind[2].split(",") and controller in paths:
            path = paths[controller]
        elif kind[0] == "cgroup2" and "" in paths:
            path = paths[""]
        else:
            continue
        folder = Path(point) / os.path.relpath(path, root)
        if kind[0] == "cgroup2":
            with contextlib.suppress(OSError):
                if controller not in (folder / "cgroup.subtree_control").read_text().split():
                    continue
        if folder.is_dir():
            return folder
    return None


def _pids_cgroups() -> Path | None:
    """Where each box gets a pids cgroup of its own, when this process may make them
    (probed once: a child made, limited, a process moved in, removed)."""
    if not _pids_base:
        base = _cgroup_dir("pids")
        if base is not None:
            try:
                probe = _new_cgroup(base, "probe", 8)
                moved = subprocess.run(
                    ["/bin/sh", "-c", 'echo $$ > "$1"', "sh", str(probe / "cgroup.procs")],
                    capture_output=True,
                    timeout=10,
                    check=False,
                )
                probe.rmdir()
                if moved.returncode != 0:
                    base = None
            except (OSError, subprocess.SubprocessError):
                base = None
        _pids_base.append(base)
    return _pids_base[0]


def _new_cgroup(base: Path, name: str, limit: int) -> Path:
    folder = base / f"{_CGROUP_PREFIX}{os.getpid()}-{name}"
    folder.mkdir(exist_ok=True)
    (folder / "pids.max").write_text(str(limit))
    return folder


#: a box cgroup younger than this may not hold its box yet (made, its bwrap not started)
_CGROUP_GRACE_S = 60.0


def sweep_cgroups() -> None:
    """Remove the empty box cgroups of this process and of processes that are gone (one
    of this process only once older than a minute: its box may still be starting)."""
    base = _pids_base[0] if _pids_base else None
    if base is None:
        return
    now = time.time()
    for folder in base.glob(f"{_CGROUP_PREFIX}*"):
        pid = folder.name[len(_CGROUP_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        if int(pid) == os.getpid():
            with contextlib.suppress(OSError):
                if now - folder.stat().st_mtime < _CGROUP_GRACE_S:
                    continue
        elif Path(f"/proc/{pid}").exists():
            continue
        with contextlib.suppress(OSError):  # busy: its box still runs
            folder.rmdir()


def process_limit() -> str:
    """How a box's processes are bounded here: ``"cgroup"`` (a pids cgroup per box),
    ``"rlimit"`` (``RLIMIT_NPROC`` set inside the box, which counts the box's own user
    namespace only; the kernel does not apply it to root, whom the box's uid maps to
    when kf runs as root), or ``"none"``."""
    if _pids_cgroups() is not None:
        return "cgroup"
    if os.geteuid() != 0 and shutil.which("prlimit"):
        return "rlimit"
    return "none"


def limited(argv: Sequence[str]) -> list[str]:
    """``argv``, to run inside a box, under the box's process limit where that is
    ``RLIMIT_NPROC`` (:func:`process_limit`)."""
    if process_limit() != "rlimit":
        return list(argv)
    n = pids_limit()
    return [str(shutil.which("prlimit")), f"--nproc={n}:{n}", "--", *argv]


def _in_cgroup() -> list[str]:
    """The start of a box's command line that moves it into a pids cgroup of its own."""
    base = _pids_cgroups()
    if base is None:
        return []
    sweep_cgroups()
    folder = _new_cgroup(base, str(next(_box_count)), pids_limit())
    script = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'
    return ["/bin/sh", "-c", script, "kf-box", str(folder)]


def command(
    *,
    python: str,
    scratch: Path,
    log_path: Path | None,
    env: Mapping[str, str],
    ro_paths: Sequence[str] = (),
    rw_paths: Sequence[str] = (),
    bwrap: str | None = None,
) -> list[str]:
    """bwrap's argv up to ``--``, for a runner whose scratch folder is ``scratch`` (its
    host-side folder, holding ``log_path``, the runner's output, which stays writable
    in the box; none for a build box) and whose environment is ``env``; ``ro_paths``
    and ``rw_paths`` are bound in besides (a tool such as ncu, its output folder)."""
    exe = bwrap or bwrap_path()
    if exe is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
    args = [
        *_in_cgroup(),
        exe,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(BOX_UID),
        "--gid",
        str(BOX_UID),
        "--hostname",
        "kf-box",
        "--clearenv",
    ]
    for key, value in sorted(env.items()):
        args += ["--setenv", key, value]
    _system(args)
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(_megabytes("KF_SANDBOX_SHM_MB", _SHM_MB) << 20), "--tmpfs", "/dev/shm"]
    _gpu(args)
    # the one writable place: /tmp, a size-limited tmpfs holding the scratch folder (or
    # the scratch folder itself, with /tmp a link to it, when it is elsewhere); mounted
    # before the read-only binds, so that one under /tmp (a test's cache) stays visible
    size = str(scratch_bytes())
    if scratch.is_relative_to("/tmp"):
        args += ["--size", size, "--tmpfs", "/tmp", "--dir", str(scratch)]
    else:
        args += ["--size", size, "--tmpfs", str(scratch), "--symlink", str(scratch), "/tmp"]
    for path in _ro_paths(python, ro_paths):
        args += ["--ro-bind", str(path), str(path)]
    if log_path is not None:
        args += ["--bind", str(log_path), str(log_path)]
    for rw in rw_paths:
        args += ["--bind", rw, rw]
    args += ["--chdir", str(scratch), "--remount-ro", "/"]
    return args


def _probe_now(exe: str) -> str | None:
    """Start one box as a runner would and check what is inside; None when it works."""
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        return f"bubblewrap not found at {exe}"
    scratch = Path(tempfile.mkdtemp(prefix="kf-box-probe-"))
    try:
        log_path = scratch / "runner.log"
        log_path.touch()
        env = environment(os.environ, scratch, {})
        argv = command(
            python=sys.executable, scratch=scratch, log_path=log_path, env=env, bwrap=exe
        )
        check = (
            "import os, socket\n"
            f"assert os.getuid() == {BOX_UID}, os.getuid()\n"
            "import kf.evaluation.protocol\n"
            "s = socket.socket(); s.settimeout(1)\n"
            "try:\n"
            "    s.connect(('127.0.0.1', 9)); print('net')\n"
            "except OSError:\n"
            "    pass\n"
            "print('ok', os.getpid())\n"
        )
        try:
            done = subprocess.run(
                [*argv, "--", sys.executable, "-P", "-c", check],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{exe} could not run: {exc}"
        out = done.stdout.split()
        if done.returncode != 0 or out[:1] != ["ok"] or "net" in out:
            why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            if "net" in out:
                why = "the box's network namespace reached 127.0.0.1"
            return f"{exe} failed its start-up probe: {why}"
        if out[1:2] != ["2"]:  # pid 1 is bwrap's init in the box's own PID namespace
            return f"{exe} started no PID namespace (the runner's pid is {out[1:2]})"
        return None
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


def reset() -> None:
    """Forget earlier probes (after ``$KF_BWRAP`` or ``PATH`` changed)."""
    with _lock:
        _probed.clear()


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
