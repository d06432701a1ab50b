"""What ``nvidia-smi`` says of a GPU: its id there, a field of ``--query-gpu`` (free
memory, compute capability), and its utilisation sampled while a run goes on. Nothing here
makes a CUDA context: a worker process leaves that to its runners.
"""

from __future__ import annotations

import subprocess
import threading

__all__ = ["UtilisationSampler", "free_device_memory", "smi_id", "smi_query"]


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
