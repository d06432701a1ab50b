"""Kernel backends and languages: the one place where a candidate's backend is derived.

A *backend* is how a candidate's native code is built and run (``cpp-openmp``,
``cuda-load-inline``, ``cuda-nvrtc``, ``triton``); devices announce the backends they can
serve, and the archive routes a candidate only to a device that serves its backend. A
*language* is what kf asks a model to write: ``cuda`` (CUDA C++ through
``torch.utils.cpp_extension.load_inline``, KernelBench's format), ``triton`` or ``cpp``
(C++ with OpenMP, for CPUs). The archive derives every candidate's backend from its source
with :func:`backend_of` when the candidate is proposed, whoever proposed it (seeds, the
offline mutator, the LLM mutator, a plugin), so no proposer can forget it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CUDA_BACKENDS",
    "LANGUAGES",
    "backend_of",
    "device_kind",
    "language_of",
    "languages_for",
    "parse_languages",
]

#: Backends a CUDA worker can serve, as its hardware agent announces them.
CUDA_BACKENDS = ("cuda-nvrtc", "cuda-load-inline", "triton")

#: Language → (device kind, the backend a module written in it uses).
LANGUAGES: dict[str, tuple[str, str]] = {
    "cuda": ("cuda", "cuda-load-inline"),
    "triton": ("cuda", "triton"),
    "cpp": ("cpu", "cpp-openmp"),
}


def device_kind(device: str) -> str:
    """``cuda`` for ``cuda`` / ``cuda:N``, else ``cpu``."""
    return "cuda" if device.startswith("cuda") else "cpu"


def backend_of(source: str, device: str) -> str:
    """``cpp-openmp`` for a CPU target; for CUDA, Triton, ``load_inline`` or NVRTC by source."""
    if device_kind(device) == "cpu":
        return "cpp-openmp"
    if "triton.jit" in source or "import triton" in source:
        return "triton"
    if "load_inline" in source:
        return "cuda-load-inline"
    return "cuda-nvrtc"


def language_of(backend: str) -> str:
    """The language kf would ask for to get a module of this backend (``""`` if none)."""
    if backend == "cuda-nvrtc":
        return "cuda"
    for lang, (_, b) in LANGUAGES.items():
        if b == backend:
            return lang
    return ""


def languages_for(device: str, backends: Iterable[str] | None = None) -> list[str]:
    """The languages a device of this kind runs, in :data:`LANGUAGES` order; with
    ``backends`` (what a live device announced), only those it serves."""
    kind = device_kind(device)
    served = None if backends is None else set(backends)
    return [
        lang
        for lang, (k, b) in LANGUAGES.items()
        if k == kind and (served is None or not served or b in served)
    ]


def parse_languages(spec: str, device: str) -> list[str]:
    """``--language``: ``auto`` (every language the device runs) or a comma list.

    Raises ValueError naming the languages the device runs when one does not fit it.
    """
    allowed = languages_for(device)
    if spec.strip() in ("", "auto"):
        return allowed
    out: list[str] = []
    for part in spec.split(","):
        lang = part.strip().lower()
        if lang not in LANGUAGES:
            raise ValueError(
                f"--language {lang!r}: unknown (known: {', '.join(LANGUAGES)}, or auto)"
            )
        if lang not in allowed:
            raise ValueError(
                f"--language {lang!r} does not run on {device} "
                f"(it runs: {', '.join(allowed) or 'none'})"
            )
        if lang not in out:
            out.append(lang)
    return out
