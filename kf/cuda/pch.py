"""A precompiled ``torch/extension.h`` for the C++ compiles of ``load_inline`` builds.

``load_inline`` writes a ``main.cpp`` that starts with ``#include <torch/extension.h>``:
about 390,000 lines once preprocessed, which g++ parses in every build (some 15 s of an
H200 host's build, 23 CPU-seconds on the 2-core development machine). A gcc precompiled
header (``torch/extension.h.gch``) made once per set of flags takes that compile to
about 9 CPU-seconds there. gcc uses a precompiled header only where it is valid for the
compile (same compiler, same options, same macros where the header uses them) and
otherwise reads the header itself, so the object it writes is the same either way
(checked: byte-identical objects, ``tests/test_pch.py``).

How a compile gets one (:func:`extra_args`, called by :mod:`kf.cuda.objcache` for each
g++ compile whose source starts with that include, with the folders its launcher was
made with, ``--pch-dir`` and ``--pch-make``):

- the look-up folder: ``<dir>/torch/extension.h.gch`` beside
  a link ``<dir>/torch/extension.h`` to PyTorch's own header (gcc takes later includes of
  the same name from the folder its precompiled header came from). When it holds a
  header marked usable, the compile gets ``-I <dir>`` in front of its arguments.
- Otherwise, where a writable folder to make one in is given, the header is made there
  first (under a lock), with the compile's own arguments less its source, outputs,
  dependency file and ``TORCH_EXTENSION_NAME`` (which PyTorch's headers do not use), and
  a probe compile with ``-Werror=invalid-pch`` checks that gcc accepts it; a header gcc
  refuses is marked unusable, never offered.

Who chooses the two: :func:`kf.cuda.inline.load_inline` (both the cache's
``pch/<key>``, unboxed), or, through ``$KF_PCH_DIR`` and ``$KF_PCH_MAKE``, the grader
(:mod:`kf.evaluation.grader.builds`): a candidate's build box gets only the shared cache's
folder, read-only; the header is made by the grader's own step (kf's one-function module
with the call's flag arguments, ``main.o`` alone, in a box of its own, the only one ever
given ``$KF_PCH_MAKE``) and published under the key the grader computed itself
(:func:`kf.cuda.inline.pch_key`), with its sha256 (:data:`DIGEST`), only from a
successful compile. No candidate's build can so write the header another compiles with.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "DIGEST",
    "GCH",
    "HEADER",
    "MARK",
    "extra_args",
    "flags_for_header",
    "starts_with_torch",
    "usable",
]

HEADER = "torch/extension.h"
GCH = "torch/extension.h.gch"
#: written beside a header that passed its probe (``ok``) or failed it (``unusable``)
MARK = "kf-pch-state"
#: beside a header the grader published: the sha256 of its ``.gch`` as its step made it
DIGEST = "kf-pch-sha256"

_DROP_WITH_VALUE = frozenset({"-o", "-MF", "-MT", "-MQ"})
_DROP = frozenset({"-c", "-MD", "-MMD"})


def starts_with_torch(source: str) -> bool:
    """Whether the file's first line is ``#include <torch/extension.h>`` (as
    ``load_inline``'s ``main.cpp`` always is)."""
    try:
        with open(source, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.strip().replace(b" ", b"") == b"#include<torch/extension.h>"


def flags_for_header(args: Sequence[str], source_index: int) -> list[str]:
    """The compile's arguments less its source, outputs, depfile and extension name."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if i == source_index or arg in _DROP:
            continue
        if arg in _DROP_WITH_VALUE:
            skip = True
            continue
        if arg.startswith(("-o", "-MF")) and len(arg) > 3:
            continue
        if arg.startswith("-DTORCH_EXTENSION_NAME="):
            continue
        if arg == "-D" and i + 1 < len(args) and args[i + 1].startswith("TORCH_EXTENSION_NAME="):
            skip = True
            continue
        out.append(arg)
    return out


def usable(folder: Path) -> bool:
    """Whether ``folder`` holds a header that passed its probe."""
    try:
        return (folder / MARK).read_text() == "ok" and (folder / GCH).is_file()
    except OSError:
        return False


def _torch_header(flags: Sequence[str]) -> Path | None:
    """PyTorch's own ``torch/extension.h``, from the first ``-isystem``/``-I`` that has it."""
    for i, arg in enumerate(flags):
        folder = None
        if arg in ("-isystem", "-I") and i + 1 < len(flags):
            folder = flags[i + 1]
        elif arg.startswith("-I") and len(arg) > 2:
            folder = arg[2:]
        if folder and (Path(folder) / HEADER).is_file():
            return Path(folder) / HEADER
    return None


def _make(compiler: str, flags: list[str], folder: Path) -> str:
    """Make and probe the header in ``folder``; ``ok`` or why not."""
    real = _torch_header(flags)
    if real is None:
        return "no torch/extension.h on the include path"
    (folder / "torch").mkdir(parents=True, exist_ok=True)
    link = folder / HEADER
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(real)
    fd, temp = tempfile.mkstemp(dir=folder / "torch", prefix=".gch-")
    os.close(fd)
    made = subprocess.run(
        [compiler, *flags, "-x", "c++-header", str(real), "-o", temp, "-w"],
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        os.unlink(temp)
        return f"the header did not compile (status {made.returncode})"
    os.replace(temp, folder / GCH)
    with tempfile.TemporaryDirectory() as probe_dir:
        probe = Path(probe_dir) / "probe.cpp"
        probe.write_text(f"#include <{HEADER}>\n#include <{HEADER}>\nint kf_pch_probe;\n")
        checked = subprocess.run(
            [
                *(compiler, "-I", str(folder), *flags, "-DTORCH_EXTENSION_NAME=kf_pch_probe"),
                *("-Winvalid-pch", "-Werror=invalid-pch", "-fsyntax-only", str(probe)),
            ],
            capture_output=True,
            check=False,
        )
    if checked.returncode != 0:
        return "gcc refused it: " + checked.stderr.decode(errors="replace")[-300:]
    return "ok"


def extra_args(
    compiler: str,
    args: Sequence[str],
    source_index: int,
    look: str | None = None,
    make: str | None = None,
    gc: Sequence[str] = (),
) -> tuple[list[str], str]:
    """Arguments to put in front of this g++ compile, and what was done (for the log):
    the header in ``look`` if usable, else one made in ``make`` if given (``gc``: the
    compiler's garbage-collector arguments, :func:`kf.cuda.objcache.gc_args`, which change
    nothing in the header but the time it takes)."""
    if not look and not make:
        return [], ""
    if not starts_with_torch(args[source_index]):
        return [], ""
    if look and usable(Path(look)):
        return ["-I", look], "pch"
    if not make:
        return [], "no pch (being made by another build)"
    folder = Path(make)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            made = ""
            if not (folder / MARK).exists():
                start = time.perf_counter()
                state = _make(compiler, [*gc, *flags_for_header(args, source_index)], folder)
                (folder / MARK).write_text("ok" if state == "ok" else "unusable")
                if state != "ok":
                    return [], f"no pch ({state})"
                made = f" in {time.perf_counter() - start:.1f}s"
    except OSError as exc:
        return [], f"no pch ({exc})"
    if not usable(folder):
        return [], "no pch (unusable)"
    return ["-I", str(folder)], f"pch made{made}" if made else "pch"
