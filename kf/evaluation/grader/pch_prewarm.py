"""The precompiled ``torch/extension.h`` made as a CUDA worker starts.

A ``load_inline`` build's ``main.cpp`` reads ``torch/extension.h``; with kf's precompiled
header (:mod:`kf.cuda.pch`) that compile is about half as long. The header is made by
the grader's own step, in the background, when the first build of its key (the call's
flag arguments and the toolchain) comes; meanwhile one build at a time goes on without
it (:data:`builds.PCH_PIONEERS <kf.evaluation.grader.builds.PCH_PIONEERS>`: the first
verdict does not wait for the header, 59 s on the H200) and the others wait for it
(:data:`builds.PCH_WAIT_S <kf.evaluation.grader.builds.PCH_WAIT_S>`; without the wait a
first wave of fifteen compiled the header each, 50-67 s each on the H200).

:func:`prewarm` starts that step as the worker starts, in the background, for the calls
most candidates make (a CUDA ``load_inline`` without flags of its own, the layout kf's
prompt asks for: :data:`ARGUMENTS`), for the architecture the worker's runners will
report (:func:`kf.evaluation.grader.builds.make_pch`: the grader's boxed step, nothing
else built). It does nothing where the header of that key is there already, where builds
are not boxed, or where the architecture cannot be told without a CUDA context
(``$TORCH_CUDA_ARCH_LIST`` unset and no ``nvidia-smi``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import structlog

__all__ = ["ARGUMENTS", "arch_of", "prewarm", "prewarm_now"]

log = structlog.get_logger("kf.evaluation.grader.pch_prewarm")

#: a CUDA ``load_inline`` call in the split layout, with no flags of its own
ARGUMENTS: dict[str, Any] = {
    "name": "kf_pch_prewarm",
    "cpp_sources": (
        "void kf_pch_prewarm_launch(float* p, long n);\n"
        "torch::Tensor kf_pch_prewarm(torch::Tensor x) {\n"
        "  kf_pch_prewarm_launch(x.data_ptr<float>(), x.numel());\n"
        "  return x;\n"
        "}\n"
    ),
    "cuda_sources": (
        "__global__ void kf_pch_prewarm_kernel(float* p, long n) {\n"
        "  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;\n"
        "  if (i < n) p[i] += 0.0f;\n"
        "}\n"
        "void kf_pch_prewarm_launch(float* p, long n) {\n"
        "  kf_pch_prewarm_kernel<<<(unsigned)((n + 255) / 256), 256>>>(p, n);\n"
        "}\n"
    ),
    "functions": ["kf_pch_prewarm"],
}


def arch_of(device: str) -> str | None:
    """The architecture a runner on ``device`` reports (:func:`kf.cuda.inline._environment`):
    ``$TORCH_CUDA_ARCH_LIST`` where set, else the GPU's compute capability as
    ``nvidia-smi`` gives it (the worker makes no CUDA context); None where neither says."""
    from kf.devices.smi import smi_query

    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch is not None:
        return arch
    major, dot, minor = (smi_query(device, "compute_cap") or "").partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        return None
    return f"{int(major)}.{int(minor)}"


def prewarm_now(device: str, timeout_s: float = 600.0) -> str:
    """Make the header for :data:`ARGUMENTS` on ``device`` unless it is there; what
    happened, in words (also logged)."""
    from kf.cuda import inline
    from kf.cuda import pch as pch_mod
    from kf.evaluation.grader import box, builds

    arch = arch_of(device)
    if box.unsafe_requested() or box.probe() is not None:
        why = "builds are not boxed here"
    elif arch is None:
        why = "the GPU's architecture is unknown without a CUDA context"
    elif not inline.pch_wanted(ARGUMENTS):
        why = "precompiled headers are off ($KF_PCH)"
    else:
        env = builds.toolchain(arch)
        bound = inline.build_material(inline.bound_arguments(**ARGUMENTS))
        shared = inline.cache_root() / "pch" / inline.pch_key(bound, env)
        if pch_mod.usable(shared):
            why = "made already"
        else:
            began = time.monotonic()
            made = builds.make_pch(bound, env, timeout_s)
            seconds = round(time.monotonic() - began, 1)
            if pch_mod.usable(shared):
                log.info("pch_prewarmed", device=device, arch=arch, seconds=seconds)
                return f"made in {seconds} s"
            why = f"its build did not make it: {made[:300]}"
    log.info("pch_prewarm_skipped", device=device, why=why)
    return why


def prewarm(device: str) -> None:
    """:func:`prewarm_now` in a background thread (it never raises into the worker)."""

    def run() -> None:
        try:
            prewarm_now(device)
        except Exception as exc:  # the candidates' builds make the header as before
            log.info("pch_prewarm_skipped", device=device, why=f"{type(exc).__name__}: {exc}")

    threading.Thread(target=run, name="kf-pch-prewarm", daemon=True).start()
