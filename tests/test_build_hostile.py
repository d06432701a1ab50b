"""Hostile ``load_inline`` builds (issue 43, NB6 and NW4): what one candidate's build can
do to the grader's other builds, tried with real builds in real build boxes.

- A flag is literal: shell or ninja syntax in ``extra_cflags``/``extra_ldflags`` runs
  nothing (``kf.cuda.inline.literal_arguments``); what ninja cannot hold (a newline) is
  refused with one line the model sees.
- The shared precompiled header is made by the grader's own step, never in a
  candidate's build: a candidate whose link step writes over the header it would have
  made changes nothing others compile against.
- The trusted writer never writes where a build box has written: a ``lock`` left by a
  first try does not hold the writer (and every other build behind it).

The modules are plain Python extensions (no torch include), but for the header's test.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from kf.cuda import inline, torchfree
from kf.evaluation.grader import box, builds, inline_writer
from kf.evaluation.grader.builds import _own_toolchain, build_inline

pytestmark = pytest.mark.skipif(box.probe() is not None, reason=f"no box here: {box.probe()}")

MODULE = """
#include <Python.h>
#define KF_STR(x) KF_STR2(x)
#define KF_STR2(x) #x
static PyMethodDef methods[] = {{NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, KF_STR(TORCH_EXTENSION_NAME), NULL, -1, methods};
#define KF_CAT(a, b) a##b
#define KF_INIT(name) KF_CAT(PyInit_, name)
PyMODINIT_FUNC KF_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""


def _plain(name: str, **flags: Any) -> dict[str, Any]:
    return {
        "name": name,
        "cpp_sources": MODULE,
        "no_implicit_headers": True,
        "with_cuda": False,
        **flags,
    }


def _markers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith("kf_marker")]


#: what each flag would run through ninja's ``sh -c``: a backtick in a compile flag, a
#: ``;`` in a link flag (the probe's attack), and a newline that writes a ninja rule
INJECTIONS = {
    "backtick": {"extra_cflags": ["-O1", "-DKF_X=`touch kf_marker_tick`"]},
    "semicolon": {"extra_ldflags": ["-lm;touch kf_marker_semi;c++ main.o -shared"]},
    "newline": {
        "extra_cflags": [
            "-O1\nrule kf_inject\n  command = touch kf_marker_nl\n"
            "build kf_marker_nl: kf_inject\ndefault kf_marker_nl"
        ]
    },
}


@pytest.mark.parametrize("attack", sorted(INJECTIONS))
def test_a_flag_with_shell_or_ninja_syntax_runs_nothing(
    attack: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flag holding a backtick, a ``;`` or a newline reaches the compiler as text, or is
    refused: the command it hides never runs (no marker file anywhere in the cache)."""
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    args = _plain(f"kf_inject_{attack}", **INJECTIONS[attack])
    result = build_inline(args, {**_own_toolchain(), "arch": None}, 300)
    assert _markers(tmp_path) == [], result
    if attack == "newline":
        assert not result["ok"]
        assert "newline" in result["error"] and "extra_cflags" in result["error"]


def test_literal_arguments_quote_each_word_for_ninja_and_the_shell() -> None:
    """Plain flags are unchanged (the same ninja file as before); a word with shell or
    ninja syntax becomes one quoted literal; a newline is refused, naming the argument."""
    same = {"extra_cflags": ["-O3", "-DX=1"], "extra_ldflags": ["-lcublas"], "name": "n"}
    assert inline.literal_arguments(same) == same
    out = inline.literal_arguments({"extra_cflags": ["-DA=$x `y`;z", "-Xa -Xb"]})
    assert out["extra_cflags"] == ["'-DA=$$x'", "'`y`;z'", "-Xa", "-Xb"]
    paths = inline.literal_arguments({"extra_include_paths": ["/a $b"]})
    assert paths["extra_include_paths"] == ["/a $$b"]
    with pytest.raises(ValueError, match=r"extra_ldflags.*newline"):
        inline.literal_arguments({"extra_ldflags": ["-lm\n-lc"]})


def _torch_call(**flags: Any) -> dict[str, Any]:
    return {
        "name": "kf_pch_victim",
        "cpp_sources": "torch::Tensor kf_same(torch::Tensor x) { return x; }",
        "functions": ["kf_same"],
        "with_cuda": False,
        "extra_cflags": ["-O1"],
        **flags,
    }


@pytest.mark.slow
def test_a_candidate_cannot_replace_the_shared_precompiled_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first build of a header key links with a flag that writes over the header its
    build would have made (``-Wl,-Map=`` to that path, no shell needed): the header
    published is still gcc's own, made by the grader's step, and its recorded hash is
    the published file's."""
    from kf.cuda import pch as pch_mod

    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KF_PCH", "all")  # a CPU host uses the header only when asked
    env = {**_own_toolchain(), "arch": None}
    honest = inline.build_material(inline.bound_arguments(**_torch_call()))
    key = inline.pch_key(honest, env)
    target = f"../../pch/{key}/{pch_mod.GCH}"  # from the build's folder to the made header
    hostile = _torch_call(extra_ldflags=[f"-Wl,-Map={target}"])
    assert inline.pch_key(inline.build_material(inline.bound_arguments(**hostile)), env) == key
    build_inline(hostile, env, 600)
    # the header is made in the background (the first build does not wait for it)
    assert builds.wait_for_pch(inline.bound_arguments(**_torch_call()), env, 600)
    shared = inline.cache_root() / "pch" / key
    assert pch_mod.usable(shared)
    made = (shared / pch_mod.GCH).read_bytes()
    assert made.startswith(b"gpch"), made[:40]  # gcc's precompiled header, not a link map
    recorded = (shared / pch_mod.DIGEST).read_text()
    assert recorded == hashlib.sha256(made).hexdigest()


def test_a_lock_left_by_a_first_try_does_not_hold_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A two-try build (the CUDA path's, here on a C++ call) whose first try fails after
    its compile left a ``lock`` where PyTorch keeps its build lock: the second try is
    written without waiting on it (the writer is not killed for hanging), and the next
    build is served by the same writer."""
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    # the first try's main.cpp includes torch/extension.h: an empty one (in the cache,
    # which the box reads) keeps that compile short
    stub = tmp_path / "cache" / "stub"
    (stub / "torch").mkdir(parents=True)
    (stub / "torch" / "extension.h").write_text("")
    monkeypatch.setattr(inline_writer, "WRITE_LIMIT_S", 15.0)
    writer = inline_writer.writer()
    writer.start()
    started = writer.started
    env = {**_own_toolchain(), "arch": None}
    with monkeypatch.context() as two_tries:
        two_tries.setattr(torchfree, "wanted", lambda arguments, load_inline: True)
        result = build_inline(_plain("kf_locker", extra_cflags=[f"-I{stub}", "-MFlock"]), env, 300)
    assert result["ok"], result
    assert (Path(result["path"]) / "lock").is_file()  # the box's lock, in the box's folder
    assert writer.started == started
    honest = build_inline(_plain("kf_after_lock", extra_cflags=["-O1"]), env, 300)
    assert honest["ok"], honest
    assert writer.started == started
