"""What every stage of an evaluation shares: deadlines, the runners' setup and the
requests to them, the reference and candidate runners loaded and checked, trial seeds and
verdicts.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import msgspec
import structlog

from kf.evaluation import baseline_settings, box, shared_memory
from kf.evaluation.reports import (
    FAILURE_KINDS,
    CompileReport,
    CountersReport,
    ProfileReport,
    TrialEvidence,
    VerifyReport,
)
from kf.evaluation.sandbox import (
    REQUESTS,
    Limits,
    RunnerCrashed,
    RunnerError,
    RunnerFailed,
    RunnerHandle,
    RunnerTimeout,
)
from kf.evaluation.tolerance import Tolerance, resolve
from kf.settings import current
from kf.tasks import Task, TaskError

log = structlog.get_logger("kf.evaluation")

_MAX_LOG = 20_000
TIMER_DISAGREEMENT = "timer_disagreement"
OUTPUT_CHANGED = "output_changed_after_timing"
CACHE_SUSPECTED = "cache_suspected"
REVERIFY_ABOVE = 10.0  # a speed-up above this is re-verified and flagged
DISTRIBUTION_FAILED = "distribution_failed"  # wrong on the task's inputs scaled or negated
_FRESH_SETS = 3
_device_locks: dict[str, threading.Lock] = {}
_device_locks_guard = threading.Lock()


def _device_lock(device: str) -> threading.Lock:
    """One profile at a time per device in this process, so timings do not overlap."""
    with _device_locks_guard:
        return _device_locks.setdefault(device, threading.Lock())


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def left(self) -> float:
        return max(0.001, self.end - time.monotonic())


class _CandidateFailed(Exception):
    def __init__(self, kind: str, error: str, log: str = "") -> None:
        super().__init__(error)
        self.kind, self.error, self.log = kind, error, log


_Report = TypeVar("_Report", CompileReport, VerifyReport, ProfileReport, CountersReport)


def _sandboxed(report: _Report, handles: list[RunnerHandle]) -> _Report:
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


def _ref_key(task: Task, device: str) -> str:
    """Reference runners are reused per task text and device."""
    return f"{task.sha256}:{device}"


def _setup_fields(
    handle: RunnerHandle,
    device: str,
    limits: Limits,
    deadline: _Deadline,
    *,
    reference: bool = False,
) -> dict[str, Any]:
    return {
        "device": device,
        "threads": handle.threads,
        # a CUDA context (also one a runner warmed for a GPU made at start-up) maps far
        # more address space than any sane RLIMIT_AS
        "memory_bytes": 0
        if device.startswith("cuda") or (handle.warm or "").startswith("cuda")
        else limits.memory_bytes,
        # a reused reference runner (no candidate code) gets no cumulative CPU limit: a
        # hard limit cannot be raised again, and the grader's deadlines still apply
        "cpu_s": 0 if reference else limits.cpu_s or int(deadline.timeout_s * handle.threads) + 30,
        "file_bytes": limits.file_bytes,
        # GPU runners pass tensors as CUDA IPC handles (kf.evaluation.transport)
        "ipc": device.startswith("cuda") and _ipc_transport(handle),
        # else large tensors as sealed memory files (kf.evaluation.shared_memory)
        "shm": _shm_min_bytes(),
        # or a candidate runner makes its trial inputs from the seed itself
        "own_inputs": not reference and _own_inputs(handle, device),
        # a reused reference keeps the input sets it made (the trial seeds repeat)
        "reference_cache_bytes": _reference_cache_bytes() if reference else 0,
        # TF32 set explicitly, the same in every runner (kf.evaluation.baseline_settings)
        "tf32": baseline_settings.tf32_setting(),
    }


def _ipc_transport(handle: RunnerHandle) -> bool:
    """Whether GPU runners hand tensors over as CUDA IPC handles: ``$KF_TENSOR_TRANSPORT``
    ``ipc`` or ``bytes``; by default yes for unboxed runners, and not (yet) between
    boxes, whose separate PID and IPC namespaces CUDA IPC has not been shown to cross
    (docs/sandbox.md)."""
    chosen = current().tensor_transport
    if chosen in ("ipc", "bytes"):
        return chosen == "ipc"
    return handle.sandbox != box.MODE_BWRAP and chosen != "seed"


def _shm_min_bytes() -> int | None:
    """From how many bytes of tensors a payload that does not go by IPC goes as a sealed
    memory file (``$KF_SHM_MIN_BYTES``, 1 MiB by default); None, always as ``torch.save``
    bytes, where ``$KF_TENSOR_TRANSPORT=bytes`` asks for that or the system cannot."""
    settings = current()
    if settings.tensor_transport == "bytes" or not shared_memory.available():
        return None
    return settings.shm_min_bytes or shared_memory.MIN_BYTES


def _own_inputs(handle: RunnerHandle, device: str) -> bool:
    """Whether the candidate runner makes each trial's inputs from the trial's seed
    itself, as the reference runner does (``$KF_TENSOR_TRANSPORT=seed``; by default for
    boxed GPU runners, between which CUDA IPC does not work: legacy IPC handles do not
    cross PID or network namespaces, as tried in ``bench/box_ipc_probe.py``). The grader
    then moves only the candidate's outputs, not gigabytes of inputs and their copies
    after the call; the candidate runner checks its inputs against a host copy itself,
    which is no less trusted than the ``inputs_after`` bytes the same process would
    send. Inputs of generalisation variants still travel (the reference chooses them)."""
    chosen = current().tensor_transport
    if chosen in ("ipc", "bytes", "seed"):
        return chosen == "seed"
    return device.startswith("cuda") and handle.sandbox == box.MODE_BWRAP


def _given(
    cand: RunnerHandle, device: str, made: dict[str, Any], seed: int, scale: float | None = None
) -> dict[str, Any]:
    """What a ``run`` request carries of a trial: its seed (and the hidden distribution's
    ``scale``), or the reference's inputs."""
    if _own_inputs(cand, device):
        return {"seed": seed} if scale is None else {"seed": seed, "scale": scale}
    return {"inputs": made["inputs"]}


def _reference_cache_bytes() -> int:
    """``$KF_REFERENCE_CACHE_MB`` in bytes, or -1: the runner's default for its device."""
    return current().reference_cache_bytes


def _setup(
    handle: RunnerHandle, device: str, limits: Limits, deadline: _Deadline, nice: int = 0
) -> None:
    fields = _setup_fields(handle, device, limits, deadline)
    handle.request("setup", deadline.left(), nice=nice, **fields)


def _build_niceness() -> int:
    """How much lower than grading a build runs (``$KF_BUILD_NICE``, default 10).

    Builds keep every core busy on a GPU worker while verification and timing of
    earlier candidates, which the GPU waits on, need the host too: those come first.
    """
    return current().build_nice


def _reference(task: Task, handle: RunnerHandle, op: str, deadline: _Deadline, **kw: Any) -> Any:
    """A request to the reference runner; any failure there is the task's fault."""
    try:
        return handle.request(op, deadline.left(), **kw)
    except RunnerFailed as exc:
        raise TaskError(f"{task.label}: {exc}") from exc
    except RunnerTimeout as exc:
        raise TaskError(f"{task.label}: the reference timed out ({exc})") from exc
    except RunnerCrashed as exc:
        raise TaskError(
            f"{task.label}: the reference crashed ({exc}); log: {exc.log_tail[-500:]}"
        ) from exc


def _candidate(task: Task, handle: RunnerHandle, op: str, deadline: _Deadline, **kw: Any) -> Any:
    """A request to the candidate runner; failures become :class:`_CandidateFailed`."""
    try:
        return handle.request(op, deadline.left(), **kw)
    except RunnerFailed as exc:
        if exc.kind == "task_error":
            raise TaskError(f"{task.label}: {exc}") from exc
        kind = exc.kind if exc.kind in FAILURE_KINDS else "exception"
        raise _CandidateFailed(kind, str(exc), exc.log_tail) from exc
    except RunnerTimeout as exc:
        raise _CandidateFailed(
            "timeout", f"candidate timed out after {deadline.timeout_s:g}s ({exc})", exc.log_tail
        ) from exc
    except RunnerCrashed as exc:
        raise _CandidateFailed("crash", f"candidate crashed: {exc}", exc.log_tail) from exc


def _after_candidate_failure(ref: RunnerHandle, exc: _CandidateFailed, device: str) -> None:
    """A GPU candidate runner that crashed or hung may hold IPC mappings of the
    reference's tensors, which then stay pinned: that reference is not reused."""
    if device.startswith("cuda") and exc.kind in ("crash", "timeout"):
        ref.discard = True


def _phases(since: float, *handles: RunnerHandle) -> dict[str, float]:
    """Seconds the stage's runners took per request op since ``since`` (the request log;
    ``lease_wait``: waiting for a leased runner to start)."""
    pids = {h.pid for h in handles}
    spent: dict[str, float] = {}
    for r in list(REQUESTS):
        if r.ended >= since and r.pid in pids:
            spent[r.op] = spent.get(r.op, 0.0) + r.wall_s
    return {op: round(s, 4) for op, s in sorted(spent.items())}


def _trim(ref: RunnerHandle) -> None:
    """Ask a reference runner to drop large per-stage tensors before it idles."""
    with contextlib.suppress(RunnerError):
        ref.request("trim", 30.0)


@contextlib.contextmanager
def _trimmed(lease: Any) -> Iterator[RunnerHandle]:
    """A reference lease whose runner drops its large tensors before going back idle."""
    with lease as ref:
        try:
            yield ref
        finally:
            _trim(ref)


def _truncate(text: str) -> str:
    return text if len(text) <= _MAX_LOG else "… (truncated)\n" + text[-_MAX_LOG:]


def _load_pair(
    task: Task,
    source: str,
    ref: RunnerHandle,
    cand: RunnerHandle,
    device: str,
    limits: Limits,
    deadline: _Deadline,
    seed: int,
) -> dict[str, Any]:
    """Set both runners up, load the task in the reference and ``ModelNew`` in the candidate;
    the reference runner's answer to its set-up (``precision``: its TF32 settings).

    The reference's ``init`` (the constructor arguments, made after seeding) goes to the
    candidate so both modules are built from the same inputs and parameters.
    """
    setup: dict[str, Any] = _reference(
        task, ref, "setup", deadline, **_setup_fields(ref, device, limits, deadline, reference=True)
    )
    _setup(cand, device, limits, deadline)
    init = _reference(
        task, ref, "load_task", deadline, source=task.source, name=task.name, seed=seed
    )["init"]
    _candidate(
        task,
        cand,
        "load_candidate",
        deadline,
        source=source,
        seed=seed,
        init=init,
        task_source=task.source,
        task_name=task.name,
        what="construction of ModelNew",
    )
    return setup


def _loaded_and_checked(
    task: Task,
    source: str,
    ref: RunnerHandle,
    cand: RunnerHandle,
    device: str,
    limits: Limits,
    deadline: _Deadline,
    seed: int,
    tol: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """:func:`_load_pair`, then one checked call on ``seed``'s inputs: (inputs, problem).

    What profiling and the counters do before measuring: the inputs stay in the
    candidate runner, and the problem is None when the output was right.
    """
    setup = _load_pair(task, source, ref, cand, device, limits, deadline, seed)
    made: dict[str, Any] = _reference(
        task, ref, "make_inputs", deadline, seed=seed, send=not _own_inputs(cand, device)
    )
    made["precision"] = setup.get("precision")  # what the reference runner said it set
    given = _given(cand, device, made, seed)
    problem = _run_and_check(task, ref, cand, given=given, seed=seed, deadline=deadline, tol=tol)
    return made, problem


def _tol(task: Task, tolerance: Tolerance | None) -> dict[str, Any]:
    """The tolerance ``task``'s outputs are judged at, as the ``check`` request carries it."""
    chosen, _ = resolve(tolerance, task.source)
    return msgspec.to_builtins(chosen)  # type: ignore[no-any-return]


def _judge(
    task: Task,
    ref: RunnerHandle,
    ran: dict[str, Any],
    seed: int,
    deadline: _Deadline,
    tol: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The reference runner's verdict on what the candidate returned for ``seed``'s inputs,
    at ``tol`` (None: the task's own or KernelBench's tolerance)."""
    verdict: dict[str, Any] = _reference(
        task,
        ref,
        "check",
        deadline,
        seed=seed,
        outputs=ran["outputs"],
        inputs_after=ran.get("inputs_after"),
        inputs_problem=ran.get("inputs_problem"),
        tol=tol if tol is not None else _tol(task, None),
    )["verdict"]
    return verdict


def _evidence(seed: int, verdict: dict[str, Any], label: str = "") -> TrialEvidence:
    """One trial's evidence from a verdict."""
    return TrialEvidence(
        seed=seed,
        ok=bool(verdict["ok"]),
        max_abs_err=float(verdict.get("max_abs_err") or 0.0),
        max_rel_err=float(verdict.get("max_rel_err") or 0.0),
        reason=verdict.get("reason"),
        label=label,
        min_tol=float(verdict.get("min_tol") or 0.0),
    )


def _seed_trials(seed: int, trials: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2**31) for _ in range(trials)]


def _run_and_check(
    task: Task,
    ref: RunnerHandle,
    cand: RunnerHandle,
    *,
    given: dict[str, Any],
    seed: int,
    deadline: _Deadline,
    tol: dict[str, Any] | None = None,
) -> tuple[str, str] | None:
    """Run the candidate once on ``given`` (:func:`_given`) and have the reference judge
    it: None, or (kind, reason)."""
    ran = _candidate(task, cand, "run", deadline, **given, what="forward")
    verdict = _judge(task, ref, ran, seed, deadline, tol)
    return None if verdict["ok"] else (str(verdict["kind"]), str(verdict["reason"]))
