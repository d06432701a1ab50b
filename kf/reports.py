"""What each evaluation stage found, as msgspec structs that kf's events can embed (the grader
makes them; :mod:`kf.search_facts` carries them).

Schema rules: every field after the first few has a default, so fields can be added
later without breaking old logs; a field's type never changes.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "FAILURE_KINDS",
    "FLAG_REASONS",
    "SUSPECT_FLAGS",
    "CompileReport",
    "CountersReport",
    "EvalResult",
    "FailureKind",
    "Float64Rule",
    "ProfileReport",
    "TaskAudit",
    "TrialEvidence",
    "VerifyReport",
    "is_suspect",
]


class TaskAudit(msgspec.Struct, frozen=True, kw_only=True):
    """Whether a task's reference outputs depend on its inputs (see kf.evaluation.grader.audit)."""

    degenerate: bool
    reason: str = ""
    input_sets: int = 0  # input sets the reference was run on
    spread: float = 0.0  # max |out_i - out_0| / max |out_0| over the sets
    constant_passes: int = 0  # sets on which a constant answer would pass
    duration_s: float = 0.0
    error: str | None = None  # the audit could not run (the task is not judged degenerate)


FailureKind = Literal[
    "exception",
    "shape_mismatch",
    "dtype_mismatch",
    "mismatch",
    "nan_inf",
    "input_mutated",
    "timeout",
    "crash",
    "compile_error",
    "tampering",
    "generalisation_failed",
    "stale_output",
    "reverify_failed",
    "distribution_failed",
    "user_test_failed",  # a task package's user test (kf.kernels.task_packages)
]
FAILURE_KINDS: tuple[str, ...] = FailureKind.__args__  # type: ignore[attr-defined]


# Flags are strings "code: detail"; the code says which check fired, the detail why.
FLAG_REASONS: dict[str, str] = {
    "torch_compute": "forward ran PyTorch compute ops, so the speed may be PyTorch's own",
    "introspection": "the candidate inspected the garbage collector, stack frames or tracers",
    "network": "the candidate tried to use the network (blocked)",
    "tampering": "the candidate patched the runner's classes",
    "timer_disagreement": "the in-process timer disagrees with the grader's wall clock",
    "output_changed_after_timing": "the output on the timed inputs changed after timing",
    "cache_suspected": "much faster on repeated inputs than on fresh ones (a cached result?)",
    "speedup_over_10x": "a speed-up above 10x: re-verified on fresh inputs and shapes",
    "eager_outlier": "eager was unusually slow this session: speed-up against earlier median",
    "unsandboxed": "outside the box a candidate can read kf's secrets and files and forge results",
    "degenerate_task": "the task's outputs do not depend on its inputs: a constant passes it",
    "busy_child": "a process the candidate started ran while another runner was timed "
    "(its baseline, say): kf stopped it, so the timing is fair",
    "gpu_child_killed": "a process the candidate started held a GPU while another runner was "
    "timed: kf killed it",
    # timings that hold (issue 47: kf.evaluation.grader.graph_figures, clock_watch)
    "clocks_dropped": "the GPU's clocks dropped during a timing, and again when it was retimed",
    "device_state_left": "a call left persisting-L2 state for the next: reset before each timed "
    "call, so the figure does not gain from it",
    "graph_mismatch": "captured in a CUDA graph, the call computed something else: the graph's "
    "figure is not used",
    # static checks (kf.kernels.static_checks)
    "no_custom_kernel": "no native kernel is built or loaded",
    "kernel_never_called": "a kernel is built but forward never calls it",
    "try_fallback": "forward catches exceptions (a fallback can hide a broken kernel)",
    "stream": "side streams or events can carry work past the timer",
    "thread": "threads or processes can carry work past the timer",
    "timer_patching": "the candidate reassigns timers, synchronize or modules",
}
# Flags that make a timing untrustworthy: such a candidate never becomes an elite.
SUSPECT_FLAGS = frozenset(
    {
        "timer_disagreement",
        "output_changed_after_timing",
        "cache_suspected",
        "tampering",
        "gpu_child_killed",
    }
)


def is_suspect(flags: tuple[str, ...] | list[str]) -> bool:
    """Whether any flag makes a timing untrustworthy (its code is in :data:`SUSPECT_FLAGS`)."""
    return any(f.split(":", 1)[0] in SUSPECT_FLAGS for f in flags)


# A stage report's ``sandbox``: where its runners ran: ``"bwrap"``, in kf's box
# (kf.evaluation.grader.box), or ``"unsafe-no-sandbox"``, outside it (``--unsafe-no-sandbox``),
# in which case its flags (a compile report's warnings) carry an ``unsandboxed`` flag
# too. Logs written before the box existed say ``""``.
#
# A stage report's ``phases``: for each runner request op (``setup``, ``load_candidate``,
# ``run``, ``check``, ``time``, ...), the seconds the grader waited for the stage's
# runners' replies, and ``lease_wait``, the seconds it waited for a leased runner to
# finish starting (not part of ``duration_s``). Wall times, as noisy as ``duration_s``:
# they say where a stage's time went, not what a kernel costs.


class CompileReport(msgspec.Struct, frozen=True, kw_only=True):
    """Whether the candidate imported and its ``ModelNew`` was constructed (building its code)."""

    ok: bool
    error: str | None = None
    log: str = ""
    duration_s: float = 0.0
    failure_kind: str | None = None
    warnings: tuple[str, ...] = ()  # static checks and runtime findings, "code: detail"
    phases: dict[str, float] = {}  # seconds per runner request op (see above)
    sandbox: str = ""  # "bwrap" or "unsafe-no-sandbox" (see above); "" in older logs


class Float64Rule(msgspec.Struct, frozen=True, kw_only=True):
    """Which rule decided a comparison and what the float64 run found (the fields of
    :class:`kf.evaluation.wire.verdict.Verdict` that a trial's evidence keeps, as described
    there)."""

    rule: str = ""
    rmse_fp64: float | None = None
    eager_rmse_fp64: float | None = None
    max_err_fp64: float | None = None
    eager_max_err_fp64: float | None = None
    fp64_skipped: str = ""


class TrialEvidence(Float64Rule, frozen=True, kw_only=True):
    """One correctness trial: the seed of its inputs and how far the candidate was off;
    which rule decided ("allclose", "float64"; "" in older logs) and, where allclose
    failed, the errors against a float64 run of the reference (kf.evaluation.wire.verdict)."""

    seed: int
    ok: bool
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    reason: str | None = None
    label: str = ""  # for a generalisation variant: which input shapes
    min_tol: float = 0.0  # the smallest atol = rtol at which this trial passes (0.0: older logs)


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    """Whether the candidate matched the reference on every trial, with per-trial evidence."""

    correct: bool
    failure_kind: str | None = None
    error: str | None = None
    trials: int = 0
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    evidence: tuple[TrialEvidence, ...] = ()
    atol: float = 0.0
    rtol: float = 0.0
    duration_s: float = 0.0
    variant_evidence: tuple[TrialEvidence, ...] = ()  # the generalisation gate's trials
    flags: tuple[str, ...] = ()
    phases: dict[str, float] = {}  # seconds per runner request op (see above)
    sandbox: str = ""  # "bwrap" or "unsafe-no-sandbox" (see above); "" in older logs
    # the smallest atol = rtol that every trial run would have passed at, and where the
    # tolerance used came from (kf.evaluation.wire.tolerance); 0.0 and "" in older logs
    min_tolerance: float = 0.0
    tolerance_source: str = ""
    # the hidden input distributions: the task's inputs scaled by 3, 0.01 and -1
    distribution_evidence: tuple[TrialEvidence, ...] = ()
    # the most device memory the stage's runners held at once, as they state it (MB; their
    # allocators' reserved bytes, CUDA contexts not counted); None off a GPU and in older logs
    peak_device_mb: float | None = None
    # how outputs were judged (kf.evaluation.wire.tolerance.rule_of; "" in older logs), and how
    # many comparisons only the float64 rule passed (allclose failed them)
    rule: str = ""
    float64_passed: int = 0


class ProfileReport(msgspec.Struct, frozen=True, kw_only=True):
    """Candidate, PyTorch-eager and ``torch.compile`` timings from one session on one device.

    ``speedup`` is always against eager (the archive's fitness and every older log read
    it so); ``speedup_vs_compiled`` is against the reference under ``torch.compile``,
    ``speedup_vs_best`` against the faster of the two. Both are None when there is no
    compiled timing, and ``compile_baseline_error`` says why (turned off, or
    ``torch.compile`` failed). ``compile_baseline_s`` is the time this profile spent
    compiling the reference: 0.0 with ``compile_baseline_cached`` when an earlier
    profile in the same reference runner compiled it.
    """

    ok: bool
    error: str | None = None
    runtime_ms: float = 0.0
    runtime_std_ms: float = 0.0
    runtime_median_ms: float = 0.0
    runtime_min_ms: float = 0.0
    runtime_ci95_ms: float = 0.0
    trials: int = 0
    ref_runtime_ms: float = 0.0
    ref_runtime_std_ms: float = 0.0
    ref_runtime_median_ms: float = 0.0
    ref_trials: int = 0
    speedup: float = 0.0
    timer: str = ""
    outside_wall_ms: float | None = None
    outside_calls: int = 0
    flags: tuple[str, ...] = ()
    device: str = "cpu"
    threads: int = 0
    failure_kind: str | None = None
    duration_s: float = 0.0
    ref_runtime_ci95_ms: float = 0.0
    fresh_runtime_ms: float | None = None  # median of one call on each of a few fresh inputs
    reverify: VerifyReport | None = None  # re-verification of a speed-up above 10x
    phases: dict[str, float] = {}  # seconds per runner request op (see above)
    # the reference under torch.compile, timed alternately with eager and the candidate
    compiled_runtime_ms: float | None = None
    compiled_runtime_std_ms: float = 0.0
    compiled_runtime_median_ms: float = 0.0
    compiled_runtime_ci95_ms: float = 0.0
    compiled_trials: int = 0
    compile_baseline: str = ""  # how it was compiled: mode, backend, torch version
    compile_baseline_s: float = 0.0
    compile_baseline_cached: bool = False
    compile_baseline_graphs: int = 0  # graphs dynamo compiled (0: ran eagerly, or unknown)
    compile_baseline_error: str | None = None
    speedup_vs_compiled: float | None = None
    speedup_vs_best: float | None = None
    sandbox: str = ""  # "bwrap" or "unsafe-no-sandbox" (see above); "" in older logs
    # the baselines' settings as the reference runner stated them
    # (kf.evaluation.grader.baseline_settings); "" in older logs
    compile_mode: str = ""  # torch.compile mode of the compiled time ("": none measured)
    tf32: str = ""  # "off", "on", or "pytorch-default" (matmul off, cuDNN on)
    # the grader's wall ms of one call that does nothing in the same timing loop, from the
    # candidate-free runner: subtracted before the wall clock is compared with the samples
    empty_call_ms: float | None = None
    # as VerifyReport's: the most device memory the profile's runners held at once (MB)
    peak_device_mb: float | None = None
    # issue 47, timings that hold (kf.evaluation.grader.graph_figures): which method gave
    # runtime_ms, the reference's figures and the speed-ups: "events" (one call between
    # CUDA events, or the CPU clock) or "graph-N" (N calls in one CUDA graph, per call)
    method: str = "events"
    graph_calls: int = 0  # N of the graph's figures (0: not timed in a graph)
    graph_error: str = ""  # why a side has no graph figure ("side: why; ...")
    graph_runtime_ms: float | None = None
    graph_ref_runtime_ms: float | None = None
    graph_compiled_runtime_ms: float | None = None
    # the per-call figures, kept here when the graph's are the headline
    events_runtime_ms: float | None = None
    events_ref_runtime_ms: float | None = None
    events_speedup: float | None = None
    # the GPU's clocks around every timing request (kf.evaluation.grader.clock_watch):
    # sm_mhz, mem_mhz, temp_c as [min, max], readings, read_by, retimed, kept_dropped;
    # {} off a GPU, where nothing answered, and in older logs
    clocks: dict[str, Any] = {}
    # device state a timed call had left, reset before the next (persisting L2; "": none)
    device_state_found: str = ""


class CountersReport(msgspec.Struct, frozen=True, kw_only=True):
    """Hardware counters (Nsight Compute) of one forward call of a verified candidate."""

    ok: bool
    error: str | None = None
    tool: str = ""  # e.g. "Version 2025.3.1.0 (build …)"
    device: str = "cpu"
    kernels: tuple[dict[str, Any], ...] = ()  # one per kernel: name and kf.cuda.ncu.METRICS
    summary: dict[str, float] = {}  # kf.cuda.ncu.summarise
    network_isolated: bool = True  # False when ncu could only run outside the namespace
    duration_s: float = 0.0
    sandbox: str = ""  # "bwrap" or "unsafe-no-sandbox" (see above); "" in older logs
    #: ncu could not start a runner at all (a tool not installed completely, or refused
    #: before any candidate code ran): the counter collector stops trying for the run
    unusable: bool = False


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    """``kf eval``: compile, then verify, then (only when correct) profile."""

    task: str
    compile: CompileReport
    verify: VerifyReport | None = None
    profile: ProfileReport | None = None
    device: str = "cpu"
    seed: int = 0
    counters: CountersReport | None = None
    audit: TaskAudit | None = None  # the task's audit (kf eval; kf.evaluation.grader.audit)

    @property
    def correct(self) -> bool:
        return self.verify is not None and self.verify.correct

    @property
    def failed_stage(self) -> CompileReport | VerifyReport | ProfileReport | None:
        """The first stage that failed (compile, verify, then profile), or None."""
        if not self.compile.ok:
            return self.compile
        if self.verify is not None and not self.verify.correct:
            return self.verify
        if self.profile is not None and not self.profile.ok:
            return self.profile
        return None

    @property
    def failure_kind(self) -> str | None:
        """The first failing stage's failure kind, or None."""
        stage = self.failed_stage
        return stage.failure_kind if stage is not None else None

    @property
    def flags(self) -> tuple[str, ...]:
        """Every warning and flag of every stage, without repeats."""
        found: list[str] = []
        parts = [self.compile.warnings]
        parts += [self.verify.flags] if self.verify is not None else []
        parts += [self.profile.flags] if self.profile is not None else []
        if self.audit is not None and self.audit.degenerate:
            parts.append((f"degenerate_task: {self.audit.reason}",))
        for part in parts:
            found += [f for f in part if f not in found]
        return tuple(found)

    @property
    def sandbox(self) -> str:
        """``"unsafe-no-sandbox"`` when any stage ran outside the box, else the first
        stage's mode (``"bwrap"``)."""
        stages = [self.compile, self.verify, self.profile, self.counters]
        modes = [s.sandbox for s in stages if s is not None]
        return "unsafe-no-sandbox" if "unsafe-no-sandbox" in modes else modes[0]

    @property
    def suspect(self) -> bool:
        """Whether a flag makes the timing untrustworthy (see :data:`SUSPECT_FLAGS`)."""
        return is_suspect(self.flags)

    @property
    def passed(self) -> bool:
        """Correct, and profiled without failure when profiling ran."""
        return self.correct and (self.profile is None or self.profile.ok)

    @property
    def error(self) -> str | None:
        """The first stage's error, or None when every stage that ran succeeded."""
        stage = self.failed_stage
        return stage.error if stage is not None else None

    def summary(self) -> dict[str, Any]:
        """A flat JSON-ready object (``kf eval --json``)."""
        v, p = self.verify, self.profile
        return {
            "task": self.task,
            "device": self.device,
            "seed": self.seed,
            "compiled": self.compile.ok,
            "correct": self.correct,
            "failure_kind": self.failure_kind,
            "max_abs_err": v.max_abs_err if v is not None else None,
            "max_rel_err": v.max_rel_err if v is not None else None,
            "trials": v.trials if v is not None else 0,
            "runtime_ms": p.runtime_ms if p is not None and p.ok else None,
            "runtime_std_ms": p.runtime_std_ms if p is not None and p.ok else None,
            "ref_runtime_ms": p.ref_runtime_ms if p is not None and p.ok else None,
            "speedup": p.speedup if p is not None and p.ok else None,
            "compiled_runtime_ms": p.compiled_runtime_ms if p is not None and p.ok else None,
            "speedup_vs_compiled": p.speedup_vs_compiled if p is not None and p.ok else None,
            "speedup_vs_best": p.speedup_vs_best if p is not None and p.ok else None,
            "compile_baseline_s": p.compile_baseline_s if p is not None and p.ok else None,
            "compile_baseline_error": p.compile_baseline_error if p is not None else None,
            "flags": list(self.flags),
            "suspect": self.suspect,
            "error": self.error,
            "compile": msgspec.to_builtins(self.compile),
            "verify": msgspec.to_builtins(v) if v is not None else None,
            "profile": msgspec.to_builtins(p) if p is not None else None,
            "counters": msgspec.to_builtins(self.counters) if self.counters is not None else None,
            "sandbox": self.sandbox,
            "degenerate_task": self.audit.degenerate if self.audit is not None else None,
            "audit": msgspec.to_builtins(self.audit) if self.audit is not None else None,
        }
