"""CUDA backends: NVRTC kernels (:mod:`kf.cuda.nvrtc`, whose public names this package
re-exports: ``kf.cuda.compile`` and the rest) and a content-addressed, KernelBench-compatible
``load_inline`` (:mod:`kf.cuda.inline`)."""

from kf.cuda import nvrtc
from kf.cuda.nvrtc import *  # noqa: F403  (exactly nvrtc.__all__)

__all__ = nvrtc.__all__
