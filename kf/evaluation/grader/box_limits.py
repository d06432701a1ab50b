"""A box's process limit: a pids cgroup of its own where kf may make one; else, for root,
``RLIMIT_NPROC`` on a host uid of the box's own (``$KF_BOX_UIDS``: the kernel exempts uid
0 from the limit, also when a user namespace maps the box's uid to it); else, for any
other user, ``RLIMIT_NPROC`` inside the box's user namespace (counted per box since Linux
5.14). :func:`wanted_limit` says which applies here; :func:`kf.evaluation.grader.box.process_limit`
says which works (the uid mode is probed before it is used). Split from
:mod:`kf.evaluation.grader.box`, which starts boxes with it."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kf.settings import SettingError, current

#: the uid and gid inside a box with a user namespace of its own
BOX_UID = 65534


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


def wanted_limit() -> str:
    """How a box's processes are to be bounded here: ``"cgroup"`` (a pids cgroup per box,
    unless ``$KF_BOX_CGROUP=0``), ``"uid"`` (kf runs as root: each box's processes run as
    a host uid of their own, where ``RLIMIT_NPROC`` applies), ``"rlimit"`` (another user:
    ``RLIMIT_NPROC`` inside the box, which counts the box's own user namespace only), or
    ``"none"``."""
    if current().box_cgroup and _pids_cgroups() is not None:
        return "cgroup"
    if os.geteuid() == 0:
        usable = current().box_uid_mode and box_tool("setpriv") and box_tool("prlimit")
        return "uid" if usable else "none"
    return "rlimit" if box_tool("prlimit") else "none"


def box_tool(name: str) -> str | None:
    """``name`` on ``PATH`` where a box has it too (under ``/usr``, or ``/bin``/``/sbin``,
    which a box links or binds), else None."""
    found = shutil.which(name)
    if found is None or not found.startswith(("/usr/", "/bin/", "/sbin/")):
        return None
    return found


_uid_count = itertools.count()


def next_uid() -> int:
    """The host uid (and gid) of the next box in the uid mode: each in turn from
    ``$KF_BOX_UIDS``, so that a box's ``RLIMIT_NPROC`` counts its own processes only (a
    range of one makes every box share one count)."""
    first, last = box_uids()
    return first + next(_uid_count) % (last - first + 1)


def box_uids() -> tuple[int, int]:
    """``$KF_BOX_UIDS``: the first and last host uid of the uid mode's boxes."""
    try:
        return current().box_uids
    except SettingError as exc:
        raise SandboxUnavailable(str(exc)) from exc


#: bwrap's options for a box in the uid mode: every namespace but the user namespace (whose
#: uid would map to root, whom ``RLIMIT_NPROC`` exempts), and the three capabilities that
#: ``setpriv`` needs to become the box's uid, with no capability left, before anything else
#: runs (:func:`limited`)
UID_MODE_OPTIONS = (
    "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
    "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP",
)  # fmt: skip


def limited(
    argv: Sequence[str], uid: int | None = None, mode: str | None = None, pids: int | None = None
) -> list[str]:
    """``argv``, to run inside a box, under the box's process limit where that is
    ``RLIMIT_NPROC``: as host uid ``uid`` with no capabilities left (``mode`` ``"uid"``,
    a box started with :data:`UID_MODE_OPTIONS`), or inside its user namespace
    (``"rlimit"``); ``mode`` is :func:`wanted_limit`'s by default, ``pids`` the limit
    (:func:`pids_limit`)."""
    mode = mode or wanted_limit()
    n = pids or pids_limit()
    prlimit = [str(box_tool("prlimit")), f"--nproc={n}:{n}", "--"]
    if mode == "uid" and uid is not None:
        setpriv = [str(box_tool("setpriv")), f"--reuid={uid}", f"--regid={uid}"]
        setpriv += ["--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]
        return [*setpriv, *prlimit, *argv]
    if mode == "rlimit":
        return [*prlimit, *argv]
    return list(argv)


def in_cgroup() -> list[str]:
    """The start of a box's command line that moves it into a pids cgroup of its own."""
    base = _pids_cgroups()
    if base is None or not current().box_cgroup:
        return []
    sweep_cgroups()
    folder = _new_cgroup(base, str(next(_box_count)), pids_limit())
    script = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'
    return ["/bin/sh", "-c", script, "kf-box", str(folder)]


def open_perms(uid: int | None, mode: str) -> list[str]:
    """bwrap's ``--perms`` for the next folder a box makes, where its processes are not
    the folder's owner (the uid mode: bwrap makes it as root)."""
    return [] if uid is None else ["--perms", mode]


def open_parents(path: Path, uid: int | None, made: set[Path]) -> list[str]:
    """In the uid mode, the folders above ``path`` made open to the box's uid before it is
    bound (bwrap makes missing ones with the host folder's mode, ``/root``'s 0700 say);
    folders that exist in the box already are left as they are."""
    if uid is None:
        return []
    out: list[str] = []
    for parent in reversed(path.parents[:-1]):  # outermost first, "/" left out
        if parent not in made:
            made.add(parent)
            out += ["--perms", "0755", "--dir", str(parent)]
    return out


def give_to(path: Path, uid: int | None) -> None:
    """In the uid mode, ``path`` (and what a folder holds) to the box's uid: the box may
    write there and nowhere else on the host."""
    if uid is None:
        return
    for each in [path, *(path.rglob("*") if path.is_dir() else ())]:
        os.chown(each, uid, uid, follow_symlinks=False)


#: the process limit the probe of the uid mode sets, and forks past
PROBE_PIDS = 16


def probe_findings(exe: str, found: dict[str, Any], mode: str, pids: int) -> str | None:
    """What is wrong with the box the probe found, or None."""
    if found["net"]:
        return f"{exe} failed its start-up probe: the box's network namespace reached 127.0.0.1"
    if found["pid"] != 2:  # pid 1 is bwrap's init in the box's own PID namespace
        return f"{exe} started no PID namespace (the runner's pid is {found['pid']})"
    first, last = box_uids()
    if mode != "uid":
        if found["uid"] != BOX_UID:
            return f"{exe} failed its start-up probe: the box's uid is {found['uid']}"
        return None
    if not first <= found["uid"] <= last:
        return f"the box's uid is {found['uid']}, not one of KF_BOX_UIDS {first}-{last}"
    if any(found["caps"]):
        return f"the box's processes kept capabilities ({found['caps']})"
    if found["gpu"]:
        return f"the box's uid may not open {', '.join(found['gpu'])}"
    if found["unreadable"]:
        return f"the box's uid may not read {', '.join(found['unreadable'])}"
    if found["forked"] >= pids or not found["fork_error"]:
        return f"RLIMIT_NPROC is not enforced here: {found['forked']} forks under a limit of {pids}"
    return None
