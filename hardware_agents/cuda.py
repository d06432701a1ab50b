"""What a CUDA device can do: name, compute capability, SMs, memory, L2, clocks, versions,
measured copy bandwidth and matrix throughput, and the kernel backends usable here.

:func:`probe` runs in a child process (``python -m hardware_agents.cuda --device cuda:0``)
so the worker that announces the device never holds a CUDA context of its own.
:func:`probe_early` starts that child (without measurements) in the background, so that
``kf run`` can describe its GPU while it checks its tasks. The
text parsers (:func:`parse_nvcc_version`, :func:`parse_nvidia_smi_clocks`) are pure and
tested with fixed inputs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
import threading
from typing import Any

import msgspec

__all__ = [
    "CudaCapabilities",
    "copy_bandwidth_gbs",
    "parse_nvcc_version",
    "parse_nvidia_smi_clocks",
    "probe",
    "probe_early",
    "probe_in_subprocess",
    "take_early_probe",
]

# device → the description probe_early is making (no measurements)
_EARLY: dict[str, concurrent.futures.Future[CudaCapabilities]] = {}


class CudaCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    """One CUDA device as the hardware agent announces it."""

    device: str
    name: str
    compute_capability: str
    sm_count: int
    memory_bytes: int
    l2_bytes: int
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    driver_version: str | None = None
    cuda_runtime_version: str | None = None
    nvcc_version: str | None = None
    nvrtc_version: str | None = None
    torch_version: str | None = None
    triton_version: str | None = None
    measured_copy_bandwidth_gbs: float | None = None
    measured_bf16_tflops: float | None = None
    backends: tuple[str, ...] = ()


def parse_nvcc_version(text: str) -> str | None:
    """``13.0`` from ``nvcc --version`` output (its ``release X.Y`` part)."""
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else None


def parse_nvidia_smi_clocks(text: str) -> dict[str, int | str]:
    """Driver and clocks from ``nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,
    clocks.max.sm --format=csv,noheader,nounits`` (first GPU's line)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    parts = [p.strip() for p in line.split(",")]
    out: dict[str, int | str] = {}
    keys = ("driver_version", "sm_clock_mhz", "memory_clock_mhz", "max_sm_clock_mhz")
    for key, value in zip(keys, parts, strict=False):
        if key == "driver_version":
            if value:
                out[key] = value
        elif value.isdigit():
            out[key] = int(value)
    return out


def copy_bandwidth_gbs(nbytes: int, ms: float) -> float:
    """GB/s (1e9) of a copy of ``nbytes`` taking ``ms``, counting bytes read plus written."""
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _run(argv: list[str]) -> str:
    if shutil.which(argv[0]) is None:
        return ""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _median_ms(torch: Any, fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[len(times) // 2])


def _backends(nvcc: str | None) -> tuple[str, ...]:
    out = []
    try:
        import cuda.bindings.nvrtc  # noqa: F401

        out.append("cuda-nvrtc")
    except ImportError:
        pass
    if nvcc:
        out.append("cuda-load-inline")
    try:
        import triton  # noqa: F401

        out.append("triton")
    except ImportError:
        pass
    return tuple(out)


def probe(device: str = "cuda:0", *, measure: bool = True) -> CudaCapabilities:
    """Describe ``device`` (needs torch with CUDA); ``measure`` adds bandwidth and TFLOP/s."""
    import torch

    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    nvcc = parse_nvcc_version(_run(["nvcc", "--version"]))
    smi = parse_nvidia_smi_clocks(
        _run(
            [
                "nvidia-smi",
                f"--id={dev.index or 0}",
                "--query-gpu=driver_version,clocks.sm,clocks.mem,clocks.max.sm",
                "--format=csv,noheader,nounits",
            ]
        )
    )
    nvrtc = None
    try:
        from kf.cuda import nvrtc_version

        nvrtc = nvrtc_version()
    except Exception:  # a missing or broken NVRTC only drops that field
        nvrtc = None
    triton_version = None
    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        pass
    bandwidth = tflops = None
    if measure:
        torch.cuda.set_device(dev)
        nbytes = 1 << 30
        src = torch.randn(nbytes // 4, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)
        bandwidth = copy_bandwidth_gbs(nbytes, _median_ms(torch, lambda: dst.copy_(src), 20))
        del src, dst
        n = 8192
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        ms = _median_ms(torch, lambda: a @ b, 10)
        tflops = 2 * n**3 / (ms * 1e-3) / 1e12
        del a, b
        torch.cuda.empty_cache()
    smi_int = {k: v for k, v in smi.items() if isinstance(v, int)}
    return CudaCapabilities(
        device=f"cuda:{dev.index or 0}",
        name=str(props.name),
        compute_capability=f"{props.major}.{props.minor}",
        sm_count=int(props.multi_processor_count),
        memory_bytes=int(props.total_memory),
        l2_bytes=int(getattr(props, "L2_cache_size", 0)),
        sm_clock_mhz=smi_int.get("sm_clock_mhz"),
        memory_clock_mhz=smi_int.get("memory_clock_mhz"),
        max_sm_clock_mhz=smi_int.get("max_sm_clock_mhz"),
        driver_version=str(smi["driver_version"]) if "driver_version" in smi else None,
        cuda_runtime_version=str(torch.version.cuda),
        nvcc_version=nvcc,
        nvrtc_version=nvrtc,
        torch_version=str(torch.__version__),
        triton_version=triton_version,
        measured_copy_bandwidth_gbs=bandwidth,
        measured_bf16_tflops=tflops,
        backends=_backends(nvcc),
    )


def probe_in_subprocess(
    device: str = "cuda:0", *, measure: bool = True, timeout_s: float = 300.0
) -> CudaCapabilities:
    """Run :func:`probe` in a child process, so no CUDA context stays in this one."""
    argv = [sys.executable, "-m", "hardware_agents.cuda", "--device", device]
    if not measure:
        argv.append("--no-measure")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"probing {device} failed (status {proc.returncode}): {proc.stderr[-1500:]}"
        )
    return msgspec.json.decode(proc.stdout.strip().splitlines()[-1], type=CudaCapabilities)


def probe_early(device: str) -> None:
    """Start describing ``device`` (no measurements) in a background thread, for the CUDA
    hardware agent this process will start (:func:`take_early_probe`)."""
    if device in _EARLY:
        return
    future: concurrent.futures.Future[CudaCapabilities] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(probe_in_subprocess(device, measure=False))
        except BaseException as exc:
            future.set_exception(exc)

    _EARLY[device] = future
    # a daemon thread: a `kf run` that stops at a broken task does not wait for the probe
    threading.Thread(target=run, name="kf-probe", daemon=True).start()


def take_early_probe(device: str) -> CudaCapabilities | None:
    """What :func:`probe_early` found for ``device`` (waiting for it if need be), once; None
    if it was not started or failed (the caller probes again and reports that error)."""
    future = _EARLY.pop(device, None)
    if future is None:
        return None
    try:
        return future.result()
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    """``python -m hardware_agents.cuda [--device cuda:0] [--no-measure]``: print JSON."""
    p = argparse.ArgumentParser(prog="python -m hardware_agents.cuda")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--no-measure", action="store_true")
    args = p.parse_args(argv)
    caps = probe(args.device, measure=not args.no_measure)
    print(json.dumps(msgspec.to_builtins(caps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
