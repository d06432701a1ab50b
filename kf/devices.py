"""Several devices in one process: the device argument, the device ids, per-GPU runner
pools, and a record of devices that failed.

``--device`` takes one device (``cpu``, ``cuda``, ``cuda:N``), a comma list of them
(``cuda:0,cuda:2``) or ``cuda:all`` (every GPU PyTorch sees here). A list holds one kind
of device. A worker process then hosts one hardware agent, compiler, verifier and
profiler per device; the compilers share the host's build slots
(:mod:`agents.build_pool`) and the build cache on disk (``$KF_CACHE_DIR``), and each GPU
keeps its own warm runners and its own timing gate, so timing stays exclusive per GPU.

``cpu`` may be listed more than once (``cpu,cpu``): two pipelines on the same cores,
sharing the CPU's one timing gate. It gives no speed; it lets the multi-device
composition, the shared builds and the re-dispatch after a device failure be tested on
a machine without GPUs.

A device **fails** when a stage went wrong in a way a device can (a crashed or hung
runner, a CUDA error) and a fresh process then cannot use it either
(:func:`probe_health`). The stage agent that found it records ``device.left`` with the
reason; the archive re-dispatches the device's candidates to the other devices, and
nothing more is sent to or done on it. ``$KF_DEVICE_FAULTS`` (``ID@N,…``: the device
with id ID fails at the end of its N-th stage) injects such a failure, for tests.
"""

from __future__ import annotations

import atexit
import math
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kf.device_names import DeviceError, cuda_device_count, parse_device
from kf.settings import current

if TYPE_CHECKING:
    from kf.evaluation.grader.sandbox import RunnerPool

__all__ = [
    "DEVICE_HELP",
    "GPU_IN_FLIGHT",
    "DeviceError",
    "DeviceSlot",
    "UtilisationSampler",
    "configure_runner_pools",
    "default_in_flight",
    "device_slots",
    "failure",
    "free_device_memory",
    "gpu_pool_size",
    "kept_runners",
    "looks_like_device_error",
    "mark_failed",
    "parse_device",
    "parse_devices",
    "primary_device",
    "probe_health",
    "record_stage",
    "runner_pool",
    "runners_that_fit",
    "smi_id",
    "smi_query",
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


# -- per-GPU runner pools ---------------------------------------------------------------

_pools: dict[str, RunnerPool] = {}
_pools_lock = threading.Lock()


def smi_id(device: str) -> str:
    """``nvidia-smi``'s ``--id`` of GPU ``device`` (``cuda:N``): PyTorch's index N is the
    N-th of ``$CUDA_VISIBLE_DEVICES`` where that is set."""
    import os

    index = device.partition(":")[2] or "0"
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if any(visible) and int(index) < len(visible):
        index = visible[int(index)]
    return index


class UtilisationSampler:
    """GPU ``device``'s utilisation as ``nvidia-smi`` samples it (``utilization.gpu``: the
    share of the last sample period in which a kernel ran), one reading every
    ``interval_ms`` from one long-lived ``nvidia-smi -lms`` process; :meth:`take` gives
    the mean since the last take. Where ``nvidia-smi`` is missing or says nothing usable,
    :meth:`take` gives None."""

    def __init__(self, device: str, interval_ms: int = 500) -> None:
        self.device, self.interval_ms = device, interval_ms
        self._samples: list[float] = []
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        argv = [
            "nvidia-smi", f"--id={smi_id(self.device)}", "--query-gpu=utilization.gpu",
            "--format=csv,noheader,nounits", "-lms", str(self.interval_ms),
        ]  # fmt: skip
        try:
            self._proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError:
            return
        threading.Thread(target=self._read, args=(self._proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                value = float(line.strip())
            except ValueError:
                continue
            with self._lock:
                self._samples.append(value)

    def take(self) -> float | None:
        with self._lock:
            samples, self._samples = self._samples, []
        return round(sum(samples) / len(samples), 1) if samples else None

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def smi_query(device: str, field: str) -> str | None:
    """``nvidia-smi``'s answer for GPU ``device``'s ``field`` (``--query-gpu``, without
    units), or None where it gives none (no ``nvidia-smi``, an error, a timeout)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={smi_id(device)}", f"--query-gpu={field}",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def free_device_memory(device: str) -> int | None:
    """Free bytes of GPU ``device`` (``cuda:N``) as ``nvidia-smi`` reports them, or None
    where it cannot tell (no ``nvidia-smi``, no answer). The worker process itself makes
    no CUDA context: its runners do."""
    answer = smi_query(device, "memory.free")
    try:
        return int(float((answer or "").split()[0]) * (1 << 20)) if answer else None
    except (ValueError, IndexError):
        return None


def runners_that_fit(requested: int, free_bytes: int | None, context_bytes: int) -> int:
    """How many of ``requested`` warm runners a GPU with ``free_bytes`` free gets: their
    CUDA contexts (``context_bytes`` each) take at most a quarter of its free memory,
    the rest being the tasks' tensors; at least 2 (a reference and a candidate)."""
    if free_bytes is None or context_bytes <= 0:
        return requested
    return max(2, min(requested, free_bytes // 4 // context_bytes))


def gpu_pool_size(device: str, requested: int) -> int:
    """``requested`` warm runners for GPU ``device``, fewer where they would not fit in
    its free memory (:func:`runners_that_fit`), said in the log when they do not."""
    free = free_device_memory(device)
    size = runners_that_fit(requested, free, current().runner_context_bytes)
    if size < requested and free is not None:
        import structlog

        structlog.get_logger("kf.devices").info(
            "runner_pool_sized", device=device, runners=size, asked=requested,
            free_gb=round(free / 1e9, 1),
        )  # fmt: skip
    return size


def configure_runner_pools(devices: Sequence[str], build_slots: int) -> None:
    """Give each GPU of a multi-GPU worker its own pool of runners warmed for it.

    The pools together keep ``build_slots`` runners for builds (spread over the GPUs)
    plus four per GPU for its verifications and timings; ``$KF_EVAL_POOL`` sets the
    size of each instead. With one device nothing changes: stages use the process's
    default pool.
    """
    from kf.evaluation.grader.sandbox import RunnerPool

    gpus = list(dict.fromkeys(d for d in devices if d.startswith("cuda")))
    if len(gpus) < 2:
        return
    asked = current().eval_pool
    sizes = {
        d: asked if asked is not None else gpu_pool_size(d, math.ceil(build_slots / len(gpus)) + 4)
        for d in gpus
    }
    references = current().reference_runners
    with _pools_lock:
        for d in gpus:
            size = sizes[d]
            # a reference runner per task keeps its compiled baseline
            refs = references or min(16, max(4, size))
            old = _pools.get(d)
            if old is not None and not old._closed:
                old.configure(size=size, warm=d, references=refs, kept=kept_runners(size))
                continue
            pool = _pools[d] = RunnerPool(
                size=size, warm=d, references=refs, kept=kept_runners(size)
            )
            atexit.register(pool.close)


#: candidates in flight per local GPU when ``--max-in-flight`` is not given: what the H200
#: runs of issue 31 used (builds on 15 cores, 4 verifications and 12 profiles at once);
#: two kept the GPU's pipeline nearly empty
GPU_IN_FLIGHT = 24


def default_in_flight(local: Sequence[str]) -> int:
    """Candidates being evaluated at once when the run does not say: two per local CPU
    device, :data:`GPU_IN_FLIGHT` per local GPU, two with no local worker."""
    return sum(GPU_IN_FLIGHT if d.startswith("cuda") else 2 for d in local) or 2


def kept_runners(pool_size: int) -> int:
    """The candidate runners a GPU's pool keeps between a candidate's stages:
    ``$KF_KEPT_RUNNERS`` where set, else as many as its idle runners (at least 8): a
    kept runner is one of the runners that fit beside the tasks' tensors, and with
    fewer than the candidates in flight a candidate whose runner was not kept pays a
    runner's start again (on the H200, a cap of 8 at 24 in flight left 23 of 69
    verifications a fresh runner)."""
    settings = current()
    return settings.kept_runners if settings.kept_runners_set else max(8, pool_size)


def runner_pool(device: str) -> RunnerPool | None:
    """The runner pool of ``device`` (None: the process's default pool serves it)."""
    with _pools_lock:
        pool = _pools.get(device)
    return pool if pool is not None and not pool._closed else None


# -- device failures --------------------------------------------------------------------

_failed: dict[str, str] = {}
_stages: dict[str, int] = {}
_failed_lock = threading.Lock()

#: error text that a device (not a candidate) can be behind; a fresh process decides
_DEVICE_ERROR = re.compile(
    r"CUDA error|cudaError|CUDA driver|no CUDA-capable device|CUDA-capable device\(s\) is/are "
    r"busy|unspecified launch failure|uncorrectable ECC|fallen off the bus|device not ready|"
    r"NVML|Xid|initialization error|out of memory",
    re.IGNORECASE,
)


def looks_like_device_error(kind: str | None, text: str) -> bool:
    """Whether a stage's failure could be its device's: a runner crashed, hung or could
    not start, or the error names a CUDA/driver fault."""
    return kind in ("crash", "timeout", "runner_start") or bool(_DEVICE_ERROR.search(text))


def _injected(device_id: str) -> str | None:
    """The fault ``$KF_DEVICE_FAULTS`` arms for ``device_id`` from its N-th stage on
    (None: none armed, or not yet)."""
    spec = current().device_faults
    for item in filter(None, (s.strip() for s in spec.split(","))):
        dev, _, after = item.rpartition("@")
        if dev == device_id and after.isdigit() and _stages.get(device_id, 0) >= int(after):
            return f"fault injected by KF_DEVICE_FAULTS after {after} stages"
    return None


def record_stage(device_id: str) -> str | None:
    """Count a stage completed on ``device_id``; return an injected fault if one is due."""
    with _failed_lock:
        _stages[device_id] = _stages.get(device_id, 0) + 1
        return _injected(device_id)


def failure(device_id: str) -> str | None:
    """Why ``device_id`` failed in this process (None: it did not)."""
    with _failed_lock:
        return _failed.get(device_id)


def mark_failed(device_id: str, reason: str) -> bool:
    """Record that ``device_id`` failed; True for the first caller (who announces it)."""
    with _failed_lock:
        if device_id in _failed:
            return False
        _failed[device_id] = reason
        return True


_HEALTH = """
import sys, torch
d = torch.device(sys.argv[1])
torch.cuda.set_device(d)
x = torch.arange(1 << 20, device=d, dtype=torch.float32)
assert float((x * 2).sum().item()) == float((1 << 20) * ((1 << 20) - 1))
torch.cuda.synchronize(d)
print("ok")
"""


def probe_health(device: str, timeout_s: float = 120.0) -> str | None:
    """Whether a fresh process can still compute on ``device``: None if so, else why not.

    A CPU is taken as healthy. On a GPU the probe makes a context, runs a kernel and
    synchronises; a sticky error in one candidate's runner does not outlive that runner,
    so a failure here is the device's (lost, or left in an error state).
    """
    if not device.startswith("cuda"):
        return None
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _HEALTH, device],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"{device} did not answer a health check within {timeout_s:.0f}s"
    except OSError:  # the host cannot start a process: that says nothing of the device
        return None
    if proc.returncode == 0 and proc.stdout.strip().endswith("ok"):
        return None
    tail = (proc.stderr.strip().splitlines() or [f"status {proc.returncode}"])[-1]
    return f"{device} failed a health check: {tail[:300]}"
