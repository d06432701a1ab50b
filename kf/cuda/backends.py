"""Which kernel backend a candidate uses (kept for imports; see :mod:`kf.kernels.backends`)."""

from __future__ import annotations

from kf.kernels.backends import CUDA_BACKENDS, backend_of

__all__ = ["CUDA_BACKENDS", "backend_of"]
