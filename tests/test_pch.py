"""kf.cuda.pch: the precompiled ``torch/extension.h`` that ``load_inline``'s ``main.cpp``
compiles against, made once per set of flags, and how the grader publishes one that a
build box made. The header is really made with g++ (about a minute on the 2-core
machine, once for the module) and really used."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension as ext

from kf.cuda import pch

GXX = shutil.which("g++")
pytestmark = [pytest.mark.skipif(GXX is None, reason="needs g++"), pytest.mark.slow]

#: main.cpp as load_inline writes it, with a second include of the header (candidates'
#: cpp_sources often have one) and a pybind11 module
MAIN = """#include <torch/extension.h>
#include <torch/extension.h>
torch::Tensor twice(torch::Tensor x) { return x * 2 + x.sum(); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice, "twice"); }
"""


def _flags() -> list[str]:
    """The flags PyTorch's ninja file gives main.cpp of a C++-only load_inline build."""
    include = sysconfig.get_paths()["include"]
    paths = [a for p in ext.include_paths() for a in ("-isystem", p)]
    return ["-DTORCH_API_INCLUDE_EXTENSION_H", *paths, "-isystem", include, "-fPIC", "-std=c++17"]


def _start(folder: Path, env: dict[str, str], *pch_folders: str) -> subprocess.Popen[str]:
    """Start compiling folder/main.cpp through the object-cache launcher as ninja would,
    with the launcher's ``--pch-dir``/``--pch-make`` options ``pch_folders``."""
    command = [sys.executable, "-m", "kf.cuda.objcache", *pch_folders, str(GXX)]
    command += ["-MMD", "-MF", "main.o.d"]
    command += ["-DTORCH_EXTENSION_NAME=kf_pch_test", *_flags(), "-c", "main.cpp", "-o", "main.o"]
    return subprocess.Popen(
        command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _compile(
    folder: Path, env: dict[str, str], *pch_folders: str
) -> subprocess.CompletedProcess[str]:
    """:func:`_start`, waited for."""
    proc = _start(folder, env, *pch_folders)
    out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """main.cpp compiled twice through the launcher, in two caches: with the header made
    on the way (``KF_PCH_MAKE``), and with none (both at once: the second core compiles
    the plain one while the first makes the header)."""
    root = tmp_path_factory.mktemp("pch")
    results: dict[str, object] = {"folder": root / "pch" / "k"}
    procs = {}
    for arm in ("with", "without"):
        folder = root / arm
        folder.mkdir()
        (folder / "main.cpp").write_text(MAIN)
        env = {**os.environ, "KF_CACHE_DIR": str(root / f"cache-{arm}")}
        where = str(results["folder"])
        options = ("--pch-dir", where, "--pch-make", where) if arm == "with" else ()
        procs[arm] = _start(folder, env, *options)
    logs = {arm: proc.communicate()[1] for arm, proc in procs.items()}
    for arm, proc in procs.items():
        assert proc.returncode == 0, logs[arm]
        results[arm] = (root / arm / "main.o").read_bytes()
        results[f"{arm}_log"] = logs[arm]
    return results


def test_pch_is_made_probed_and_used(built: dict[str, object]) -> None:
    """The first compile makes the header, gcc's probe accepts it, and the compile uses it."""
    folder = built["folder"]
    assert isinstance(folder, Path)
    assert pch.usable(folder)
    assert (folder / pch.GCH).stat().st_size > 1_000_000
    assert "(pch made in" in str(built["with_log"]), built["with_log"]
    assert "pch" not in str(built["without_log"])


def test_pch_object_is_byte_identical_to_the_plain_compile(built: dict[str, object]) -> None:
    """gcc with the precompiled header writes the very object it writes without one."""
    assert built["with"] == built["without"]


def test_a_second_compile_uses_the_made_header(built: dict[str, object], tmp_path: Path) -> None:
    """Another build with the same flags finds the header (read-only look-up only) and
    its object is again the plain compile's."""
    folder = built["folder"]
    (tmp_path / "main.cpp").write_text(MAIN)
    env = {**os.environ, "KF_CACHE_DIR": str(tmp_path / "cache")}
    proc = _compile(tmp_path, env, "--pch-dir", str(folder))
    assert proc.returncode == 0, proc.stderr
    assert "(pch)" in proc.stderr, proc.stderr
    assert (tmp_path / "main.o").read_bytes() == built["without"]


def test_no_header_is_made_without_a_folder_to_make_it_in(tmp_path: Path) -> None:
    """A build whose look-up folder has no header and that may not make one (another
    build is making it) compiles plainly, and says so."""
    (tmp_path / "main.cpp").write_text(MAIN)
    missing = str(tmp_path / "missing")
    args, note = pch.extra_args(str(GXX), ["-c", str(tmp_path / "main.cpp")], 1, missing)
    assert args == []
    assert note == "no pch (being made by another build)"
    (tmp_path / "other.cpp").write_text("int x;\n")  # not load_inline's main.cpp: untouched
    other = ["-c", str(tmp_path / "other.cpp")]
    assert pch.extra_args(str(GXX), other, 1, missing, missing) == ([], "")


def test_flags_for_header_drop_outputs_and_the_extension_name() -> None:
    """The header is made with the compile's flags less what names this compile's files."""
    args = ["-MMD", "-MF", "m.d", "-DTORCH_EXTENSION_NAME=x", "-O2", "-c", "main.cpp", "-o", "m.o"]
    assert pch.flags_for_header(args, 6) == ["-O2"]
    assert pch.flags_for_header(["-D", "TORCH_EXTENSION_NAME=y", "-c", "a.cpp", "-oa.o"], 3) == []


def test_torch_headers_in_cuda_sources_are_noticed() -> None:
    """A build whose CUDA sources include PyTorch's headers is told so (its compile report
    carries the note the model reads); plain CUDA sources are not."""
    from kf.cuda.inline import torch_in_cuda_sources

    assert torch_in_cuda_sources("#include <torch/extension.h>\n__global__ void k() {}\n")
    assert torch_in_cuda_sources(["#include <cuda_runtime.h>\n", ' # include "ATen/ATen.h"\n'])
    assert not torch_in_cuda_sources("#include <cuda_runtime.h>\n// torch/extension.h\n")
    assert not torch_in_cuda_sources(None)


def test_the_grader_publishes_only_the_header_and_links_torchs_own(tmp_path: Path) -> None:
    """A header made by the grader's step is published as its .gch alone, and only while
    it is the file the step hashed: the link beside it is the grader's own, to PyTorch's
    header, whatever the box left there."""
    from kf.evaluation.grader import builds

    made = tmp_path / "work" / "pch" / "k"
    (made / "torch").mkdir(parents=True)
    (made / pch.GCH).write_bytes(b"not really a header")
    (made / pch.MARK).write_text("ok")
    (made / pch.HEADER).symlink_to("/etc/passwd")
    shared = tmp_path / "cache" / "pch" / "k"
    builds._publish_pch(made, shared, hashlib.sha256(b"another header").hexdigest())
    assert not shared.exists()  # not the file its step hashed: nothing published
    (made / pch.GCH).write_bytes(b"not really a header")
    builds._publish_pch(made, shared, hashlib.sha256(b"not really a header").hexdigest())
    assert pch.usable(shared)
    link = Path(os.readlink(shared / pch.HEADER))
    assert link.name == "extension.h" and link.parent.name == "torch"
    assert link.is_file() and str(link) != "/etc/passwd"
    assert (shared / pch.GCH).read_bytes() == b"not really a header"
