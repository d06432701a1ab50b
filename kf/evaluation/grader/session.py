"""The grading session: what every stage of one candidate's evaluation takes
(:class:`GradingSession`), and one stage of it under way (:class:`Stage`: its deadline,
the runners it leased, and the requests to them).

A stage function of :mod:`~kf.evaluation.grader.compiling`,
:mod:`~kf.evaluation.grader.verifying`, :mod:`~kf.evaluation.grader.profiling`,
:mod:`~kf.evaluation.grader.counters` (and the task check and
the audit) takes a session; the public entry points (``verify_candidate(task, source,
device=..., seed=...)`` and the others) make one from their arguments.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

import structlog

from kf.devices.names import parse_device
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.grading import (
    AnyReport,
    CandidateFailed,
    Deadline,
    device_lock,
    discard_reference_if_pinned,
    makes_own_inputs,
    reference_runner_key,
    setup_request,
    stage_peak_device_mb,
    stage_phases,
    trim_reference,
    with_sandbox_marks,
)
from kf.evaluation.grader.sandbox import (
    Limits,
    RunnerCrashed,
    RunnerError,
    RunnerFailed,
    RunnerHandle,
    RunnerPool,
    RunnerTimeout,
    default_pool,
    quiet_others,
)
from kf.evaluation.wire.protocol import (
    Check,
    InputsMade,
    LoadCandidate,
    LoadTask,
    MakeInputs,
    Ran,
    Reply,
    Request,
    Run,
    SetUp,
    TaskLoaded,
    Verdict,
)
from kf.evaluation.wire.tolerance import Tolerance, resolve
from kf.kernels.tasks import Task, TaskError
from kf.reports import FAILURE_KINDS
from kf.settings import Settings, current

__all__ = ["GradingSession", "Stage"]

_R = TypeVar("_R", bound=Reply)
log = structlog.get_logger("kf.evaluation.grader.session")


@dataclass(frozen=True)
class GradingSession:
    """One candidate (``source``, empty for the task alone) of ``task`` graded on
    ``device``: the seed its trials derive from, the pool its runners come from (None:
    the process's), their limits, a stage's time limit, the tolerance (None: the
    task's own, else KernelBench's), the run's other measuring conditions (None: from the
    settings: ``kf eval``, a library call), and the grading process's settings (None: read
    when the session is made). The stages read no setting of their own: they are handed
    these."""

    task: Task
    source: str = ""
    device: str = "cpu"
    seed: int = 0
    pool: RunnerPool | None = None
    limits: Limits = field(default_factory=Limits)
    timeout_s: float = 120.0
    tolerance: Tolerance | None = None
    conditions: Conditions | None = None
    #: the grading process's settings (its transports, limits, caches); None: read now
    settings: Settings | None = None
    #: what gives a timing the device to itself (a worker's :meth:`kf.devices.gate.Turns.alone`);
    #: None: this process's lock of the device (``kf eval``, a library call)
    alone: Callable[[], AbstractContextManager[object]] | None = None
    #: what gives work that runs on the device a share of it, for a stage that starts
    #: holding none (:meth:`kf.devices.gate.Turns.sharing`); None: the caller's hold covers it
    sharing: Callable[[], AbstractContextManager[object]] | None = None
    #: names the one candidate (and attempt) whose stages may hand their runner on: the
    #: build's runner then verifies it, and the verification's profiles it (None: every
    #: stage a fresh runner). Never another candidate's runner: the key says whose it is.
    candidate_key: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", parse_device(self.device))
        if self.settings is None:  # where settings are read: a session is an entry point
            object.__setattr__(self, "settings", current())
        if self.conditions is None:
            object.__setattr__(self, "conditions", Conditions.from_settings(self.grader))

    def exclusively(self) -> AbstractContextManager[object]:
        """The device to this session alone (:attr:`alone`), for a timing."""
        return self.alone() if self.alone is not None else device_lock(self.device)

    def shared(self) -> AbstractContextManager[object]:
        """A share of the device (:attr:`sharing`), for work that runs on it untimed."""
        return self.sharing() if self.sharing is not None else contextlib.nullcontext()

    @property
    def runners(self) -> RunnerPool:
        """The pool the stages lease runners from."""
        return self.pool or default_pool()

    @property
    def grader(self) -> Settings:
        """The grading process's settings, as the session was made with them."""
        assert self.settings is not None  # set by __post_init__
        return self.settings

    @property
    def cond(self) -> Conditions:
        """The measuring conditions the session's runners are set up under."""
        assert self.conditions is not None  # set by __post_init__
        return self.conditions

    @cached_property
    def tol(self) -> Tolerance:
        """The tolerance the task's outputs are judged at."""
        return resolve(self.tolerance, self.task.source)[0]

    @cached_property
    def kept_key(self) -> str | None:
        """What a candidate runner is kept under between this candidate's stages: its
        key, its source and the task, device and conditions (None: not kept)."""
        if self.candidate_key is None:
            return None
        source = hashlib.sha256(self.source.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{self.candidate_key}:{source[:32]}:{self.reference_key}"

    @property
    def reference_key(self) -> str:
        """The key reference runners of the task on the device are reused under."""
        return reference_runner_key(self.task, self.device, self.cond)


class Stage:
    """One stage of a session under way: its deadline, the reference runner (``ref``)
    and candidate runner (``cand``) it leased, and its requests to them."""

    def __init__(self, session: GradingSession, timeout_s: float | None = None) -> None:
        self.session = session
        self.task = session.task
        self.device = session.device
        self.deadline = Deadline(session.timeout_s if timeout_s is None else timeout_s)
        self.since = time.monotonic()
        #: every runner the stage used, for its report's phases and sandbox
        self.leased: list[RunnerHandle] = []
        self._ref: RunnerHandle | None = None
        self._cand: RunnerHandle | None = None
        #: the grader's own seconds in the stage's phases (:meth:`alone`)
        self._own: dict[str, float] = {}

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """The device to this stage alone (:meth:`GradingSession.exclusively`); the seconds
        it waited for that turn and held it are its phases ``turn_wait`` and
        ``turn_held`` (the timing turn, which every other stage on the device waits on).
        Every other candidate's box is quiet meanwhile (:func:`quiet_others`)."""
        asked = time.monotonic()
        with self.session.exclusively(), quiet_others(self._cand):
            got = time.monotonic()
            self._own["turn_wait"] = self._own.get("turn_wait", 0.0) + got - asked
            try:
                yield
            finally:
                held = time.monotonic() - got
                self._own["turn_held"] = self._own.get("turn_held", 0.0) + held

    @property
    def ref(self) -> RunnerHandle:
        """The reference runner (set by :meth:`reference_lease` or :meth:`use`)."""
        if self._ref is None:
            raise RuntimeError("the stage has leased no reference runner yet")
        return self._ref

    @property
    def cand(self) -> RunnerHandle:
        """The candidate runner (set by :meth:`candidate_lease` or :meth:`use`)."""
        if self._cand is None:
            raise RuntimeError("the stage has leased no candidate runner yet")
        return self._cand

    def candidate_quiet(self) -> AbstractContextManager[None]:
        """The candidate runner's box held quiet inside the block, for a timing of the
        reference runner (:meth:`RunnerHandle.quiet`; a request that times quiets every
        candidate but its own runner anyway: held here, stopping it is not in the wall
        clock around that request)."""
        return self._cand.quieted() if self._cand is not None else contextlib.nullcontext()

    def restart_clock(self) -> None:
        """A fresh deadline (after work with a time limit of its own)."""
        self.deadline = Deadline(self.deadline.timeout_s)

    def use(self, *, ref: RunnerHandle | None = None, cand: RunnerHandle | None = None) -> None:
        """Grade with these runners from now on."""
        for handle in (ref, cand):
            if handle is not None:
                self.leased.append(handle)
        self._ref = ref or self._ref
        self._cand = cand or self._cand

    @contextlib.contextmanager
    def reference_lease(
        self,
        *,
        trimmed: bool = False,
        prefer: Callable[[RunnerHandle], bool] | None = None,
        wait_s: float = 0.0,
        only_preferred: bool = False,
    ) -> Iterator[RunnerHandle]:
        """The task's (reused) reference runner for this stage; ``trimmed``: it drops
        its large tensors before going back idle; ``prefer``: which idle one to take
        first, ``wait_s`` how long to wait for a preferred one leased elsewhere, and
        ``only_preferred``: a fresh one rather than another (:meth:`RunnerPool.reference_lease`)."""
        pool = self.session.runners
        key = self.session.reference_key
        with pool.reference_lease(key, prefer, wait_s, only_preferred) as ref:
            self.use(ref=ref)
            try:
                yield ref
            except CandidateFailed as exc:
                self.after_candidate_failure(exc)
                raise
            except RunnerError as exc:
                self._after_runner_error(ref, exc)
                raise
            finally:
                if trimmed:
                    trim_reference(ref)

    def _after_runner_error(self, ref: RunnerHandle, exc: RunnerError) -> None:
        """Another runner of the stage failed while ``ref`` was leased (the pool drops
        ``ref`` for its own failures): on a GPU that runner may have mapped ``ref``'s
        tensors and left them pinned, unless it failed before it ever started."""
        other = next((h for h in self.leased if h.pid == exc.runner_pid), None)
        if exc.runner_pid == ref.pid or (other is not None and not other.ready):
            return
        if self.device.startswith("cuda"):
            ref.discard = True

    @contextlib.contextmanager
    def candidate_lease(self) -> Iterator[RunnerHandle]:
        """A runner for the candidate: the one this candidate's previous stage kept
        (:attr:`GradingSession.candidate_key`), else a fresh one; killed when the block
        ends unless the stage called :meth:`keep_candidate`."""
        with self.session.runners.lease(self.session.kept_key) as cand:
            self.use(cand=cand)
            yield cand

    def keep_candidate(self) -> None:
        """Keep the candidate runner for the candidate's next stage, when the session has
        a candidate key and the stage's runners held no more device memory than a big
        task (``$KF_BIG_TASK_MB``: a kept runner keeps what it holds)."""
        key = self.session.kept_key
        if key is None or self._cand is None:
            return
        peak = self.peak_device_mb()
        if self.session.grader.over_big_task(peak):
            log.info("candidate_runner_not_kept", peak_device_mb=peak, why="over $KF_BIG_TASK_MB")
            return
        self._cand.keep_as = key

    def after_candidate_failure(self, exc: CandidateFailed) -> None:
        """A GPU candidate runner that crashed or hung may hold IPC mappings of the
        reference's tensors, which then stay pinned: that reference is not reused."""
        discard_reference_if_pinned(self.ref, exc, self.device)

    def phases(self) -> dict[str, float]:
        """Seconds per request op of the stage's runners so far; ``kept_runner_wait``:
        how long the candidate runner, kept from the candidate's previous stage, waited
        for this one (absent: a fresh runner); ``turn_wait`` and ``turn_held``: the
        timing turn's (:meth:`alone`)."""
        phases = stage_phases(self.since, *self.leased)
        if self._cand is not None and self._cand.kept_s:
            phases["kept_runner_wait"] = round(self._cand.kept_s, 4)
        phases.update({k: round(v, 4) for k, v in self._own.items()})
        return phases

    def peak_device_mb(self) -> float | None:
        """The most device memory the stage's runners held at once so far (MB; None off a
        GPU): :func:`kf.evaluation.grader.grading.stage_peak_device_mb`."""
        return stage_peak_device_mb(self.since, *self.leased)

    def sandboxed(self, report: AnyReport) -> AnyReport:
        """``report`` saying where the stage's runners ran."""
        return with_sandbox_marks(report, self.leased)

    # -- requests ------------------------------------------------------------------
    def reference(self, request: Request[_R], what: str | None = None) -> _R:
        """A request to the reference runner; any failure there is the task's fault."""
        task = self.task
        try:
            return self.ref.request(request, self.deadline.left(), what=what)
        except RunnerFailed as exc:
            raise TaskError(f"{task.label}: {exc}") from exc
        except RunnerTimeout as exc:
            raise TaskError(f"{task.label}: the reference timed out ({exc})") from exc
        except RunnerCrashed as exc:
            raise TaskError(
                f"{task.label}: the reference crashed ({exc}); log: {exc.log_tail[-500:]}"
            ) from exc

    def candidate(self, request: Request[_R], what: str | None = None) -> _R:
        """A request to the candidate runner; failures become :class:`CandidateFailed`.

        The builds the runner asks of the grader meanwhile (an import-time ``load_inline``
        or ``kf.native`` build) have the build limit: their time extends the stage's."""
        built = self.cand.build_s
        try:
            return self.cand.request(request, self.deadline.left(), what=what)
        except RunnerFailed as exc:
            if exc.kind == "task_error":
                raise TaskError(f"{self.task.label}: {exc}") from exc
            kind = exc.kind if exc.kind in FAILURE_KINDS else "exception"
            raise CandidateFailed(kind, str(exc), exc.log_tail) from exc
        except RunnerTimeout as exc:
            raise CandidateFailed(
                "timeout",
                f"candidate timed out after {self.deadline.timeout_s:g}s ({exc})",
                exc.log_tail,
            ) from exc
        except RunnerCrashed as exc:
            raise CandidateFailed("crash", f"candidate crashed: {exc}", exc.log_tail) from exc
        finally:
            self.deadline.end += self.cand.build_s - built

    def setup_reference(self) -> SetUp:
        """Set the reference runner up (its answer: ``precision``, its TF32 settings)."""
        s = self.session
        return self.reference(
            setup_request(
                self.ref, s.device, s.limits, self.deadline, s.cond, s.grader, reference=True
            )
        )

    def setup_candidate(self, nice: int = 0) -> SetUp:
        """Set the candidate runner up (a failure here is the runner's, not the candidate's).

        A runner that may be kept for the candidate's later stages (verify, profile) has
        their CPU seconds in its hard limit from the start: a hard limit is never raised
        again, and each stage sets its soft one."""
        s = self.session
        later = 0
        if s.kept_key is not None:
            later = 2 * (s.limits.cpu_s or int(s.timeout_s * self.cand.threads) + 30)
        request = setup_request(
            self.cand, s.device, s.limits, self.deadline, s.cond, s.grader, nice=nice,
            cpu_later_s=later,
        )  # fmt: skip
        return self.cand.request(request, self.deadline.left())

    def load_task(self, seed: int | None = None) -> TaskLoaded:
        """Load the task in the reference runner, seeded with ``seed`` (None: the session's)."""
        task = self.task
        seed = self.session.seed if seed is None else seed
        tests = [(t.name, t.source) for t in task.tests]
        return self.reference(LoadTask(source=task.source, name=task.name, seed=seed, tests=tests))

    @property
    def own_inputs(self) -> bool:
        """Whether the candidate runner makes each trial's inputs from its seed itself."""
        return makes_own_inputs(self.cand, self.device, self.session.grader)

    def load_pair(self) -> SetUp:
        """Set both runners up, load the task in the reference and ``ModelNew`` in the
        candidate; the reference runner's answer to its set-up.

        The reference's ``init`` (the constructor arguments, made after seeding) goes to
        the candidate so both modules are built from the same inputs and parameters.
        """
        s = self.session
        setup = self.setup_reference()
        self.setup_candidate()
        init = self.load_task().init
        self.candidate(
            LoadCandidate(
                source=s.source,
                seed=s.seed,
                init=init,
                task_source=s.task.source,
                task_name=s.task.name,
            ),
            what="construction of ModelNew",
        )
        return setup

    def make_inputs(self, seed: int, scale: float | None = None) -> InputsMade:
        """The reference's inputs for ``seed`` (times ``scale``), sent where the candidate
        runner does not make its own."""
        return self.reference(MakeInputs(seed=seed, scale=scale, send=not self.own_inputs))

    def run_request(
        self, made: InputsMade, seed: int, scale: float | None = None, *, trace: bool = False
    ) -> Run:
        """What a ``run`` request carries of a trial: its seed (and the hidden
        distribution's ``scale``), or the reference's inputs."""
        if self.own_inputs:
            return Run(seed=seed, scale=scale, trace=trace)
        return Run(inputs=made.inputs, trace=trace)

    def judge(self, ran: Ran, seed: int) -> Verdict:
        """The reference runner's verdict on what the candidate returned for ``seed``'s
        inputs, at the session's tolerance."""
        return self.reference(Check.of(ran, seed, self.session.tol)).verdict

    def run_and_check(self, run: Run, seed: int) -> tuple[str, str] | None:
        """Run the candidate once and have the reference judge it: None, or (kind, reason)."""
        ran = self.candidate(run, what="forward")
        verdict = self.judge(ran, seed)
        return None if verdict.ok else (str(verdict.kind), str(verdict.reason))

    def loaded_and_checked(self) -> tuple[InputsMade, SetUp, tuple[str, str] | None]:
        """:meth:`load_pair`, then one checked call on the session seed's inputs: (the
        inputs, the reference's set-up, the problem or None when the output was right).

        What profiling and the counters do before measuring: the inputs stay in the
        candidate runner.
        """
        setup = self.load_pair()
        seed = self.session.seed
        made = self.make_inputs(seed)
        problem = self.run_and_check(self.run_request(made, seed), seed)
        return made, setup, problem
