"""CUDA backends: NVRTC kernels (:mod:`kf.cuda.nvrtc`) and a content-addressed,
KernelBench-compatible ``load_inline`` (:mod:`kf.cuda.inline`)."""

from kf.cuda.nvrtc import (
    CompiledProgram,
    CudaCompileError,
    Kernel,
    KernelResources,
    Module,
    compile,
    compile_cubin,
    compiled_programs,
    nvrtc_version,
    parse_ptxas_log,
)

__all__ = [
    "CompiledProgram",
    "CudaCompileError",
    "Kernel",
    "KernelResources",
    "Module",
    "compile",
    "compile_cubin",
    "compiled_programs",
    "nvrtc_version",
    "parse_ptxas_log",
]
