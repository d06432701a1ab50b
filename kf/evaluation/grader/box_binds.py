"""What a box binds of the host: kf's own packages, the Python installation, what pip
installed in ``PYTHONPATH`` folders, the shared libraries of ``LD_LIBRARY_PATH`` folders,
a compiler prefix's standard parts, and the system and GPU files a runner needs; never a
user's folders as a whole (docs/sandbox.md). Split from :mod:`kf.evaluation.grader.box`, which
starts boxes with these binds."""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from kf.settings import current


def kf_package_root() -> Path:
    """The folder holding kf's package (a checkout for an editable install)."""
    import kf

    return Path(kf.__file__).resolve().parent.parent


def pythonpath_folders() -> dict[Path, list[Path]]:
    """The grader's ``$PYTHONPATH`` folders that hold installed packages (``pip --target``,
    as on a machine without a registry), each with what is bound of it: only what pip
    installed there (:func:`installed_entries`), never the folder itself. A project folder
    on ``PYTHONPATH`` (its ``.env``, ``.ssh``, the run's log) is not bound; neither is a
    folder holding kf's checkout (the box sees only the checkout's ``kf`` package)."""
    kf_root = kf_package_root()
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
            tops = {t for t in (meta / "top_level.txt").read_text().split() if t.isidentifier()}
            # the package's folder or the module's file, exactly: never every entry that
            # starts with its name (``h`` bound ``history_of_secrets`` beside it: NX10)
            names.update(n.name for n in folder.iterdir() if _module_name(n.name) in tops)
    return tuple(sorted(n for n in names if (folder / n).exists() and not n.startswith(".")))


#: a module's file: ``name.py``, ``name.pyc``, or an extension ``name[.tag].so``/``.pyd``
_MODULE_FILE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:\.pyc?|(?:\.[A-Za-z0-9_-]+)?\.(?:so|pyd))?")


def _module_name(entry: str) -> str | None:
    """The top-level module an entry of a folder on ``sys.path`` is (a package's folder,
    a module's file), or None."""
    found = _MODULE_FILE.fullmatch(entry)
    return found.group(1) if found else None


def _python_paths(python: str) -> list[Path]:
    """The Python installation(s) the runner's interpreter needs, read-only."""
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix)}
    for entries in pythonpath_folders().values():
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


def system_binds(args: list[str]) -> None:
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


def gpu_binds(args: list[str]) -> None:
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
    kf_root = kf_package_root()
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
    paths: list[Path] = [*_python_paths(python), Path(kf_package_root()) / "kf", *_tool_paths()]
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(name):
            paths.append(Path(os.environ[name]))
    paths += current().sandbox_ro_paths
    paths += [Path(p) for p in extra]
    cache = shared_cache()
    if cache is not None:
        paths.append(cache)
    return paths


def library_folders(value: str) -> dict[Path, list[Path]]:
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


def readonly_binds(python: str, extra: Iterable[str]) -> list[Path]:
    paths = _whole_roots(python, extra)
    for files in library_folders(os.environ.get("LD_LIBRARY_PATH", "")).values():
        paths += files
    out: list[Path] = []
    for path in (p.absolute() for p in paths):
        if path.exists() and path not in out and not str(path).startswith(_NOT_BOUND):
            out.append(path)
    return out


#: processes (threads included) one box may hold at once: ``$KF_SANDBOX_PIDS``, else
#: 256, or 8 per core and 64 more where that is more (a runner's thread pools and a
#: build's compiler processes grow with the cores)


def shared_cache() -> Path | None:
    """The grader's build cache (``$KF_CACHE_DIR`` or ``~/.cache/kf``), if it exists:
    bound read-only into every box, so runners reuse builds but cannot rewrite them."""
    root = current().cache_dir.absolute()
    # made here, so that it is bound from the first box on and builds the grader does
    # for boxed runners (kf.evaluation.grader.builds) show up in every box
    with contextlib.suppress(OSError):
        (root / "native").mkdir(parents=True, exist_ok=True)
    return root if root.is_dir() else None
