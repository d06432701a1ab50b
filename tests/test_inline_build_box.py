"""``load_inline`` builds that the grader does for boxed runners (kf.evaluation.grader.builds).

Inside its box a runner cannot write the shared build cache, so without this each runner
box (compile, verify, profile) rebuilt every CUDA candidate into its own cache: on the
H200 a 64 s build, three times over. Here a C++ ``load_inline`` extension is really built
in the build box, lands under the key the grader computed, is served from the cache the
second time, and requests that do not match the grader's toolchain are refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kf.cuda import inline
from kf.evaluation.grader import box
from kf.evaluation.grader.builds import _own_toolchain, build_inline

pytestmark = pytest.mark.skipif(box.probe() is not None, reason=f"no box here: {box.probe()}")

ARGS = {
    "name": "kf_test_twice",
    "cpp_sources": "torch::Tensor twice(torch::Tensor x) { return x * 2; }",
    "functions": ["twice"],
    "with_cuda": False,
    "extra_cflags": ["-O1"],
}


def _bound(arguments: dict[str, object]) -> dict[str, object]:
    """The arguments as a runner sends them: PyTorch's defaults filled in."""
    return inline.build_material(inline.bound_arguments(**arguments))


def test_build_inline_builds_in_the_box_and_serves_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    env = {**_own_toolchain(), "arch": "9.0"}
    first = build_inline(dict(ARGS), env, 600)
    assert first["ok"], first.get("error", "") + first.get("log", "")[-3000:]
    assert not first["cached"]
    key = inline.cache_key(_bound(ARGS), env)
    folder = Path(first["path"])
    assert folder == tmp_path / "cache" / "cuda_ext" / key
    module_name = inline.extension_module_name(
        "kf_test_twice", inline.binding_key(_bound(ARGS), env)
    )
    library = folder / f"{module_name}.so"
    assert library.is_file()
    assert not list((tmp_path / "cache" / "cuda_ext").glob("*.build-*"))  # work folder gone
    again = build_inline(dict(ARGS), env, 600)
    assert again["ok"] and again["cached"] and again["path"] == first["path"]
    # what a runner box then imports from the read-only shared cache works
    module = inline._import(module_name, library, key)
    assert torch.equal(module.twice(torch.arange(3)), torch.tensor([0, 2, 4]))


def test_build_inline_refuses_what_is_not_the_graders_toolchain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    own = _own_toolchain()
    other_python = build_inline(dict(ARGS), {**own, "python": "2.7.18", "arch": "9.0"}, 60)
    assert not other_python["ok"] and "toolchain" in other_python["error"]
    bad_arch = build_inline(dict(ARGS), {**own, "arch": "9.0; touch /x"}, 60)
    assert not bad_arch["ok"] and "architecture" in bad_arch["error"]
    with_folder = build_inline({**ARGS, "build_directory": "/tmp/x"}, {**own, "arch": "9.0"}, 60)
    assert not with_folder["ok"] and "malformed" in with_folder["error"]
    assert sys.version.split()[0] == own["python"]


def test_build_inline_takes_every_architecture_list_pytorch_takes() -> None:
    """``TORCH_CUDA_ARCH_LIST`` as CUDA images set it (the H200 machine's is ``9.0a``):
    refusing ``9.0a`` failed every boxed load_inline build there."""
    from kf.evaluation.grader.builds import _ARCH

    for arch in ("9.0", "9.0a", "10.0f", "8.6+PTX", "8.0;9.0a", "7.5 8.6 9.0+PTX"):
        assert _ARCH.fullmatch(arch), arch
    for arch in ("9", "9.0;", "9.0a; rm -rf /", "$(id)", "9.0 -x"):
        assert not _ARCH.fullmatch(arch), arch


def test_a_refused_build_names_its_reason_in_the_compile_report() -> None:
    """The grader's reason reaches the report: "C++ compilation failed" alone, with an
    empty log, was all the H200 run said."""
    from kf.evaluation.runner.candidate import _compile_failure
    from kf.native import NativeCompileError

    exc = NativeCompileError("malformed CUDA architecture '9.0a'", "")
    assert _compile_failure(exc) == "C++ compilation failed: malformed CUDA architecture '9.0a'"
    assert _compile_failure(NativeCompileError("", "")) == "C++ compilation failed"
