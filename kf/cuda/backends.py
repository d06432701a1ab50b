"""Which kernel backend a candidate uses, read from its source (for device routing)."""

from __future__ import annotations

__all__ = ["CUDA_BACKENDS", "backend_of"]

#: Backends a CUDA worker can serve, as its hardware agent announces them.
CUDA_BACKENDS = ("cuda-nvrtc", "cuda-load-inline", "triton")


def backend_of(source: str, device: str) -> str:
    """``cpp-openmp`` for a CPU target; for CUDA, Triton, ``load_inline`` or NVRTC by source."""
    if not device.startswith("cuda"):
        return "cpp-openmp"
    if "triton.jit" in source or "import triton" in source:
        return "triton"
    if "load_inline" in source:
        return "cuda-load-inline"
    return "cuda-nvrtc"
