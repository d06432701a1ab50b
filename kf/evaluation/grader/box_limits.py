"""A box's process limit: a pids cgroup of its own where kf may make one, else
``RLIMIT_NPROC`` inside the box for a non-root user (counted per box since Linux 5.14),
else none (root with no writable cgroup); :func:`process_limit` says which.
Split from :mod:`kf.evaluation.grader.box`, which starts boxes with it."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from kf.settings import current


class SandboxUnavailable(RuntimeError):
    """The runner sandbox cannot be set up here; the message is one line saying why."""


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


def in_cgroup() -> list[str]:
    """The start of a box's command line that moves it into a pids cgroup of its own."""
    base = _pids_cgroups()
    if base is None:
        return []
    sweep_cgroups()
    folder = _new_cgroup(base, str(next(_box_count)), pids_limit())
    script = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'
    return ["/bin/sh", "-c", script, "kf-box", str(folder)]
