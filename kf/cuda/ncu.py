"""Hardware counters from Nsight Compute (``ncu``) for one forward call of a candidate.

kf starts a runner under ``ncu`` with profiling off from the start; the runner switches
it on (``cudaProfilerStart``) around a single forward call, after a warm-up call, so
only the candidate's own kernels of that call are measured. ``ncu`` writes one CSV row
per kernel (``--page raw``) to a log file when the runner exits, which :func:`parse`
reads. Clocks are left as they are (``--clock-control none``): the card's settings are
not kf's to change, and the timings kf reports come from CUDA events anyway.

Counters are observations about a kernel that already passed verification and timing:
which share of DRAM bandwidth and of the SMs' throughput it reached, its occupancy,
registers and bytes moved. They need profiling permission on the GPU; where ``ncu``
is missing or refused, the reason is recorded instead.
"""

from __future__ import annotations

import csv
import glob
import io
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

from kf.settings import Settings, current

__all__ = [
    "LOG_MAX_BYTES", "METRICS", "LogRefused", "command", "find_ncu", "install_paths", "parse",
    "permission_refused", "read_log", "summarise", "version",
]  # fmt: skip

#: ncu metric → the name kf records it under.
METRICS: dict[str, str] = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_throughput_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_throughput_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "dram__bytes_read.sum": "dram_bytes_read",
    "dram__bytes_write.sum": "dram_bytes_written",
    "launch__registers_per_thread": "registers_per_thread",
    "launch__block_size": "block_size",
    "launch__grid_size": "grid_size",
}
_PERMISSION = ("ERR_NVGPUCTRPERM", "permission")


def find_ncu(settings: Settings | None = None) -> str | None:
    """``$KF_NCU`` of ``settings`` (None: the process's; ``0`` switches counters off),
    ``ncu`` on PATH, or a standard install."""
    env = (settings or current()).ncu
    if env == "0":
        return None
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits and os.access(hits[-1], os.X_OK):
            return hits[-1]
    return None


def install_paths(ncu: str) -> list[str]:
    """What a box binds for ``ncu`` to run in it: its folder, and the Nsight Compute
    installation it starts, which the CUDA toolkit's ``bin/ncu`` looks for beside ``bin``
    (``<toolkit>/nsight-compute-<version>``) or under ``/opt/nvidia``. On the H200's
    image only ``bin`` was bound, and every runner under ncu died at start-up with
    "nsight-compute directory is not found"."""
    tool = Path(ncu).resolve()
    found = [tool.parent]
    for pattern in (str(tool.parent.parent / "nsight-compute*"), "/opt/nvidia/nsight-compute*"):
        found += [Path(p) for p in sorted(glob.glob(pattern)) if Path(p).is_dir()]
    return [str(p) for p in dict.fromkeys(found)]


def version(ncu: str) -> str:
    """The last line of ``ncu --version`` (its release), or ``ncu``."""
    try:
        out = subprocess.run(
            [ncu, "--version"], check=False, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return "ncu"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else "ncu"


def command(ncu: str, log_file: str) -> list[str]:
    """The argv prefix that runs a program under ncu, profiling only between start/stop."""
    return [
        ncu,
        "--clock-control", "none",
        "--profile-from-start", "off",
        "--target-processes", "all",
        "--csv",
        "--page", "raw",
        "--print-units", "base",
        "--metrics", ",".join(METRICS),
        "--log-file", log_file,
    ]  # fmt: skip


#: the most of ncu's log the grader reads: one CSV row per kernel of one forward call
LOG_MAX_BYTES = 32 << 20


class LogRefused(Exception):
    """ncu's log is not a plain file of at most :data:`LOG_MAX_BYTES` (one line, why)."""


def read_log(path: Path) -> str:
    """ncu's log at ``path``, as text ("" where there is none). It was written in the
    candidate's box, so it is never followed (a link), waited on (a FIFO), or read past
    :data:`LOG_MAX_BYTES`: :class:`LogRefused` says which."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError as exc:  # ELOOP: a symbolic link
        raise LogRefused(
            f"ncu's output {path.name} is not a regular file ({exc.strerror}): refused, "
            "not followed (something in the box put it there)"
        ) from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise LogRefused(
                f"ncu's output {path.name} is not a regular file (a FIFO, device or "
                "socket): refused, not read (something in the box put it there)"
            )
        if st.st_size > LOG_MAX_BYTES:
            raise LogRefused(
                f"ncu's output {path.name} is larger than {LOG_MAX_BYTES >> 20} MiB "
                f"({st.st_size} bytes): refused, not read"
            )
        data = f.read(LOG_MAX_BYTES + 1)
    if len(data) > LOG_MAX_BYTES:  # grew while read
        raise LogRefused(f"ncu's output {path.name} grew past {LOG_MAX_BYTES >> 20} MiB")
    return data.decode("utf-8", "replace")


def _number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "")
    if not cleaned or cleaned in ("n/a", "N/A"):
        return None
    try:
        return float(cleaned)
    except ValueError:
        return None


def parse(text: str) -> list[dict[str, Any]]:
    """One dict per profiled kernel: ``kernel`` (its name) and each metric of :data:`METRICS`.

    ncu's raw CSV has a header row, a units row, then a row per kernel; anything else in
    the log (``==PROF==`` lines, warnings) is skipped.
    """
    rows = list(
        csv.reader(
            io.StringIO("\n".join(line for line in text.splitlines() if line.startswith('"')))
        )
    )
    header_at = next((i for i, row in enumerate(rows) if "Kernel Name" in row), None)
    if header_at is None:
        return []
    header = rows[header_at]
    units: dict[str, str] = {}
    kernels: list[dict[str, Any]] = []
    for row in rows[header_at + 1 :]:
        if len(row) != len(header):
            continue
        cells = dict(zip(header, row, strict=True))
        if not cells.get("ID", "").strip().isdigit():
            units = cells  # the units row
            continue
        kernel: dict[str, Any] = {"kernel": cells.get("Kernel Name", "")}
        for metric, name in METRICS.items():
            if metric in cells:
                value = _number(cells[metric])
                scale = _SCALE.get(units.get(metric, "").strip(), 1.0)
                kernel[name] = None if value is None else value * scale
        kernels.append(kernel)
    return kernels


# ncu scales units unless told otherwise (--print-units base); to bytes and nanoseconds
_SCALE = {
    "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
    "KB": 1e3, "MB": 1e6, "GB": 1e9,
    "usecond": 1e3, "msecond": 1e6, "second": 1e9,
}  # fmt: skip


def permission_refused(text: str) -> bool:
    """Whether ncu said it may not read the counters (no profiling permission)."""
    return any(marker in text for marker in _PERMISSION)


def summarise(kernels: list[dict[str, Any]]) -> dict[str, float]:
    """Totals over the call's kernels: time, bytes, and time-weighted throughput shares."""
    total_ns = sum(float(k.get("duration_ns") or 0.0) for k in kernels)
    out: dict[str, float] = {
        "kernels": float(len(kernels)),
        "duration_ns": total_ns,
        "dram_bytes": sum(
            float(k.get("dram_bytes_read") or 0.0) + float(k.get("dram_bytes_written") or 0.0)
            for k in kernels
        ),
    }
    for name in ("dram_throughput_pct", "sm_throughput_pct", "achieved_occupancy_pct"):
        weighted = [
            (float(k[name]), float(k.get("duration_ns") or 0.0))
            for k in kernels
            if k.get(name) is not None
        ]
        weight = sum(w for _, w in weighted)
        if weighted and weight > 0:
            out[name] = sum(v * w for v, w in weighted) / weight
    if total_ns > 0:
        out["dram_gbs"] = out["dram_bytes"] / total_ns  # bytes per ns = GB/s
    return out
