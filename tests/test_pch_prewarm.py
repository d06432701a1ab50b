"""The precompiled ``torch/extension.h`` made before the first wave of builds
(kf.evaluation.grader.pch_prewarm), and builds while a header is being made
(kf.evaluation.grader.builds._pch_folders: the first goes on, the others wait). The GPU
side (a real CUDA build making the header) runs on the H200 (docs/gpu.md); here the
waiting, the architecture and the prewarm's refusals, with a scripted ``nvidia-smi``."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kf.evaluation.grader import builds, pch_prewarm


def _smi(folder: Path, answer: str) -> None:
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "{answer}"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_the_architecture_is_the_runners(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$TORCH_CUDA_ARCH_LIST`` where set (as a runner's own environment says), else the
    compute capability nvidia-smi gives, else unknown."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    _smi(tmp_path, "9.0")
    assert pch_prewarm.arch_of("cuda:0") == "9.0"
    _smi(tmp_path, "No devices were found")
    assert pch_prewarm.arch_of("cuda:0") is None
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    assert pch_prewarm.arch_of("cuda:0") == "8.6"


def test_no_prewarm_without_an_architecture_or_a_box(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is built where the architecture is unknown or builds are not boxed."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    _smi(tmp_path, "No devices were found")
    assert "architecture is unknown" in pch_prewarm.prewarm_now("cuda:0")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv("KF_UNSAFE_NO_SANDBOX", "1")
    assert "not boxed" in pch_prewarm.prewarm_now("cuda:0")


class _HeldStep(NamedTuple):
    """The grader's header step, replaced by one held until ``release`` is set: it
    records each folder it was asked to make (``steps``), sets ``making`` when it starts
    and ``published`` when released; a folder reads as usable once published."""

    published: threading.Event
    making: threading.Event
    release: threading.Event
    steps: list[Path]
    args: dict[str, Any]
    env: dict[str, Any]


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _HeldStep:
    """A header step held until released, for a C++ call's key (see :class:`_HeldStep`)."""
    from kf.cuda import pch as pch_mod

    step = _HeldStep(threading.Event(), threading.Event(), threading.Event(), [], {}, {})

    def make(arguments: Any, env: Any, shared: Path, limit_s: float) -> str:
        step.steps.append(shared)
        step.making.set()
        assert step.release.wait(60)
        step.published.set()
        return "ok"

    monkeypatch.setattr(pch_mod, "usable", lambda folder: step.published.is_set())
    monkeypatch.setattr(builds, "_make_pch", make)
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KF_PCH", "all")
    step.args.update(name="x", cpp_sources="", with_cuda=False)
    step.env.update(builds.toolchain(None))
    return step


def test_pch_first_build_does_not_wait_for_a_slow_header(held: _HeldStep) -> None:
    """While the grader's step makes a header (held here until released), the first build
    of its key goes on without it at once, a second waits for the first to be done (one
    compile of torch/extension.h at a time beside the step), one that may not wait goes
    on, and a build after the step reads the published header; the step runs once and no
    build box is ever given a folder to make one in."""
    from kf.cuda import inline

    published, making, release, steps, args, env = held
    pch = inline.pch_key(args, env)
    seen: dict[str, Any] = {}
    inside = {name: threading.Event() for name in ("first", "second")}
    leave = {name: threading.Event() for name in ("first", "second")}

    def build(name: str, wait_s: float) -> None:
        with builds._pch_folders(args, env, wait_s, 60.0) as box_env:
            seen[name] = (box_env, published.is_set())
            if name in inside:
                inside[name].set()
                assert leave[name].wait(60)

    first = threading.Thread(target=build, args=("first", 60.0))
    first.start()
    assert inside["first"].wait(60), "the first build waited for the header"
    assert making.is_set() and not published.is_set()
    second = threading.Thread(target=build, args=("second", 60.0))
    second.start()
    with builds._pch_done:  # until the second waits for its turn
        assert builds._pch_done.wait_for(lambda: builds._pch_waiting.get(pch) == 1, 60)
    assert not inside["second"].is_set()
    build("impatient", 0.0)  # no wait: without the header, as before
    leave["first"].set()
    first.join(60)
    assert inside["second"].wait(60)  # the first's turn is over: the second goes on
    leave["second"].set()
    second.join(60)
    release.set()
    assert builds.wait_for_pch(args, env, 60)
    build("after", 60.0)
    assert [seen[n][1] for n in ("first", "second", "impatient", "after")] == [
        False,
        False,
        False,
        True,
    ]
    assert len(steps) == 1
    assert {box_env["KF_PCH_DIR"] for box_env, _ in seen.values()} == {str(steps[0])}
    assert not any("KF_PCH_MAKE" in box_env for box_env, _ in seen.values())


def test_pch_make_waits_for_a_step_in_progress(held: _HeldStep) -> None:
    """The prewarm's :func:`builds.make_pch` makes the header in its own thread, and a
    second caller for the same key waits for that step instead of running another."""
    _, making, release, steps, args, env = held
    said: list[str] = []
    first = threading.Thread(target=lambda: said.append(builds.make_pch(args, env, 60.0)))
    first.start()
    assert making.wait(60)
    second = threading.Thread(target=lambda: said.append(builds.make_pch(args, env, 60.0)))
    second.start()
    release.set()
    first.join(60)
    second.join(60)
    assert said == ["ok", "ok"] and len(steps) == 1
    assert builds.make_pch(args, env, 60.0) == "made already"


def _cuda_build_possible() -> bool:
    import torch.utils.cpp_extension as ext

    return ext.CUDA_HOME is not None


@pytest.mark.skipif(_cuda_build_possible(), reason="a CUDA PyTorch builds it: the GPU test")
def test_the_prewarm_build_goes_the_grader_s_way_and_says_why_it_made_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU PyTorch (no CUDA_HOME) the prewarm's call passes the grader's checks, goes
    to the writer and its build, and the reason it made no header is PyTorch's own."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    _smi(tmp_path, "9.0")
    why = pch_prewarm.prewarm_now("cuda:0")
    assert why.startswith("its build did not make it") and "CUDA_HOME" in why, why


@pytest.mark.gpu
@pytest.mark.skipif(
    not _cuda_build_possible(), reason="needs a CUDA PyTorch and nvcc (CI has neither)"
)
def test_the_prewarm_makes_the_header_a_candidates_build_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU host: the prewarm makes the header of a flagless CUDA call, and says so the
    second time without building."""
    from kf.cuda import inline
    from kf.cuda import pch as pch_mod

    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    arch = pch_prewarm.arch_of("cuda:0")
    assert arch is not None
    assert pch_prewarm.prewarm_now("cuda:0").startswith("made in")
    bound = inline.build_material(inline.bound_arguments(**pch_prewarm.ARGUMENTS))
    key = inline.pch_key(bound, builds.toolchain(arch))
    assert pch_mod.usable(inline.cache_root() / "pch" / key)
    assert pch_prewarm.prewarm_now("cuda:0") == "made already"
