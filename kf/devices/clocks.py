"""A GPU's clocks and temperature, read around every timing (issue 47): the SM clock,
the memory clock (MHz) and the GPU's temperature (°C).

Read by the grader, outside the candidate's box, through NVML: ``pynvml`` where it is
installed, else NVML's own library through ctypes (``libnvidia-ml.so.1``, which is what
``pynvml`` wraps; a few microseconds a reading), else one ``nvidia-smi`` query (tens of
milliseconds). Where none answers (no GPU, no driver) a reading is None and the timing
is recorded without one. Nothing here makes a CUDA context.
"""

from __future__ import annotations

import ctypes
import subprocess
from typing import Any, NamedTuple

from kf.devices.smi import smi_id

__all__ = ["ClockReader", "Clocks", "parse_smi_clocks"]

_NVML_CLOCK_SM, _NVML_CLOCK_MEM, _NVML_TEMPERATURE_GPU = 1, 2, 0
_SMI_FIELDS = "clocks.sm,clocks.mem,temperature.gpu"


class Clocks(NamedTuple):
    """One reading: SM and memory clocks in MHz, temperature in °C."""

    sm_mhz: int
    mem_mhz: int
    temp_c: int


def parse_smi_clocks(text: str) -> Clocks | None:
    """``nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu
    --format=csv,noheader,nounits``'s first line as :class:`Clocks` (None: not three
    whole numbers, e.g. ``[N/A]``)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return Clocks(int(parts[0]), int(parts[1]), int(parts[2]))


class ClockReader:
    """Readings of GPU ``device`` (``cuda:N``; NVML's index as ``nvidia-smi``'s, see
    :func:`kf.devices.smi.smi_id`). The first :meth:`read` picks the way that answers
    and keeps it; a reader whose ways all fail gives None from then on."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.how = ""  # "pynvml", "nvml", "nvidia-smi", or "none" once chosen
        self._read: Any = None

    def read(self) -> Clocks | None:
        if self._read is None:
            self._choose()
        try:
            return self._read()  # type: ignore[no-any-return]
        except Exception:  # a driver gone mid-run: no reading, not a failed timing
            return None

    def _choose(self) -> None:
        ident = smi_id(self.device)
        for how, make in (("pynvml", _pynvml), ("nvml", _ctypes_nvml), ("nvidia-smi", _smi)):
            try:
                read = make(ident)
                if read() is not None:
                    self.how, self._read = how, read
                    return
            except Exception:
                continue
        self.how, self._read = "none", lambda: None


def _pynvml(ident: str) -> Any:
    import pynvml

    pynvml.nvmlInit()
    handle = (
        pynvml.nvmlDeviceGetHandleByIndex(int(ident))
        if ident.isdigit()
        else pynvml.nvmlDeviceGetHandleByUUID(ident)
    )

    def read() -> Clocks:
        return Clocks(
            int(pynvml.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM)),
            int(pynvml.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_MEM)),
            int(pynvml.nvmlDeviceGetTemperature(handle, _NVML_TEMPERATURE_GPU)),
        )

    return read


def _ctypes_nvml(ident: str) -> Any:
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    if lib.nvmlInit_v2() != 0:
        raise OSError("nvmlInit_v2 failed")
    handle = ctypes.c_void_p()
    if ident.isdigit():
        rc = lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(ident)), ctypes.byref(handle))
    else:
        rc = lib.nvmlDeviceGetHandleByUUID(ident.encode(), ctypes.byref(handle))
    if rc != 0:
        raise OSError(f"no NVML device {ident}: error {rc}")
    clock, temp = lib.nvmlDeviceGetClockInfo, lib.nvmlDeviceGetTemperature

    def read() -> Clocks | None:
        sm, mem, t = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        if (
            clock(handle, _NVML_CLOCK_SM, ctypes.byref(sm))
            or clock(handle, _NVML_CLOCK_MEM, ctypes.byref(mem))
            or temp(handle, _NVML_TEMPERATURE_GPU, ctypes.byref(t))
        ):
            return None
        return Clocks(sm.value, mem.value, t.value)

    return read


def _smi(ident: str) -> Any:
    argv = ["nvidia-smi", f"--id={ident}", f"--query-gpu={_SMI_FIELDS}"]
    argv.append("--format=csv,noheader,nounits")

    def read() -> Clocks | None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        return parse_smi_clocks(done.stdout) if done.returncode == 0 else None

    return read
