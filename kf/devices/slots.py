"""The device argument and the device ids: ``--device`` read into devices, the slots a
worker serves, and how many candidates are in flight by default.

``--device`` takes one device (``cpu``, ``cuda``, ``cuda:N``), a comma list of them
(``cuda:0,cuda:2``) or ``cuda:all`` (every GPU PyTorch sees here). A list holds one kind
of device. A worker process then hosts one hardware agent, compiler, verifier and
profiler per device; the compilers share the host's build slots
(:mod:`agents.build_pool`) and the build cache on disk (``$KF_CACHE_DIR``), and each GPU
keeps its own warm runners (:mod:`kf.evaluation.grader.pools`) and its own timing gate
(:mod:`kf.devices.gate`), so timing stays exclusive per GPU.

``cpu`` may be listed more than once (``cpu,cpu``): two pipelines on the same cores,
sharing the CPU's one timing gate. It gives no speed; it lets the multi-device
composition, the shared builds and the re-dispatch after a device failure be tested on
a machine without GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kf.devices.names import DeviceError, cuda_device_count, parse_device

__all__ = [
    "DEVICE_HELP",
    "GPU_IN_FLIGHT",
    "DeviceError",
    "DeviceSlot",
    "default_in_flight",
    "device_slots",
    "parse_device",
    "parse_devices",
    "primary_device",
]

DEVICE_HELP = (
    "where candidates run: cpu, cuda (cuda:0), cuda:N, a comma list (cuda:0,cuda:1) or "
    "cuda:all (every GPU here); with several GPUs each gets its own hardware agent, "
    "verifier, profiler and exclusive timing, and their builds share the host's cores"
)

_ONE = re.compile(r"^(cpu|cuda(?::(\d+))?)$")


def _cuda_count() -> int:
    return cuda_device_count()


def parse_devices(spec: str, *, cuda_count: Callable[[], int] | None = None) -> list[str]:
    """The canonical devices of a ``--device`` argument, in the order given.

    Raises :class:`kf.evaluation.DeviceError` (a ValueError) with a one-line reason: an
    empty entry, an unknown name, a GPU this machine lacks, ``cuda:all`` without GPUs,
    a GPU listed twice, or CPUs and GPUs mixed. ``cuda_count`` replaces
    ``torch.cuda.device_count()`` (tests).
    """
    count = cuda_count or _cuda_count
    parts = [p.strip().lower() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise DeviceError(f"--device {spec!r}: an empty entry in the device list")
    out: list[str] = []
    for part in parts:
        if part == "cuda:all":
            n = count()
            if n == 0:
                raise DeviceError(
                    f"--device {spec!r}: no CUDA devices: PyTorch sees no GPU on this machine "
                    "(no CUDA build of torch, or no driver); use --device cpu"
                )
            out += [f"cuda:{i}" for i in range(n)]
            continue
        if _ONE.match(part) is None:
            raise DeviceError(
                f"unknown device {part!r} in --device {spec!r}: expected cpu, cuda, cuda:N "
                "or cuda:all, or a comma list of them"
            )
        out.append(parse_device(part, count))  # one device's check and wording, as kf eval's
    kinds = {d.partition(":")[0] for d in out}
    if len(kinds) > 1:
        raise DeviceError(
            f"--device {spec!r} mixes CPU and GPU devices: a run (and a worker) serves one "
            "kind; start a second `kf worker` for the other"
        )
    gpus = [d for d in out if d != "cpu"]
    twice = sorted({d for d in gpus if gpus.count(d) > 1})
    if twice:
        raise DeviceError(
            f"--device {spec!r} lists {', '.join(twice)} more than once: each GPU times "
            "alone, so it is served once"
        )
    return out


def primary_device(spec: str) -> str:
    """The device a run records as its target (``RunStarted.config["device"]``) without
    expanding or checking the list: its first entry, ``cuda:all`` read as ``cuda:0``.
    (A joined run's starter need not have the devices its workers use.)"""
    first = spec.split(",", maxsplit=1)[0].strip().lower() or "cpu"
    return "cuda:0" if first in ("cuda", "cuda:all") else first


@dataclass(frozen=True)
class DeviceSlot:
    """One device a worker serves: the device string its stages use and the id it
    announces (and is routed work by)."""

    device: str
    device_id: str


def device_slots(devices: Sequence[str], host: str, name: str | None = None) -> list[DeviceSlot]:
    """The device ids of ``devices`` on ``host``.

    One device: ``name`` if given (``kf worker --name``), else ``<host>/<device>``.
    Several: ``<name or host>/<device>``, and a repeated ``cpu`` gets ``#2``, ``#3``….
    """
    if len(devices) == 1:
        return [DeviceSlot(devices[0], name or f"{host}/{devices[0]}")]
    base = name or host
    out: list[DeviceSlot] = []
    seen: dict[str, int] = {}
    for d in devices:
        seen[d] = seen.get(d, 0) + 1
        suffix = "" if seen[d] == 1 else f"#{seen[d]}"
        out.append(DeviceSlot(d, f"{base}/{d}{suffix}"))
    return out


#: candidates in flight per local GPU when ``--max-in-flight`` is not given: what the H200
#: runs of issue 31 used (builds on 15 cores, 4 verifications and 12 profiles at once);
#: two kept the GPU's pipeline nearly empty
GPU_IN_FLIGHT = 24


def default_in_flight(local: Sequence[str]) -> int:
    """Candidates being evaluated at once when the run does not say: two per local CPU
    device, :data:`GPU_IN_FLIGHT` per local GPU, two with no local worker."""
    return sum(GPU_IN_FLIGHT if d.startswith("cuda") else 2 for d in local) or 2
