"""What every stage of an evaluation shares besides its session
(:mod:`kf.evaluation.grader.session`): deadlines, the runners' set-up and tensor transports,
the request log's phases, trial seeds and verdicts.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import TypeVar

import msgspec
import structlog

from kf.evaluation.grader import box
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.sandbox import REQUESTS, Limits, RunnerError, RunnerHandle
from kf.evaluation.wire import shared_memory
from kf.evaluation.wire.protocol import Setup, Trim, Verdict
from kf.kernels.tasks import Task
from kf.reports import (
    CompileReport,
    CountersReport,
    Float64Rule,
    ProfileReport,
    TrialEvidence,
    VerifyReport,
)
from kf.settings import Settings

log = structlog.get_logger("kf.evaluation")

_MAX_LOG = 20_000
TIMER_DISAGREEMENT = "timer_disagreement"
OUTPUT_CHANGED = "output_changed_after_timing"
CACHE_SUSPECTED = "cache_suspected"
REVERIFY_ABOVE = 10.0  # a speed-up above this is re-verified and flagged
DISTRIBUTION_FAILED = "distribution_failed"  # wrong on the task's inputs scaled or negated
#: hidden input distributions: factors applied to the task's floating-point inputs
#: (the runner's :func:`kf.evaluation.runner.variants.scale_inputs`)
SCALES: tuple[float, ...] = (3.0, 0.01, -1.0)
FRESH_SETS = 3
_device_locks: dict[str, threading.Lock] = {}
_device_locks_guard = threading.Lock()


def device_lock(device: str) -> threading.Lock:
    """One profile at a time per device in this process, so timings do not overlap."""
    with _device_locks_guard:
        return _device_locks.setdefault(device, threading.Lock())


class Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def left(self) -> float:
        return max(0.001, self.end - time.monotonic())


class CandidateFailed(Exception):
    def __init__(self, kind: str, error: str, log: str = "") -> None:
        super().__init__(error)
        self.kind, self.error, self.log = kind, error, log


AnyReport = TypeVar("AnyReport", CompileReport, VerifyReport, ProfileReport, CountersReport)


def with_sandbox_marks(report: AnyReport, handles: list[RunnerHandle]) -> AnyReport:
    """``report`` saying where its runners ran (``sandbox``), and flagged ``unsandboxed``
    when any of them ran outside the box."""
    modes = {h.sandbox for h in handles}
    if not modes:
        return report
    mode = box.MODE_UNSAFE if box.MODE_UNSAFE in modes else modes.pop()
    if mode != box.MODE_UNSAFE:
        return msgspec.structs.replace(report, sandbox=mode)
    flag = box.UNSANDBOXED_FLAG
    if isinstance(report, CompileReport):
        if flag not in report.warnings:
            report = msgspec.structs.replace(report, warnings=(*report.warnings, flag))
    elif not isinstance(report, CountersReport) and flag not in report.flags:
        report = msgspec.structs.replace(report, flags=(*report.flags, flag))
    return msgspec.structs.replace(report, sandbox=mode)


def reference_runner_key(task: Task, device: str, conditions: Conditions) -> str:
    """Reference runners are reused per task text, device, and the conditions their
    tensors depend on (TF32, where inputs are made): a reused runner keeps what it made."""
    inputs = "device" if conditions.device_inputs else "host"
    return f"{task.sha256}:{device}:tf32-{conditions.tf32}:{inputs}-inputs"


def setup_request(
    handle: RunnerHandle,
    device: str,
    limits: Limits,
    deadline: Deadline,
    conditions: Conditions,
    settings: Settings,
    *,
    reference: bool = False,
    nice: int = 0,
    cpu_later_s: int = 0,
) -> Setup:
    """The set-up of ``handle`` for one stage on ``device`` under the run's ``conditions``
    and the grader's ``settings`` (its tensor transport and reference cache)."""
    return Setup(
        device=device,
        threads=handle.threads,
        # a CUDA context (also one a runner warmed for a GPU made at start-up) maps far
        # more address space than any sane RLIMIT_AS
        memory_bytes=0
        if device.startswith("cuda") or (handle.warm or "").startswith("cuda")
        else limits.memory_bytes,
        # a reused reference runner (no candidate code) gets no cumulative CPU limit: a
        # hard limit cannot be raised again, and the grader's deadlines still apply
        cpu_s=0 if reference else limits.cpu_s or int(deadline.timeout_s * handle.threads) + 30,
        cpu_later_s=cpu_later_s,
        # nor a file limit: it guards the host's disk from candidate code, and would
        # refuse the memory files of the reference's large inputs and outputs
        file_bytes=0 if reference else limits.file_bytes,
        # GPU runners pass tensors as CUDA IPC handles (kf.evaluation.runner.transport)
        ipc=device.startswith("cuda") and _ipc_transport(handle, settings),
        # else large tensors as sealed memory files (kf.evaluation.wire.shared_memory)
        shm=_shm_min_bytes(settings),
        # a GPU runner's trial inputs made on the GPU: at KernelBench's sizes, making
        # a 6.4 GB input on the host took longer than everything else in a trial
        device_inputs=device.startswith("cuda") and conditions.device_inputs,
        # or a candidate runner makes its trial inputs from the seed itself
        own_inputs=not reference and makes_own_inputs(handle, device, settings),
        # a reused reference keeps the input sets it made (the trial seeds repeat)
        reference_cache_bytes=settings.reference_cache_bytes if reference else 0,
        # TF32 set explicitly, the same in every runner (kf.evaluation.grader.baseline_settings)
        tf32=conditions.tf32,
        nice=nice,
    )


def _ipc_transport(handle: RunnerHandle, settings: Settings) -> bool:
    """Whether GPU runners hand tensors over as CUDA IPC handles: ``$KF_TENSOR_TRANSPORT``
    ``ipc`` or ``bytes``; by default yes for unboxed runners, and not (yet) between
    boxes, whose separate PID and IPC namespaces CUDA IPC has not been shown to cross
    (docs/sandbox.md)."""
    chosen = settings.tensor_transport
    if chosen in ("ipc", "bytes"):
        return chosen == "ipc"
    return handle.sandbox != box.MODE_BWRAP and chosen != "seed"


def _shm_min_bytes(settings: Settings) -> int | None:
    """From how many bytes of tensors a payload that does not go by IPC goes as a sealed
    memory file (``$KF_SHM_MIN_BYTES``, 1 MiB by default); None, always as ``torch.save``
    bytes, where ``$KF_TENSOR_TRANSPORT=bytes`` asks for that or the system cannot."""
    if settings.tensor_transport == "bytes" or not shared_memory.available():
        return None
    return settings.shm_min_bytes or shared_memory.MIN_BYTES


def makes_own_inputs(handle: RunnerHandle, device: str, settings: Settings) -> bool:
    """Whether the candidate runner makes each trial's inputs from the trial's seed
    itself, as the reference runner does (``$KF_TENSOR_TRANSPORT=seed``; by default for
    boxed GPU runners, between which CUDA IPC does not work: legacy IPC handles do not
    cross PID or network namespaces, as tried in ``bench/box_ipc_probe.py``). The grader
    then moves only the candidate's outputs, not gigabytes of inputs and their copies
    after the call; the candidate runner checks its inputs against a host copy itself,
    which is no less trusted than the ``inputs_after`` bytes the same process would
    send. Inputs of generalisation variants still travel (the reference chooses them)."""
    chosen = settings.tensor_transport
    if chosen in ("ipc", "bytes", "seed"):
        return chosen == "seed"
    return device.startswith("cuda") and handle.sandbox == box.MODE_BWRAP


def build_niceness(settings: Settings) -> int:
    """How much lower than grading a build runs (``$KF_BUILD_NICE``, default 10).

    Builds keep every core busy on a GPU worker while verification and timing of
    earlier candidates, which the GPU waits on, need the host too: those come first.
    """
    return settings.build_nice


def discard_reference_if_pinned(ref: RunnerHandle, exc: CandidateFailed, device: str) -> None:
    """A GPU candidate runner that crashed or hung may hold IPC mappings of the
    reference's tensors, which then stay pinned: that reference is not reused."""
    if device.startswith("cuda") and exc.kind in ("crash", "timeout"):
        ref.discard = True


def stage_phases(since: float, *handles: RunnerHandle) -> dict[str, float]:
    """Seconds the stage's runners took per request op since ``since`` (the request log;
    ``lease_wait``: waiting for a leased runner to start)."""
    pids = {h.pid for h in handles}
    spent: dict[str, float] = {}
    for r in list(REQUESTS):
        if r.ended >= since and r.pid in pids:
            spent[r.op] = spent.get(r.op, 0.0) + r.wall_s
    return {op: round(s, 4) for op, s in sorted(spent.items())}


def stage_peak_device_mb(since: float, *handles: RunnerHandle) -> float | None:
    """The most device memory the stage's runners held at once since ``since``, in MB, as
    they state it (their allocators' reserved bytes; CUDA contexts not counted); None off
    a GPU. A stage's requests go one at a time, so while one runner handles a request the
    others hold what they held at the end of their last one (a reused runner's last one
    may be from before the stage)."""
    pids = {h.pid for h in handles}
    held: dict[int, int] = {}
    peak = 0
    for r in list(REQUESTS):
        if r.pid not in pids or r.op == "lease_wait":
            continue
        if r.ended < since:
            held[r.pid] = r.held_bytes
            continue
        others = sum(b for pid, b in held.items() if pid != r.pid)
        peak = max(peak, r.peak_bytes + others)
        held[r.pid] = r.held_bytes
    return round(peak / 1e6, 1) if peak else None


def trim_reference(ref: RunnerHandle) -> None:
    """Ask a reference runner to drop large per-stage tensors before it idles."""
    with contextlib.suppress(RunnerError):
        ref.request(Trim(), 30.0)


def truncate(text: str) -> str:
    return text if len(text) <= _MAX_LOG else "… (truncated)\n" + text[-_MAX_LOG:]


def trial_evidence(seed: int, verdict: Verdict, label: str = "") -> TrialEvidence:
    """One trial's evidence from a verdict."""
    return TrialEvidence(
        seed=seed,
        ok=verdict.ok,
        max_abs_err=verdict.max_abs_err,
        max_rel_err=verdict.max_rel_err,
        reason=verdict.reason,
        label=label,
        min_tol=verdict.min_tol,
        **{k: getattr(verdict, k) for k in _FLOAT64_FIELDS},
    )


#: what a trial's evidence keeps of its verdict's float64 rule (kf.evaluation.runner.float64)
_FLOAT64_FIELDS = Float64Rule.__struct_fields__


def seed_trials(seed: int, trials: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2**31) for _ in range(trials)]
