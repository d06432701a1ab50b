"""Compile, verify and profile a candidate, each in fresh sandboxed runners.

The grader (this process) never imports task or candidate code and never unpickles
what a runner sends: it shuttles ``torch.save`` payloads between a candidate runner and
a candidate-free reference runner, which holds the expected outputs and judges them.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import msgspec
import structlog

from kf.evaluation import baseline_settings, box, shared_memory
from kf.evaluation.device import parse_device
from kf.evaluation.reports import (
    FAILURE_KINDS,
    CompileReport,
    CountersReport,
    EvalResult,
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
    RunnerPool,
    RunnerTimeout,
    default_pool,
)
from kf.evaluation.timing_checks import cache_suspected, timer_disagreement
from kf.evaluation.tolerance import Tolerance, for_dtype, resolve
from kf.static_checks import check_source
from kf.tasks import Task, TaskError, TaskInfo

__all__ = [
    "CACHE_SUSPECTED",
    "REVERIFY_ABOVE",
    "TIMER_DISAGREEMENT",
    "collect_counters",
    "compile_baseline_wanted",
    "compile_candidate",
    "cross_check_flags",
    "evaluate",
    "profile_candidate",
    "reverify_fast",
    "run_task_check",
    "timing_stats",
    "verify_candidate",
]

log = structlog.get_logger("kf.evaluation")

_MAX_LOG = 20_000
TIMER_DISAGREEMENT = "timer_disagreement"
OUTPUT_CHANGED = "output_changed_after_timing"
CACHE_SUSPECTED = "cache_suspected"
REVERIFY_ABOVE = 10.0  # a speed-up above this is re-verified and flagged
DISTRIBUTION_FAILED = "distribution_failed"  # wrong on the task's inputs scaled or negated
_FRESH_SETS = 3
_OFF = frozenset({"0", "false", "no", "off"})
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
    chosen = os.environ.get("KF_TENSOR_TRANSPORT", "")
    if chosen in ("ipc", "bytes"):
        return chosen == "ipc"
    return handle.sandbox != box.MODE_BWRAP and chosen != "seed"


def _shm_min_bytes() -> int | None:
    """From how many bytes of tensors a payload that does not go by IPC goes as a sealed
    memory file (``$KF_SHM_MIN_BYTES``, 1 MiB by default); None, always as ``torch.save``
    bytes, where ``$KF_TENSOR_TRANSPORT=bytes`` asks for that or the system cannot."""
    if os.environ.get("KF_TENSOR_TRANSPORT", "") == "bytes" or not shared_memory.available():
        return None
    return int(os.environ.get("KF_SHM_MIN_BYTES") or shared_memory.MIN_BYTES)


def _own_inputs(handle: RunnerHandle, device: str) -> bool:
    """Whether the candidate runner makes each trial's inputs from the trial's seed
    itself, as the reference runner does (``$KF_TENSOR_TRANSPORT=seed``; by default for
    boxed GPU runners, between which CUDA IPC does not work: legacy IPC handles do not
    cross PID or network namespaces, as tried in ``bench/box_ipc_probe.py``). The grader
    then moves only the candidate's outputs, not gigabytes of inputs and their copies
    after the call; the candidate runner checks its inputs against a host copy itself,
    which is no less trusted than the ``inputs_after`` bytes the same process would
    send. Inputs of generalisation variants still travel (the reference chooses them)."""
    chosen = os.environ.get("KF_TENSOR_TRANSPORT", "")
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
    env = os.environ.get("KF_REFERENCE_CACHE_MB")
    return int(float(env) * (1 << 20)) if env else -1


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
    return max(0, int(os.environ.get("KF_BUILD_NICE", "10")))


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


_BIG_LOCKS: dict[str, threading.Lock] = {}


def _big_task_bytes() -> int:
    """Inputs plus outputs above which a task's verifications run one at a time on a GPU
    (``$KF_BIG_TASK_MB``, default 2048): two of KernelBench's 6 GB tasks side by side,
    each with a reference and a candidate process, do not fit in an H200."""
    return int(float(os.environ.get("KF_BIG_TASK_MB", "2048")) * (1 << 20))


def _footprint(made: dict[str, Any]) -> int:
    """Bytes of one input set and its outputs, from a ``make_inputs`` reply."""
    sizes = {"float64": 8, "int64": 8, "complex64": 8, "float16": 2, "bfloat16": 2, "int16": 2}
    total = 0
    for shapes, dtypes in (
        (made.get("input_shapes", []), made.get("input_dtypes", [])),
        (made.get("output_shapes", []), made.get("output_dtypes", [])),
    ):
        for shape, dtype in zip(shapes, dtypes, strict=False):
            n = 1
            for d in shape:
                n *= int(d)
            total += n * sizes.get(str(dtype), 1 if str(dtype) in ("int8", "uint8", "bool") else 4)
    return total


def too_large(made: dict[str, Any], device: str) -> str | None:
    """Why a task cannot be evaluated on ``device`` at all, from its first ``make_inputs``
    reply, or None. A GPU evaluation holds the task's inputs and outputs twice (the
    reference's set, the candidate's own), measured on the H200 at 2.05× their size
    (bench/kernelbench_memory.py); past the device's whole memory no schedule can fit it,
    so the candidate is refused before any trial with the estimate and the reason."""
    total = int(made.get("device_total_bytes") or 0)
    if not device.startswith("cuda") or total <= 0:
        return None
    footprint = _footprint(made)
    need = 2 * footprint
    if need <= total:
        return None
    gb = 1e9
    return (
        f"the task needs about {need / gb:.1f} GB of device memory (its inputs and outputs, "
        f"{footprint / gb:.1f} GB, held by the reference runner and by the candidate's) and "
        f"{device} has {total / gb:.1f} GB"
    )


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


def run_task_check(
    task: Task,
    *,
    device: str = "cpu",
    timeout_s: float = 120.0,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
) -> TaskInfo:
    """See :func:`kf.tasks.check_task`."""
    device = parse_device(device)
    limits = limits or Limits()
    pool = pool or default_pool()
    deadline = _Deadline(timeout_s)
    with pool.lease() as ref:
        _reference(
            task,
            ref,
            "setup",
            deadline,
            **_setup_fields(ref, device, limits, deadline, reference=True),
        )
        _reference(task, ref, "load_task", deadline, source=task.source, name=task.name, seed=0)
        info = _reference(task, ref, "make_inputs", deadline, seed=0)
    return TaskInfo(
        name=task.name,
        input_shapes=info["input_shapes"],
        input_dtypes=info["input_dtypes"],
        output_shapes=info["output_shapes"],
        output_dtypes=info["output_dtypes"],
        eager_ms=float(info["eager_ms"]),
        device=device,
    )


def compile_candidate(
    task: Task,
    source: str,
    *,
    device: str = "cpu",
    timeout_s: float | None = None,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
) -> CompileReport:
    """Import the candidate and construct ``ModelNew(*get_init_inputs())`` in a sandbox.

    ``timeout_s`` is the build limit (None: :func:`kf.evaluation.buildlimits.build_timeout_s`,
    600 s by default); it starts once the build holds one of the process's build slots,
    and the wait for one is the report's ``build_queue`` phase. Raises
    :class:`TaskError` when the task itself is broken.
    """
    from kf.evaluation.buildlimits import build_slot, build_timeout_s

    leased: list[RunnerHandle] = []
    with build_slot() as queued_s:
        report = _compile(
            task,
            source,
            leased,
            device=device,
            timeout_s=build_timeout_s(timeout_s),
            limits=limits,
            pool=pool,
        )
    phases = {**report.phases, "build_queue": round(queued_s, 4)}
    return _sandboxed(msgspec.structs.replace(report, phases=phases), leased)


def _compile(
    task: Task,
    source: str,
    leased: list[RunnerHandle],
    *,
    device: str,
    timeout_s: float,
    limits: Limits | None,
    pool: RunnerPool | None,
) -> CompileReport:
    """:func:`compile_candidate`; the runner it leases is added to ``leased``."""
    device = parse_device(device)
    pool = pool or default_pool()
    limits = limits or Limits()
    static = check_source(source)
    since = time.monotonic()
    with pool.lease() as cand:
        leased.append(cand)
        start = time.monotonic()
        deadline = _Deadline(timeout_s)
        try:
            _setup(cand, device, limits, deadline, nice=_build_niceness())
            _candidate(
                task,
                cand,
                "load_candidate",
                deadline,
                source=source,
                seed=0,
                task_source=task.source,
                task_name=task.name,
                init=None,
                what="import and construction of ModelNew",
            )
            # kf.cuda's build reports (resources, cache hits) from the runner's log
            build_log = "\n".join(
                line for line in cand.log_tail().splitlines() if line.startswith("kf.cuda")
            )
        except _CandidateFailed as exc:
            log.info("candidate_compile_failed", task=task.name, kind=exc.kind)
            return CompileReport(
                ok=False,
                error=exc.error,
                log=_truncate(exc.log),
                duration_s=time.monotonic() - start,
                failure_kind=exc.kind,
                warnings=static + tuple(cand.findings),
                phases=_phases(since, cand),
            )
        warnings = static + tuple(cand.findings)
    log.info("candidate_compiled", task=task.name, warnings=warnings)
    return CompileReport(
        ok=True,
        log=build_log,
        duration_s=time.monotonic() - start,
        warnings=warnings,
        phases=_phases(since, cand),
    )


def verify_candidate(
    task: Task,
    source: str,
    *,
    device: str = "cpu",
    seed: int = 0,
    trials: int = 5,
    timeout_s: float = 120.0,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
    generalise: bool = True,
    tolerance: Tolerance | None = None,
) -> VerifyReport:
    """Check the candidate against the reference on ``trials`` fresh seeded inputs (KernelBench).

    The first trial records the PyTorch ops ``forward`` dispatches (flag
    ``torch_compute``). With ``generalise``, the candidate is then checked on input
    shapes it never saw (the task's ``get_extra_inputs()``, else a rescaled leading
    dimension): the generalisation gate; failing it is ``generalisation_failed``.
    Raises :class:`TaskError` when the task itself is broken.
    """
    leased: list[RunnerHandle] = []
    report = _verify(
        task,
        source,
        leased,
        device=device,
        seed=seed,
        trials=trials,
        timeout_s=timeout_s,
        limits=limits,
        pool=pool,
        generalise=generalise,
        tolerance=tolerance,
    )
    return _sandboxed(report, leased)


def _verify(
    task: Task,
    source: str,
    leased: list[RunnerHandle],
    *,
    device: str,
    seed: int,
    trials: int,
    timeout_s: float,
    limits: Limits | None,
    pool: RunnerPool | None,
    generalise: bool,
    tolerance: Tolerance | None = None,
) -> VerifyReport:
    """:func:`verify_candidate`; the runners it leases are added to ``leased``."""
    device = parse_device(device)
    pool = pool or default_pool()
    limits = limits or Limits()
    evidence: list[TrialEvidence] = []
    variants: list[TrialEvidence] = []
    hidden: list[TrialEvidence] = []
    flags: list[str] = []
    atol = rtol = 0.0
    chosen, chosen_from = resolve(tolerance, task.source)
    tol = _tol(task, tolerance)
    since = time.monotonic()
    with pool.reference_lease(_ref_key(task, device)) as ref, pool.lease() as cand:
        leased += [ref, cand]
        start = time.monotonic()
        deadline = _Deadline(timeout_s)

        def report(**kw: Any) -> VerifyReport:
            return VerifyReport(
                trials=len(evidence),
                max_abs_err=max((e.max_abs_err for e in evidence), default=0.0),
                max_rel_err=max((e.max_rel_err for e in evidence), default=0.0),
                evidence=tuple(evidence),
                atol=atol,
                rtol=rtol,
                min_tolerance=max((e.min_tol for e in evidence), default=0.0),
                tolerance_source=chosen_from,
                duration_s=time.monotonic() - start,
                variant_evidence=tuple(variants),
                distribution_evidence=tuple(hidden),
                flags=tuple(flags) + tuple(f for f in cand.findings if f not in flags),
                phases=_phases(since, ref, cand),
                **kw,
            )

        big: threading.Lock | None = None
        try:
            _load_pair(task, source, ref, cand, device, limits, deadline, seed)
            for i, trial_seed in enumerate(_seed_trials(seed, trials)):
                made = _reference(
                    task,
                    ref,
                    "make_inputs",
                    deadline,
                    seed=trial_seed,
                    send=not _own_inputs(cand, device),
                )
                refused = too_large(made, device) if i == 0 else None
                if refused is not None:
                    log.info("candidate_rejected", task=task.name, kind="too_large")
                    return report(correct=False, failure_kind="too_large", error=refused)
                if (
                    big is None
                    and device.startswith("cuda")
                    and _footprint(made) > _big_task_bytes()
                ):
                    big = _BIG_LOCKS.setdefault(device, threading.Lock())
                    big.acquire()
                pairs = [for_dtype(chosen, d) for d in made["output_dtypes"]]
                atol = max((a for a, _ in pairs), default=for_dtype(chosen, "float32")[0])
                rtol = max((r for _, r in pairs), default=for_dtype(chosen, "float32")[1])
                ran = _candidate(
                    task,
                    cand,
                    "run",
                    deadline,
                    **_given(cand, device, made, trial_seed),
                    trace=i == 0,
                    what=f"forward (trial {i + 1})",
                )
                if ran.get("torch_ops"):
                    ops = ", ".join(f"aten.{op}" for op in ran["torch_ops"][:8])
                    flags.append(f"torch_compute: forward dispatched PyTorch ops {ops}")
                verdict = _judge(task, ref, ran, trial_seed, deadline, tol)
                evidence.append(_evidence(trial_seed, verdict))
                if not verdict["ok"]:
                    log.info("candidate_rejected", task=task.name, kind=verdict["kind"])
                    return report(
                        correct=False,
                        failure_kind=verdict["kind"],
                        error=f"trial {i + 1}/{trials} (seed {trial_seed}): {verdict['reason']}",
                    )
            if generalise:
                failed = _generalisation_gate(
                    task, ref, cand, seed, deadline, variants, device, tol
                )
                if failed is not None:
                    log.info("candidate_rejected", task=task.name, kind="generalisation_failed")
                    return report(correct=False, failure_kind="generalisation_failed", error=failed)
                failed = _hidden_distributions(task, ref, cand, seed, deadline, hidden, device, tol)
                if failed is not None:
                    log.info("candidate_rejected", task=task.name, kind=DISTRIBUTION_FAILED)
                    return report(correct=False, failure_kind=DISTRIBUTION_FAILED, error=failed)
        except _CandidateFailed as exc:
            _after_candidate_failure(ref, exc, device)
            log.info("candidate_rejected", task=task.name, kind=exc.kind)
            detail = (
                f"\n{exc.log[-1500:]}" if exc.kind in ("crash", "exception") and exc.log else ""
            )
            return report(correct=False, failure_kind=exc.kind, error=exc.error + detail)
        finally:
            _trim(ref)
            if big is not None:
                big.release()
    log.info("candidate_verified", task=task.name, trials=len(evidence))
    return report(correct=True)


def _hidden_distributions(
    task: Task,
    ref: RunnerHandle,
    cand: RunnerHandle,
    seed: int,
    deadline: _Deadline,
    evidence: list[TrialEvidence],
    device: str,
    tol: dict[str, Any] | None = None,
) -> str | None:
    """Run the candidate on the task's inputs scaled by each of
    :data:`kf.evaluation.variants.SCALES` (never seen before); None, or why it failed.

    A distribution the reference rejects, or a task with no floating-point input, is
    skipped."""
    from kf.evaluation.variants import SCALES

    for scale, trial_seed in zip(SCALES, _seed_trials(seed ^ 0xD157, len(SCALES)), strict=True):
        own = _own_inputs(cand, device)
        made = _reference(
            task, ref, "make_inputs", deadline, seed=trial_seed, scale=scale, send=not own
        )
        if "input_shapes" not in made:  # the reference rejects them
            continue
        label = f"inputs ×{scale:g}"
        given = _given(cand, device, made, trial_seed, scale)
        failed = _unseen_trial(
            task,
            ref,
            cand,
            deadline,
            evidence,
            device,
            tol,
            trial_seed,
            label,
            given,
            "hidden inputs",
        )
        if failed is not None:
            return failed
    return None


def _unseen_trial(
    task: Task,
    ref: RunnerHandle,
    cand: RunnerHandle,
    deadline: _Deadline,
    evidence: list[TrialEvidence],
    device: str,
    tol: dict[str, Any] | None,
    trial_seed: int,
    label: str,
    given: dict[str, Any],
    check: str,
) -> str | None:
    """One trial on inputs the candidate never saw (``given``, :func:`_given`), judged by
    the reference and added to ``evidence``; None, or why ``check`` failed."""
    try:
        ran = _candidate(task, cand, "run", deadline, **given, what=f"forward on {label}")
    except _CandidateFailed as exc:
        _after_candidate_failure(ref, exc, device)
        evidence.append(TrialEvidence(seed=trial_seed, ok=False, reason=exc.error, label=label))
        return f"{check}, {label} (never seen before): {exc.kind}: {exc.error}"
    verdict = _judge(task, ref, ran, trial_seed, deadline, tol)
    evidence.append(_evidence(trial_seed, verdict, label))
    if not verdict["ok"]:
        return f"{check}, {label} (never seen before): {verdict['kind']}: {verdict['reason']}"
    return None


def _generalisation_gate(
    task: Task,
    ref: RunnerHandle,
    cand: RunnerHandle,
    seed: int,
    deadline: _Deadline,
    evidence: list[TrialEvidence],
    device: str,
    tol: dict[str, Any] | None = None,
) -> str | None:
    """Run the candidate on input shapes it never saw; None, or why it failed."""
    for variant, trial_seed in enumerate(_seed_trials(seed ^ 0x6E4E, 4)):
        made = _reference(task, ref, "make_inputs", deadline, seed=trial_seed, variant=variant)
        if made.get("inputs") is None:
            break
        label = str(made.get("variant", ""))
        given = {"inputs": made["inputs"]}  # the reference chose the shapes: they travel
        failed = _unseen_trial(
            task, ref, cand, deadline, evidence, device, tol, trial_seed, label, given,
            "generalisation gate",
        )  # fmt: skip
        if failed is not None:
            return failed
    return None


def timing_stats(samples_ms: list[float]) -> dict[str, float]:
    """Mean, sample std, median, min and the 95% confidence half width of the mean."""
    n = len(samples_ms)
    mean = statistics.fmean(samples_ms)
    std = statistics.stdev(samples_ms) if n > 1 else 0.0
    # Student t for small samples, 1.96 beyond 30.
    t_table = {
        2: 12.71,
        3: 4.30,
        4: 3.18,
        5: 2.78,
        6: 2.57,
        8: 2.36,
        10: 2.26,
        15: 2.14,
        20: 2.09,
        30: 2.04,
    }
    t = next((v for k, v in sorted(t_table.items()) if n <= k), 1.96)
    return {
        "mean": mean,
        "std": std,
        "median": statistics.median(samples_ms),
        "min": min(samples_ms),
        "ci95": t * std / math.sqrt(n) if n > 1 else 0.0,
    }


def cross_check_flags(
    in_process_ms: float, outside_ms: float, *, ratio: float = 1.5, min_gap_ms: float = 0.02
) -> tuple[str, ...]:
    """Flag a disagreement over ``ratio``× (and over ``min_gap_ms``) between the two timers."""
    if in_process_ms <= 0 or outside_ms <= 0:
        return (TIMER_DISAGREEMENT,) if abs(in_process_ms - outside_ms) > min_gap_ms else ()
    r = outside_ms / in_process_ms
    if (r > ratio or r < 1 / ratio) and abs(outside_ms - in_process_ms) > min_gap_ms:
        return (TIMER_DISAGREEMENT,)
    return ()


def compile_baseline_wanted() -> bool:
    """Whether profiles also time the reference under ``torch.compile``
    (``$KF_COMPILE_BASELINE``, default on; ``0`` turns it off)."""
    return os.environ.get("KF_COMPILE_BASELINE", "1").strip().lower() not in _OFF


def _compile_timeout_s() -> float:
    """How long one ``torch.compile`` of a reference may take (``$KF_COMPILE_BASELINE_TIMEOUT_S``,
    default 600 s); it does not count against the profile's own timeout."""
    return float(os.environ.get("KF_COMPILE_BASELINE_TIMEOUT_S") or 600.0)


def _inductor_cache_dir() -> str | None:
    """Where reference runners keep inductor's caches: ``$KF_CACHE_DIR/inductor`` (or
    ``~/.cache/kf/inductor``), so a fresh reference runner recompiles a task's reference
    from the cache in about a second; None (the runner's own scratch directory, lost
    with it) with ``$KF_COMPILE_CACHE=0``, and None when ``$TORCHINDUCTOR_CACHE_DIR``
    is set (runners inherit it)."""
    if os.environ.get("KF_COMPILE_CACHE", "1").strip().lower() in _OFF:
        return None
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    from kf.evaluation.box import unsafe_requested

    if not unsafe_requested():
        # boxed runners see the shared cache read-only, and a cache every runner could
        # write would let a candidate plant pickles for the next reference runner: inside
        # the box inductor compiles into the runner's own scratch, lost with it
        return None
    root = os.environ.get("KF_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kf")
    return os.path.join(root, "inductor")


class _BaselineLost(Exception):
    """The reference runner died or hung compiling or timing the compiled reference."""


def profile_candidate(
    task: Task,
    source: str,
    *,
    device: str = "cpu",
    seed: int = 0,
    warmup: int = 5,
    min_trials: int = 20,
    min_time_s: float = 0.5,
    max_trials: int = 1000,
    timeout_s: float = 120.0,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
    compile_baseline: bool | None = None,
    tolerance: Tolerance | None = None,
) -> ProfileReport:
    """Time the candidate, PyTorch eager and the reference under ``torch.compile``
    alternately, in separate runners (eager and compiled share the candidate-free one),
    in one session.

    ``compile_baseline`` None follows ``$KF_COMPILE_BASELINE`` (default on). The
    reference is compiled once per model seed and input shapes in its runner, which
    later profiles of the task reuse; a compile that fails is recorded in the report
    (``compile_baseline_error``) and the speed-up is stated against eager only. Raises
    :class:`TaskError` when the task itself is broken.
    """
    since = time.monotonic()
    leased: list[RunnerHandle] = []
    want = compile_baseline_wanted() if compile_baseline is None else compile_baseline
    kw: dict[str, Any] = {
        "device": device,
        "seed": seed,
        "warmup": warmup,
        "min_trials": min_trials,
        "min_time_s": min_time_s,
        "max_trials": max_trials,
        "timeout_s": timeout_s,
        "limits": limits,
        "pool": pool,
        "tolerance": tolerance,
    }
    try:
        report = _profile(task, source, leased, compile_baseline=want, **kw)
    except _BaselineLost:
        # the reference runner was lost to torch.compile; the failure is remembered, so
        # this second session, with fresh runners, times against eager only
        report = _profile(task, source, leased, compile_baseline=want, **kw)
    return _sandboxed(msgspec.structs.replace(report, phases=_phases(since, *leased)), leased)


# baseline compiles that killed or hung their runner, per reference key and seed: not
# tried again in this process
_baseline_lost: dict[str, str] = {}


def _compile_baseline(
    task: Task, ref: RunnerHandle, device: str, seed: int, want: bool
) -> dict[str, Any]:
    """Have the reference runner compile the reference for its current inputs (or find it
    compiled): its reply, with ``error`` set when there is no compiled baseline."""
    if not want:
        return {"error": "turned off by $KF_COMPILE_BASELINE=0"}
    lost_key = f"{_ref_key(task, device)}:{seed}"
    if lost_key in _baseline_lost:
        return {"error": _baseline_lost[lost_key], "cached": True}
    try:
        reply: dict[str, Any] = ref.request(
            "compile_baseline",
            _compile_timeout_s(),
            cache_dir=_inductor_cache_dir(),
            mode=baseline_settings.compile_mode(),
            what="torch.compile of the reference",
        )
    except (RunnerTimeout, RunnerCrashed) as exc:
        why = f"torch.compile of the reference lost its runner: {exc}"
        _baseline_lost[lost_key] = why
        log.warning("compile_baseline_lost", task=task.name, error=why)
        raise _BaselineLost(why) from exc
    except RunnerFailed as exc:
        return {"error": f"torch.compile of the reference failed: {exc}"}
    if reply.get("error"):
        log.info("compile_baseline_failed", task=task.name, error=reply["error"])
    elif not reply.get("cached"):
        log.info("compile_baseline_compiled", task=task.name, seconds=reply.get("compile_s"))
    return reply


def _profile(
    task: Task,
    source: str,
    leased: list[RunnerHandle],
    *,
    device: str,
    seed: int,
    warmup: int,
    min_trials: int,
    min_time_s: float,
    max_trials: int,
    timeout_s: float,
    limits: Limits | None,
    pool: RunnerPool | None,
    compile_baseline: bool,
    tolerance: Tolerance | None = None,
) -> ProfileReport:
    """:func:`profile_candidate`; the runners it leases are added to ``leased``.

    Raises :class:`_BaselineLost` when the reference runner died or hung over the
    compiled baseline (remembered, so a second call skips it).
    """
    device = parse_device(device)
    pool = pool or default_pool()
    limits = limits or Limits()
    tol = _tol(task, tolerance)
    with (
        _device_lock(device),
        _trimmed(pool.reference_lease(_ref_key(task, device))) as ref,
        pool.lease() as cand,
    ):
        leased += [ref, cand]
        if not device.startswith("cuda"):
            # replacement runners import torch now, not during a CPU timing; CUDA events
            # time the GPU, which runner start-ups on the host do not slow
            pool.wait_warm()
        start = time.monotonic()
        deadline = _Deadline(timeout_s)
        try:
            made, problem = _loaded_and_checked(
                task, source, ref, cand, device, limits, deadline, seed, tol
            )
            if problem is not None:
                return ProfileReport(
                    ok=False,
                    failure_kind=problem[0],
                    error=f"wrong output before timing: {problem[1]}",
                    device=device,
                    duration_s=time.monotonic() - start,
                )

            baseline = _compile_baseline(task, ref, device, seed, compile_baseline)
            deadline = _Deadline(timeout_s)  # the compile had a time limit of its own
            compiled: dict[str, Any] = {
                "on": baseline.get("error") is None,
                "error": baseline.get("error"),
            }

            rtt_ns = min(_round_trip_ns(task, cand, deadline) for _ in range(3))
            # The grader's own wall clock around every timing request of the candidate:
            # samples forged or shrunk in-process cannot add up to it.
            # Per request: (calls, wall ms less the round trip, sum of the samples in ms).
            batches: list[tuple[int, float, float]] = []

            def timed(handle: RunnerHandle, n: int, is_candidate: bool) -> list[float]:
                call = _candidate if is_candidate else _reference
                t0 = time.perf_counter_ns()
                reply = call(task, handle, "time", deadline, n=n, what=f"timing {n} calls")
                samples = [ns / 1e6 for ns in reply["samples_ns"]]
                if is_candidate:
                    spent = max(0, time.perf_counter_ns() - t0 - rtt_ns) / 1e6
                    batches.append((len(samples), spent, sum(samples)))
                return samples

            def timed_compiled(n: int) -> list[float]:
                """Samples of the compiled reference; none once it has failed."""
                if not compiled["on"]:
                    return []
                try:
                    reply = ref.request(
                        "time", deadline.left(), n=n, compiled=True, what=f"timing {n} compiled"
                    )
                except (RunnerTimeout, RunnerCrashed) as exc:
                    why = f"the compiled reference lost its runner while timed: {exc}"
                    _baseline_lost[f"{_ref_key(task, device)}:{seed}"] = why
                    raise _BaselineLost(why) from exc
                except RunnerFailed as exc:
                    compiled.update(on=False, error=f"the compiled reference failed: {exc}")
                    return []
                return [ns / 1e6 for ns in reply["samples_ns"]]

            est_c = statistics.median(timed(cand, warmup, True) or [1.0])
            batches.clear()  # warm-up calls (first launches, caches) are not compared
            est_r = statistics.median(timed(ref, warmup, False) or [1.0])
            est_k = statistics.median(timed_compiled(warmup) or [0.0])
            round_s = max(min_time_s / 10, 0.01)
            per_round = max(1, min(200, int(round_s * 1e3 / max(est_c, est_r, est_k, 1e-3))))
            cand_ms: list[float] = []
            ref_ms: list[float] = []
            comp_ms: list[float] = []
            while len(cand_ms) < max_trials:
                enough = len(cand_ms) >= min_trials and len(ref_ms) >= min_trials
                enough = enough and (len(comp_ms) >= min_trials or not compiled["on"])
                if enough and (sum(cand_ms) >= min_time_s * 1e3 or deadline.left() < timeout_s / 3):
                    break
                cand_ms += timed(cand, per_round, True)
                ref_ms += timed(ref, per_round, False)
                comp_ms += timed_compiled(per_round)
            c, r = timing_stats(cand_ms), timing_stats(ref_ms)
            kc = timing_stats(comp_ms) if compiled["on"] and comp_ms else None

            # Outside view: wall time of K back-to-back calls, minus one request's overhead.
            k = max(5, min(10_000, math.ceil(50.0 / max(c["mean"], 1e-3))))
            t0 = time.perf_counter_ns()
            batch = _candidate(task, cand, "batch", deadline, n=k, what=f"a batch of {k} calls")
            outside_ms = max(0.0, (time.perf_counter_ns() - t0 - rtt_ns) / 1e6 / k)
            inside_ms = int(batch["total_ns"]) / 1e6 / k
            # Same K calls seen by both clocks: machine noise cancels, a tampered clock does not.
            flags = list(cross_check_flags(inside_ms, outside_ms))
            # the timing loop's own cost, from the candidate-free runner (timing_checks)
            empty = _empty_call(task, ref, deadline, per_round)
            disagree = timer_disagreement(batches, empty[0])
            if not flags and disagree is not None:
                flags.append(f"{TIMER_DISAGREEMENT}: {disagree}")
            elif flags:
                flags = [
                    f"{TIMER_DISAGREEMENT}: in-process {inside_ms:.4f} ms a call, the grader's "
                    f"wall clock {outside_ms:.4f} ms over {k} calls (request round trip "
                    f"{rtt_ns / 1e6:.3f} ms subtracted)"
                ]

            if (
                _run_and_check(
                    task,
                    ref,
                    cand,
                    given=_given(cand, device, made, seed),
                    seed=seed,
                    deadline=deadline,
                    tol=tol,
                )
                is not None
            ):
                flags.append(f"{OUTPUT_CHANGED}: the timed inputs' output is wrong after timing")

            # Fresh inputs after timing: stale buffers and result caches show up here.
            fresh = [
                _reference(
                    task, ref, "make_inputs", deadline, seed=fs, send=not _own_inputs(cand, device)
                )
                for fs in _seed_trials(seed ^ 0xF4E5, _FRESH_SETS)
            ]
            fresh_seed = _seed_trials(seed ^ 0xF4E5, _FRESH_SETS)[0]
            problem = _run_and_check(
                task,
                ref,
                cand,
                given=_given(cand, device, fresh[0], fresh_seed),
                seed=fresh_seed,
                deadline=deadline,
                tol=tol,
            )
            if problem is not None:
                return ProfileReport(
                    ok=False,
                    failure_kind="stale_output",
                    error=f"wrong output on fresh inputs after timing: {problem[1]}",
                    device=device,
                    flags=tuple(flags),
                    duration_s=time.monotonic() - start,
                )
            reply = _candidate(
                task,
                cand,
                "time_inputs",
                deadline,
                **(
                    {"seeds": _seed_trials(seed ^ 0xF4E5, _FRESH_SETS)}
                    if _own_inputs(cand, device)
                    else {"inputs": [f["inputs"] for f in fresh]}
                ),
                paired=True,
                what="timing fresh inputs",
            )
            fresh_samples = [ns / 1e6 for ns in reply["samples_ns"]]
            fresh_ms = statistics.median(fresh_samples or [0.0])
            # older runners answer without the paired calls: compare with the timed median
            repeated = [ns / 1e6 for ns in reply.get("repeated_ns") or []] or [c["median"]]
            cached = cache_suspected(fresh_samples, repeated, empty[1])
            if cached is not None:
                flags.append(f"{CACHE_SUSPECTED}: {cached}")
            flags += [f for f in cand.findings if f not in flags]
        except _CandidateFailed as exc:
            _after_candidate_failure(ref, exc, device)
            log.info("candidate_profile_failed", task=task.name, kind=exc.kind)
            return ProfileReport(
                ok=False,
                failure_kind=exc.kind,
                error=exc.error,
                device=device,
                duration_s=time.monotonic() - start,
            )
    timer = (
        "time.perf_counter_ns bound at runner start-up before candidate import; one call per "
        "sample; PyTorch eager (and the reference under torch.compile) timed alternately in "
        "a candidate-free runner; cross-checked against the grader's wall clock over a "
        "batch of calls"
    )
    best_ref = min(r["mean"], kc["mean"]) if kc is not None else None
    report = ProfileReport(
        ok=True,
        runtime_ms=c["mean"],
        runtime_std_ms=c["std"],
        runtime_median_ms=c["median"],
        runtime_min_ms=c["min"],
        runtime_ci95_ms=c["ci95"],
        trials=len(cand_ms),
        ref_runtime_ms=r["mean"],
        ref_runtime_std_ms=r["std"],
        ref_runtime_median_ms=r["median"],
        ref_trials=len(ref_ms),
        ref_runtime_ci95_ms=r["ci95"],
        fresh_runtime_ms=fresh_ms,
        speedup=r["mean"] / c["mean"] if c["mean"] > 0 else 0.0,
        timer=timer,
        outside_wall_ms=outside_ms,
        outside_calls=k,
        empty_call_ms=empty[0],
        flags=tuple(flags),
        device=device,
        threads=cand.threads,
        duration_s=time.monotonic() - start,
        compiled_runtime_ms=kc["mean"] if kc is not None else None,
        compiled_runtime_std_ms=kc["std"] if kc is not None else 0.0,
        compiled_runtime_median_ms=kc["median"] if kc is not None else 0.0,
        compiled_runtime_ci95_ms=kc["ci95"] if kc is not None else 0.0,
        compiled_trials=len(comp_ms) if kc is not None else 0,
        compile_baseline=str(baseline.get("baseline", "")),
        compile_baseline_s=0.0 if baseline.get("cached") else float(baseline.get("compile_s", 0.0)),
        compile_baseline_cached=bool(baseline.get("cached")),
        compile_baseline_graphs=int(baseline.get("graphs", 0)),
        compile_baseline_error=None
        if kc is not None
        else str(compiled["error"] or "no sample of the compiled reference"),
        speedup_vs_compiled=kc["mean"] / c["mean"] if kc is not None and c["mean"] > 0 else None,
        speedup_vs_best=best_ref / c["mean"] if best_ref is not None and c["mean"] > 0 else None,
        # what the reference runner said: a runner that does not say compiles the default
        # mode and leaves TF32 as PyTorch starts (kf.evaluation.baseline_settings)
        compile_mode=str(baseline.get("mode") or "default") if kc is not None else "",
        tf32=baseline_settings.tf32_summary(made.get("precision")) or "pytorch-default",
    )
    log.info(
        "candidate_profiled",
        task=task.name,
        runtime_ms=report.runtime_ms,
        speedup=report.speedup,
        speedup_vs_compiled=report.speedup_vs_compiled,
        flags=report.flags,
    )
    return report


def collect_counters(
    task: Task,
    source: str,
    *,
    device: str,
    seed: int = 0,
    timeout_s: float = 300.0,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
) -> CountersReport:
    """Nsight Compute's counters for one forward call of a (verified) candidate.

    The candidate runs in a runner started under ``ncu`` (:mod:`kf.cuda.ncu`), inside
    the runner's box, after a forward call checked against the reference as in every
    stage. ncu is never run outside the box: where the driver lets only administrators
    read counters, the report says so. Unboxed runners (``--unsafe-no-sandbox``) try
    once outside their network namespace instead, and the report says that. Call it
    with the device to itself: ncu replays each kernel.
    """
    leased: list[RunnerHandle] = []
    report = _counters(
        task,
        source,
        leased,
        device=device,
        seed=seed,
        timeout_s=timeout_s,
        limits=limits,
        pool=pool,
    )
    return _sandboxed(report, leased)


def _counters(
    task: Task,
    source: str,
    leased: list[RunnerHandle],
    *,
    device: str,
    seed: int,
    timeout_s: float,
    limits: Limits | None,
    pool: RunnerPool | None,
) -> CountersReport:
    """:func:`collect_counters`; the runners it starts are added to ``leased``."""
    import shutil
    import tempfile
    from pathlib import Path

    from kf.cuda import ncu

    device = parse_device(device)
    pool = pool or default_pool()
    limits = limits or Limits()
    start = time.monotonic()
    tool = ncu.find_ncu()
    if not device.startswith("cuda") or tool is None:
        why = "not a CUDA device" if tool else "ncu (Nsight Compute) was not found"
        return CountersReport(ok=False, error=why, device=device)
    version = ncu.version(tool)
    folder = Path(tempfile.mkdtemp(prefix="kf-ncu-"))
    try:
        for isolate in (True, False):
            log_file = folder / f"ncu-{int(isolate)}.csv"
            deadline = _Deadline(timeout_s)
            cand = RunnerHandle(
                pool.python,
                pool.threads,
                wrapper=ncu.command(tool, str(log_file)),
                isolate=isolate,
                ro_paths=(str(Path(tool).resolve().parent),),
                rw_paths=(str(folder),),
            )
            leased.append(cand)
            boxed = cand.sandbox == box.MODE_BWRAP
            isolated = cand.isolated_network
            try:
                with pool.reference_lease(_ref_key(task, device)) as ref:
                    _, problem = _loaded_and_checked(
                        task, source, ref, cand, device, limits, deadline, seed
                    )
                    if problem is not None:
                        return CountersReport(
                            ok=False, error=f"wrong output under ncu: {problem[1]}", tool=version,
                            device=device, duration_s=time.monotonic() - start,
                        )  # fmt: skip
                    _candidate(task, cand, "counters", deadline, what="the profiled call")
                cand.finish(deadline.left())
            except _CandidateFailed as exc:
                return CountersReport(
                    ok=False, error=f"{exc.kind}: {exc.error}", tool=version, device=device,
                    duration_s=time.monotonic() - start,
                )  # fmt: skip
            except RunnerError as exc:  # the runner under ncu did not start or answer
                if isolated and not boxed:
                    continue  # ncu may not work inside the namespace: once more outside
                return CountersReport(
                    ok=False, error=f"the runner under ncu failed: {exc}; log: "
                    f"{exc.log_tail[-1500:]}", tool=version, device=device,
                    duration_s=time.monotonic() - start,
                )  # fmt: skip
            finally:
                tail = cand.log_tail()
                cand.kill()
            text = log_file.read_text(errors="replace") if log_file.exists() else ""
            kernels = ncu.parse(text)
            if kernels:
                return CountersReport(
                    ok=True, tool=version, device=device, kernels=tuple(kernels),
                    summary=ncu.summarise(kernels), network_isolated=isolated,
                    duration_s=time.monotonic() - start,
                )  # fmt: skip
            if boxed and ncu.permission_refused(text + tail):
                return CountersReport(
                    ok=False, error="ncu may not read the GPU's counters inside kf's box (the "
                    "driver lets only administrators: NVreg_RestrictProfilingToAdminUsers=0 "
                    "allows everyone)", tool=version, device=device,
                    duration_s=time.monotonic() - start,
                )  # fmt: skip
            if boxed or not (isolated and ncu.permission_refused(text + tail)):
                break
        detail = (text.strip() or tail.strip())[-1500:]
        return CountersReport(
            ok=False, error=f"ncu measured no kernel: {detail}", tool=version, device=device,
            duration_s=time.monotonic() - start,
        )  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def reverify_fast(
    task: Task,
    source: str,
    report: ProfileReport,
    *,
    device: str = "cpu",
    seed: int = 0,
    timeout_s: float = 120.0,
    pool: RunnerPool | None = None,
    tolerance: Tolerance | None = None,
) -> ProfileReport:
    """Re-verify a speed-up above :data:`REVERIFY_ABOVE` on fresh seeds and shapes, and flag it.

    The profile is returned unchanged below the threshold; above it, it carries the
    re-verification and a ``speedup_over_10x`` flag, and fails (``reverify_failed``)
    when the re-verification does.
    """
    if not report.ok or report.speedup <= REVERIFY_ABOVE:
        return report
    again = verify_candidate(
        task,
        source,
        device=device,
        seed=seed + 1,
        timeout_s=timeout_s,
        pool=pool,
        tolerance=tolerance,
    )
    note = (
        f"speedup_over_10x: {report.speedup:.1f}× re-verified on {again.trials} fresh inputs "
        f"and {len(again.variant_evidence)} unseen shapes: "
        + ("passed" if again.correct else f"FAILED ({again.failure_kind})")
    )
    log.info("candidate_reverified", task=task.name, speedup=report.speedup, ok=again.correct)
    if again.correct:
        return msgspec.structs.replace(report, flags=(*report.flags, note), reverify=again)
    return msgspec.structs.replace(
        report,
        ok=False,
        failure_kind="reverify_failed",
        error=f"a {report.speedup:.1f}× speed-up did not survive re-verification: {again.error}",
        flags=(*report.flags, note),
        reverify=again,
    )


def _empty_call(task: Task, ref: RunnerHandle, deadline: _Deadline, n: int) -> tuple[float, float]:
    """The timing loop's cost per call around a call that does nothing, in the
    candidate-free runner: (the grader's wall ms less the request's round trip, the
    in-process sample in ms), each the smaller of two measurements."""
    n = max(20, n)
    walls: list[float] = []
    inside: list[float] = []
    for _ in range(2):
        t0 = time.perf_counter_ns()
        _reference(task, ref, "ping", deadline)
        rtt = time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        reply = _reference(task, ref, "time", deadline, n=n, empty=True, what="an empty call")
        walls.append(max(0, time.perf_counter_ns() - t0 - rtt) / 1e6 / n)
        inside.append(statistics.median([ns / 1e6 for ns in reply["samples_ns"]] or [0.0]))
    return min(walls), min(inside)


def _round_trip_ns(task: Task, handle: RunnerHandle, deadline: _Deadline) -> int:
    t0 = time.perf_counter_ns()
    _candidate(task, handle, "ping", deadline)
    return time.perf_counter_ns() - t0


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


def evaluate(
    task: Task,
    source: str,
    *,
    device: str = "cpu",
    seed: int = 0,
    pool: RunnerPool | None = None,
    limits: Limits | None = None,
    timeout_s: float = 120.0,
    profile_options: dict[str, Any] | None = None,
    profile: bool = True,
    counters: bool = False,
    tolerance: Tolerance | None = None,
    build_timeout_s: float | None = None,
    audit: bool = False,
) -> EvalResult:
    """Compile, verify (with the generalisation gate), and when correct profile; ``kf eval``.

    A speed-up above :data:`REVERIFY_ABOVE` is re-verified before it is reported; with
    ``counters``, a profiled candidate is run once more under ncu (:func:`collect_counters`).
    ``profile_options`` go to :func:`profile_candidate` (``min_time_s``, ``warmup``…).
    ``timeout_s`` limits verification and profiling; ``build_timeout_s`` the build (None:
    ``$KF_BUILD_TIMEOUT_S`` or 600 s); ``tolerance`` is the run's (None: the task's own,
    else KernelBench's). With ``audit``, the task is audited too (is it degenerate?
    :mod:`kf.evaluation.audit`).
    """
    from kf.evaluation.audit import audit_task

    audited = (
        audit_task(task, device=device, seed=seed, pool=pool, tolerance=tolerance)
        if audit
        else None
    )
    compiled = compile_candidate(
        task, source, device=device, pool=pool, limits=limits, timeout_s=build_timeout_s
    )
    if not compiled.ok:
        return EvalResult(task=task.name, compile=compiled, device=device, seed=seed, audit=audited)
    verified = verify_candidate(
        task,
        source,
        device=device,
        seed=seed,
        pool=pool,
        limits=limits,
        timeout_s=timeout_s,
        tolerance=tolerance,
    )
    if not verified.correct or not profile:
        return EvalResult(
            task=task.name,
            compile=compiled,
            verify=verified,
            device=device,
            seed=seed,
            audit=audited,
        )
    # kf's one profiling policy, as the profiler agent of `kf run` applies it; a lone
    # evaluation has no earlier sessions and no incumbent, so of its guards only the
    # re-verification above 10x can apply here
    from kf.evaluation.policy import stated_profile

    profiled = stated_profile(
        task,
        source,
        device=device,
        seed=seed,
        pool=pool,
        limits=limits,
        timeout_s=timeout_s,
        tolerance=tolerance,
        **(profile_options or {}),
    )
    measured = (
        collect_counters(task, source, device=device, seed=seed, pool=pool, limits=limits)
        if counters and profiled.ok
        else None
    )
    return EvalResult(
        task=task.name,
        compile=compiled,
        verify=verified,
        profile=profiled,
        device=device,
        seed=seed,
        counters=measured,
        audit=audited,
    )
