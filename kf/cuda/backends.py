"""Which kernel backend a candidate uses (kept for imports; see :mod:`kf.backends`)."""

from __future__ import annotations

from kf.backends import CUDA_BACKENDS, backend_of

__all__ = ["CUDA_BACKENDS", "backend_of"]
