"""A record of devices that failed in this process, and the check that decides one has.

A device **fails** when a stage went wrong in a way a device can (a crashed or hung
runner, a CUDA error) and a fresh process then cannot use it either
(:func:`probe_health`). The stage agent that found it records ``device.left`` with the
reason; the archive re-dispatches the device's candidates to the other devices, and
nothing more is sent to or done on it. ``$KF_DEVICE_FAULTS`` (``ID@N,…``: the device
with id ID fails at the end of its N-th stage) injects such a failure, for tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading

from kf.settings import current

__all__ = ["failure", "looks_like_device_error", "mark_failed", "probe_health", "record_stage"]

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
