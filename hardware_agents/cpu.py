"""What a CPU device can do: model, ISA extensions, caches, memory, compilers, bandwidth.

:func:`probe` gathers a :class:`CpuCapabilities` for the ``DeviceAnnounced`` event of a
CPU hardware agent. Linux is the target (``/proc/cpuinfo``, ``/sys/devices/system/cpu``);
elsewhere the fields that cannot be read come back as ``None`` or empty, never an error.

The parsing helpers (:func:`parse_cpuinfo`, :func:`parse_size`, :func:`isa_from_flags`,
:func:`physical_cores_from_cpuinfo`, :func:`parse_meminfo`) take text and are pure, so they
are tested with fixed inputs.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import platform
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import msgspec

__all__ = [
    "CpuCapabilities",
    "host_id",
    "isa_from_flags",
    "measure_copy_bandwidth_gbs",
    "measure_matmul_gflops",
    "parse_cpuinfo",
    "parse_meminfo",
    "parse_size",
    "physical_cores_from_cpuinfo",
    "probe",
]

#: ISA extensions worth reporting, by the names Linux uses in ``/proc/cpuinfo``.
RELEVANT_ISA = frozenset(
    {
        # x86
        "sse4_1",
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx_vnni",
        "avx512f",
        "avx512bw",
        "avx512cd",
        "avx512dq",
        "avx512vl",
        "avx512_bf16",
        "avx512_fp16",
        "avx512_vnni",
        "avx512ifma",
        "avx512vbmi",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        # arm64
        "asimd",
        "asimdhp",
        "asimddp",
        "bf16",
        "i8mm",
        "sve",
        "sve2",
        "sme",
    }
)

#: ARM ``CPU implementer`` codes → vendor names (the common ones).
_ARM_IMPLEMENTERS = {
    "0x41": "ARM",
    "0x42": "Broadcom",
    "0x43": "Cavium",
    "0x46": "Fujitsu",
    "0x48": "HiSilicon",
    "0x4e": "NVIDIA",
    "0x51": "Qualcomm",
    "0x61": "Apple",
    "0xc0": "Ampere",
}

_COMPILERS = ("g++", "clang++", "nvcc")
_COPY_BYTES = 256 * 1024 * 1024
_COPY_BUDGET_S = 1.5
_MATMUL_BUDGET_S = 0.5


class CpuCapabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What one CPU device offers kernels: identity, ISA, caches, memory and toolchain."""

    model: str
    vendor: str
    arch: str
    logical_cores: int
    device: str = "cpu"
    physical_cores: int | None = None
    isa: tuple[str, ...] = ()
    caches: dict[str, int] = msgspec.field(default_factory=dict)
    memory_bytes: int | None = None
    measured_copy_bandwidth_gbs: float | None = None
    measured_gflops: float | None = None
    compilers: dict[str, str] = msgspec.field(default_factory=dict)
    torch_version: str | None = None
    os: str = ""
    backends: tuple[str, ...] = ()


# --------------------------------------------------------------------------- parsing


def parse_size(text: str) -> int | None:
    """Bytes in a size like ``"32K"``, ``"2048 KiB"``, ``"1 MB"``, ``"65536"``; None if unreadable.

    Suffixes are binary (K = 1024), as the kernel's sysfs cache sizes are.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        return None
    number, unit = match.groups()
    scale = 1024 ** " KMGT".index(unit.upper() or " ")
    return int(float(number) * scale)


def parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """``/proc/cpuinfo`` text as one ``{field: value}`` dict per processor block.

    Fields that precede the first ``processor`` line (ARM puts some there) are merged
    into every block that lacks them.
    """
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for raw in text.splitlines():
        if not raw.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = raw.partition(":")
        if not sep:
            continue
        current[key.strip()] = value.strip()
    if current:
        blocks.append(current)
    processors = [b for b in blocks if "processor" in b]
    shared: dict[str, str] = {}
    for block in blocks:
        if "processor" not in block:
            shared.update(block)
    if not processors:
        return [shared] if shared else []
    return [{**shared, **block} for block in processors]


def isa_from_flags(flags: str) -> tuple[str, ...]:
    """The relevant ISA extensions in a ``flags``/``Features`` line, sorted.

    ARM's ``asimd`` is also reported as ``neon``, the name kernels use for it.
    """
    present = {flag for flag in flags.lower().split() if flag in RELEVANT_ISA}
    if "asimd" in present:
        present.add("neon")
    return tuple(sorted(present))


def physical_cores_from_cpuinfo(processors: Sequence[Mapping[str, str]]) -> int | None:
    """Distinct ``(physical id, core id)`` pairs, or None when cpuinfo does not say."""
    pairs = {(p.get("physical id", "0"), p["core id"]) for p in processors if "core id" in p}
    return len(pairs) or None


def parse_meminfo(text: str) -> int | None:
    """``MemTotal`` in bytes from ``/proc/meminfo`` text, or None."""
    match = re.search(r"^MemTotal:\s*(\d+)\s*kB", text, flags=re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _model_and_vendor(processors: Sequence[Mapping[str, str]]) -> tuple[str, str]:
    first = processors[0] if processors else {}
    model = first.get("model name") or first.get("Model name") or first.get("Hardware") or ""
    vendor = first.get("vendor_id", "")
    if not vendor and "CPU implementer" in first:
        code = first["CPU implementer"].lower()
        vendor = _ARM_IMPLEMENTERS.get(code, code)
        if not model and "CPU part" in first:
            model = f"{vendor} part {first['CPU part']}"
    return model or platform.processor() or "unknown", vendor or "unknown"


# --------------------------------------------------------------------------- reading


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _caches_from_sysfs(root: Path) -> dict[str, int]:
    caches: dict[str, int] = {}
    for index in sorted(root.glob("index*")):
        level, kind, size = (_read(index / name) for name in ("level", "type", "size"))
        if level is None or kind is None or size is None:
            continue
        nbytes = parse_size(size)
        if nbytes is None:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind.strip(), "")
        caches[f"L{level.strip()}{suffix}"] = nbytes
    return caches


def _caches_from_sysconf() -> dict[str, int]:
    names = {
        "L1d": "SC_LEVEL1_DCACHE_SIZE",
        "L1i": "SC_LEVEL1_ICACHE_SIZE",
        "L2": "SC_LEVEL2_CACHE_SIZE",
        "L3": "SC_LEVEL3_CACHE_SIZE",
    }
    caches: dict[str, int] = {}
    for label, name in names.items():
        if name not in os.sysconf_names:
            continue
        try:
            value = os.sysconf(name)
        except (OSError, ValueError):
            continue
        if value > 0:
            caches[label] = value
    return caches


def _physical_cores_from_sysfs(root: Path) -> int | None:
    pairs = set()
    for topo in root.glob("cpu[0-9]*/topology"):
        package, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        if package is not None and core is not None:
            pairs.add((package.strip(), core.strip()))
    return len(pairs) or None


def _memory_bytes() -> int | None:
    text = _read("/proc/meminfo")
    if text is not None and (total := parse_meminfo(text)) is not None:
        return total
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def _compiler_versions() -> dict[str, str]:
    """Name → version line for each C++/CUDA compiler on PATH (and ``$CXX``).

    The first line of ``--version``, except for nvcc, whose first line names the driver
    and whose ``release`` line names the version.
    """
    names = list(_COMPILERS)
    cxx = os.environ.get("CXX")
    if cxx and cxx not in names:
        names.append(cxx)
    found: dict[str, str] = {}
    for name in names:
        if shutil.which(name) is None:
            continue
        try:
            proc = subprocess.run(
                [name, "--version"], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            continue
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        if not lines:
            continue
        release = [line for line in lines if "release" in line]
        found[name] = release[0] if name == "nvcc" and release else lines[0]
    return found


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpp_extension_importable() -> bool:
    try:
        import torch.utils.cpp_extension  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def _backends(compilers: Mapping[str, str]) -> tuple[str, ...]:
    cxx = [name for name in compilers if name != "nvcc"]
    if not cxx:
        return ()
    backends = ["cpp-openmp"]
    if _cpp_extension_importable():
        backends.append("cpp-load-inline")
    return tuple(backends)


# --------------------------------------------------------------------------- measuring


def _best_seconds(
    call: Callable[[], object], start: float, budget_s: float, reps: int | None = None
) -> float:
    """The fastest of repeated timed ``call()``s (``reps`` at most): another runs only
    while it would end within ``budget_s`` of ``start``; at least one always runs."""
    best = float("inf")
    for _ in range(reps) if reps is not None else itertools.count():
        t0 = time.perf_counter()
        call()
        elapsed = time.perf_counter() - t0
        best = min(best, elapsed)
        if time.perf_counter() - start + elapsed > budget_s:
            break
    return best


def measure_copy_bandwidth_gbs(
    nbytes: int = _COPY_BYTES, *, reps: int = 5, budget_s: float = _COPY_BUDGET_S
) -> float:
    """Best-of-``reps`` copy bandwidth in GB/s (1e9 bytes), counting bytes read plus written.

    Stops early once ``budget_s`` (including allocation) is spent; at least one timed
    copy always runs.
    """
    import numpy as np

    start = time.perf_counter()
    count = max(1, nbytes // 4)
    src = np.ones(count, dtype=np.float32)
    dst = np.zeros_like(src)  # zeros_like touches the pages, so no first-touch faults are timed
    np.copyto(dst, src)  # warm-up
    best = _best_seconds(lambda: np.copyto(dst, src), start, budget_s, reps)
    return 2 * src.nbytes / best / 1e9


def measure_matmul_gflops(n: int = 1024, *, budget_s: float = _MATMUL_BUDGET_S) -> float | None:
    """Best float32 ``n×n`` matmul throughput with torch in GFLOP/s, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    torch.mm(a, b)  # warm-up: thread pool and kernels
    best = _best_seconds(lambda: torch.mm(a, b), time.perf_counter(), budget_s)
    return 2 * n**3 / best / 1e9


# --------------------------------------------------------------------------- public


def _processors() -> list[dict[str, str]]:
    text = _read("/proc/cpuinfo")
    return parse_cpuinfo(text) if text else []


def host_id() -> str:
    """A name for this host that survives restarts: hostname and CPU model, as a slug.

    Only ``[a-z0-9-]``, so it is safe inside NATS subjects and agent ids.
    """
    model, _ = _model_and_vendor(_processors())
    raw = f"{socket.gethostname()}-{model}"
    return re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-") or "unknown-host"


def probe(*, measure: bool = True) -> CpuCapabilities:
    """Describe this machine's CPU; with ``measure``, also time a copy and a matmul (~2 s)."""
    processors = _processors()
    model, vendor = _model_and_vendor(processors)
    flags = ""
    if processors:
        flags = processors[0].get("flags") or processors[0].get("Features") or ""
    caches = _caches_from_sysfs(Path("/sys/devices/system/cpu/cpu0/cache"))
    if not caches:
        caches = _caches_from_sysconf()
    compilers = _compiler_versions()
    logical = os.cpu_count() or 1
    memory = _memory_bytes()
    copy_bytes = min(_COPY_BYTES, memory // 8) if memory else _COPY_BYTES // 4
    return CpuCapabilities(
        model=model,
        vendor=vendor,
        arch=platform.machine(),
        logical_cores=logical,
        physical_cores=physical_cores_from_cpuinfo(processors)
        or _physical_cores_from_sysfs(Path("/sys/devices/system/cpu")),
        isa=isa_from_flags(flags),
        caches=caches,
        memory_bytes=memory,
        measured_copy_bandwidth_gbs=measure_copy_bandwidth_gbs(copy_bytes) if measure else None,
        measured_gflops=measure_matmul_gflops() if measure else None,
        compilers=compilers,
        torch_version=_torch_version(),
        os=f"{platform.system()} {platform.release()}".strip(),
        backends=_backends(compilers),
    )
