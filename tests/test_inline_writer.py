"""Boxed ``load_inline`` builds written by the grader's writer (kf.evaluation.grader.inline_writer).

The build box used to run a Python that imported torch only to write ``main.cpp``,
``cuda.cu`` and ``build.ninja`` and run ninja; now a trusted writer process writes them
with PyTorch's own ``load_inline`` and the box runs only ninja. Shown here with real
builds in real boxes: the writer writes exactly what the box's Python wrote (the same
``build.ninja`` and sources, the same working module), a failed build still shows the
compiler's own error, a dead writer is replaced, and what the writer cannot write (a call
asking for PyTorch's own precompiled header) is built the old way.

The modules are plain Python extensions (``no_implicit_headers``, no torch include), so
each build takes well under a second of compiling.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kf.cuda import inline, torchfree
from kf.evaluation.grader import box, inline_writer
from kf.evaluation.grader.builds import _own_toolchain, build_inline

pytestmark = pytest.mark.skipif(box.probe() is not None, reason=f"no box here: {box.probe()}")

MODULE = """
#include <Python.h>
static PyObject* triple(PyObject* self, PyObject* arg) {
    long v = PyLong_AsLong(arg);
    return PyLong_FromLong(3 * v + %(offset)d);
}
static PyMethodDef methods[] = {{"triple", triple, METH_O, "3x"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, TORCH_EXTENSION_NAME_STR, NULL, -1, methods};
#define KF_CAT(a, b) a##b
#define KF_INIT(name) KF_CAT(PyInit_, name)
PyMODINIT_FUNC KF_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""


def _args(offset: int, name: str = "kf_plain") -> dict[str, Any]:
    source = MODULE % {"offset": offset}
    source = "#define TORCH_EXTENSION_NAME_STR KF_STR(TORCH_EXTENSION_NAME)\n" + source
    source = "#define KF_STR(x) KF_STR2(x)\n#define KF_STR2(x) #x\n" + source
    return {
        "name": name,
        "cpp_sources": source,
        "no_implicit_headers": True,
        "with_cuda": False,
        "extra_cflags": ["-O1"],
    }


def _load(path: Path, name: str) -> Any:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _built(args: dict[str, Any]) -> tuple[dict[str, Any], Path, str]:
    env = {**_own_toolchain(), "arch": None}
    result = build_inline(dict(args), env, 300)
    bound = inline.build_material(inline.bound_arguments(**args))
    module_name = inline.extension_module_name(args["name"], inline.binding_key(bound, env))
    assert result["ok"], result.get("error", "") + result.get("log", "")[-3000:]
    return result, Path(result["path"]), module_name


def _normalised(folder: Path) -> str:
    """The ninja file with the build's own folders (its work folder, the box's cache)
    replaced by placeholders."""
    text = (folder / "build.ninja").read_text()
    text = re.sub(r"/[^ \n]*/objects/bin/", "<launchers>/", text)
    return re.sub(r"/[^ \n]*/cuda_ext/[0-9a-f]{24}(\.build-\d+)?", "<build>", text)


def test_the_writer_writes_what_the_box_python_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same call built both ways, each into a cache of its own: the same sources, the
    same ninja file but for the build's own folders, and modules that compute the same;
    the written build ran no Python of its own in the box (its folder has no trace of
    PyTorch's lock or versioning beyond what ninja leaves)."""
    args = _args(7)
    # as on the H200 machines, whose image sets it: a build keyed without an architecture
    # (arch None) must not see the grader's (the box's Python keyed it "9.0" there)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "written"))
    _, written, module_name = _built(args)
    before = inline_writer.writer().started
    assert before >= 1
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "python"))
    monkeypatch.setattr(inline_writer, "usable", lambda arguments: False)
    _, in_python, same_name = _built(args)
    assert same_name == module_name
    assert inline_writer.writer().started == before  # the old way asked no writer
    assert (written / "main.cpp").read_bytes() == (in_python / "main.cpp").read_bytes()
    assert _normalised(written) == _normalised(in_python)
    assert "<launchers>/c++-" in _normalised(written)  # the object cache's launcher, both ways
    for folder in (written, in_python):
        assert (folder / "kf-build.json").read_text() == '{"cuda_prelude": ""}'
        module = _load(folder / f"{module_name}.so", module_name)
        assert module.triple(5) == 22


def test_a_failed_build_shows_the_compilers_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile error reaches the runner as PyTorch said it: the exit status, PyTorch's
    "Error building extension" and the compiler's own line naming the bad token."""
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    args = _args(1, name="kf_broken")
    args["cpp_sources"] += "\nint kf_broken_here = undeclared_name_kf;\n"
    result = build_inline(dict(args), {**_own_toolchain(), "arch": None}, 300)
    assert not result["ok"]
    assert result["error"] == "the load_inline build exited with status 1"
    assert "Error building extension 'kf_broken_" in result["log"]
    assert re.search(r"main\.cpp:\d+:\d+: error: .*undeclared_name_kf", result["log"])
    left = [p.name for p in (tmp_path / "cache" / "cuda_ext").iterdir()]
    assert all(name.endswith(".lock") for name in left), left  # nothing published


def test_a_dead_writer_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer killed between two builds: the next build starts another and succeeds."""
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    _built(_args(2))
    writer = inline_writer.writer()
    proc = writer._proc
    assert proc is not None and proc.poll() is None
    started = writer.started
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _, folder, module_name = _built(_args(3))
    assert writer.started == started + 1
    assert _load(folder / f"{module_name}.so", module_name).triple(1) == 6


def test_prewarm_starts_the_writer_in_the_background() -> None:
    """A CUDA worker starts its writer as it starts (kf.app.orchestra.worker_plan): the call
    returns at once, and the process is there before the first build asks for it."""
    writer = inline_writer.writer()
    writer.close()
    started = writer.started
    inline_writer.prewarm()
    for _ in range(200):
        if writer.started > started:
            break
        time.sleep(0.05)
    assert writer.started == started + 1
    proc = writer._proc
    assert proc is not None and proc.poll() is None


def test_a_writer_that_does_not_answer_fails_the_build_and_is_killed(tmp_path: Path) -> None:
    """A writer that hangs costs the build its limit, not the grader a thread: the request
    fails with its reason, and the process is gone."""
    hung = inline_writer.InlineWriter({"PATH": os.environ.get("PATH", "")})
    try:
        proc = hung._start()
        os.kill(proc.pid, signal.SIGSTOP)
        with pytest.raises(inline_writer.WriterFailed, match="no answer within 1s"):
            hung.write({"arguments": {}}, 1.0)
        assert proc.poll() is not None
    finally:
        hung.close()


def test_closing_does_not_wait_for_a_hung_request(tmp_path: Path) -> None:
    """The grader's exit closes the writer: with a request stuck on a hung writer, the
    close kills it within seconds instead of waiting for the request's limit, and the
    request fails with its reason."""
    import threading

    hung = inline_writer.InlineWriter({"PATH": os.environ.get("PATH", "")})
    proc = None
    try:
        proc = hung._start()
        os.kill(proc.pid, signal.SIGSTOP)
        failed: list[BaseException] = []

        def ask() -> None:
            try:
                hung.write({"arguments": {}}, 60.0)
            except inline_writer.WriterFailed as exc:
                failed.append(exc)

        asker = threading.Thread(target=ask)
        asker.start()
        for _ in range(400):  # until the request holds the writer
            if hung._lock.locked():
                break
            time.sleep(0.025)
        assert hung._lock.locked()
        start = time.monotonic()
        hung.close()
        asker.join(timeout=30)
        assert not asker.is_alive()
        assert time.monotonic() - start < 30  # not the request's 60 s
        assert failed and "build writer failed" in str(failed[0])
        assert proc.poll() is not None
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        hung.close()


def test_what_the_writer_cannot_write_is_built_the_old_way() -> None:
    """PyTorch's own precompiled header is made by running the compiler with the call's
    flags, which only a box may do: such a call is built by a Python in the box."""
    assert not inline_writer.usable({"use_pch": True})
    assert inline_writer.usable({"use_pch": False})


NVCC = shutil.which("nvcc")

#: the split layout: a torch-free kernel and launcher, the torch wrapper in cpp_sources
KERNEL = r"""
#include <stdint.h>
__global__ void kf_twice(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
void kf_launch(const float* x, float* y, int64_t n, cudaStream_t stream) {
    kf_twice<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(x, y, n);
}
"""
WRAPPER = r"""
#include <cuda_runtime.h>
void kf_launch(const float* x, float* y, int64_t n, cudaStream_t stream);
torch::Tensor kf_run(torch::Tensor x) {
    auto y = torch::empty_like(x);
    kf_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), nullptr);
    return y;
}
"""


def _cuda_home() -> str | None:
    """The CUDA toolkit's folder (``nvcc`` on ``PATH`` may be a link from elsewhere)."""
    assert NVCC is not None
    for home in (
        os.environ.get("CUDA_HOME"),
        Path(os.path.realpath(NVCC)).parent.parent,
        "/usr/local/cuda",
    ):
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return str(home)
    return None


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.skipif(
    torch.version.cuda is None,
    reason="a CPU build of PyTorch builds no CUDA extension (its CUDA_HOME is None)",
)
def test_a_cuda_build_is_written_by_the_writer_and_built_in_the_box(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A split-layout CUDA extension for the H200 (``9.0a``) built the boxed way: the
    writer writes PyTorch's nvcc rule and a ``cuda.cu`` without the torch include
    (kf.cuda.torchfree), ninja in the box compiles and links it, and it computes."""
    cuda_home = _cuda_home()
    if cuda_home is None:
        pytest.skip("no CUDA toolkit folder with include/cuda_runtime.h")
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KF_PCH", "0")  # the precompiled header is tests/test_pch.py's
    monkeypatch.setenv("CUDA_HOME", cuda_home)
    # a writer of its own, started with this environment
    fresh = inline_writer.InlineWriter(box.environment(os.environ, Path(tempfile.gettempdir()), {}))
    monkeypatch.setattr(inline_writer, "_writer", fresh)
    args = {
        "name": "kf_tf",
        "cpp_sources": WRAPPER,
        "cuda_sources": KERNEL,
        "functions": ["kf_run"],
    }
    env = {**_own_toolchain(), "arch": "9.0a"}
    try:
        result = build_inline(dict(args), env, 600)
    finally:
        fresh.close()
    assert result["ok"], result.get("error", "") + result.get("log", "")[-4000:]
    folder = Path(result["path"])
    assert json.loads((folder / "kf-build.json").read_text()) == {"cuda_prelude": "none"}
    assert (folder / "cuda.cu").read_text().startswith(torchfree.PLACEHOLDER)
    ninja = (folder / "build.ninja").read_text()
    assert "rule cuda_compile" in ninja and "arch=compute_90a,code=sm_90a" in ninja
    bound = inline.build_material(inline.bound_arguments(**args))
    module_name = inline.extension_module_name("kf_tf", inline.binding_key(bound, env))
    if torch.cuda.is_available():
        module = inline._import(module_name, folder / f"{module_name}.so", "kf-test")
        x = torch.arange(1000, dtype=torch.float32, device="cuda")
        assert torch.equal(module.kf_run(x), 2 * x)
