"""The MAP-Elites archive and parent selection: a pure decision agent hosted by the archivist.

State is a fold over the log. Every decision is *planned inside the fold*: when an event
changes what should happen next (a candidate finished, a run started), ``evolve`` computes
the decisions, applies their effect to the state at once (a reserved selection, an
admitted elite) and keeps them as the plan for that event; ``react`` only returns the
plan. So a batch of events can never over-commit the budget, and ``kf replay --check``
recomputes exactly the same decisions from the same prefix.

Behavioural cells come from the candidate's source (:func:`kf.kernels.behaviour.describe`):
(memory, compute, parallelism) levels 0..3, i.e. 64 cells per island per task.
Randomness: each selection draws from ``random.Random`` seeded by sha256 of the run seed,
the task and the selection number, so no choice depends on anything but the log.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from typing import Any

import msgspec

from agents import archive_tuning, lessons
from agents.tuned import TUNER_LABEL
from kf.agent import PlanningAgent
from kf.config import RunConfig
from kf.events import Event, Record
from kf.facts import (
    DeviceAnnounced,
    DeviceLeft,
    DeviceLost,
    ReactionFailed,
    RunFinished,
    RunStarted,
)
from kf.kernels.backends import backend_of, device_kind, language_of, languages_for
from kf.kernels.behaviour import describe
from kf.kernels.normal_form import digest as normal_digest
from kf.kernels.params import family as param_family
from kf.llm_facts import ConfigTuned, LlmBudgetExhausted, PromptChosen
from kf.reports import ProfileReport, is_suspect
from kf.search_facts import (
    CandidateAssigned,
    CandidateCompiled,
    CandidateConfirmed,
    CandidateDuplicate,
    CandidateProfiled,
    CandidateProposed,
    CandidateRejected,
    CandidateUnroutable,
    CandidateVerified,
    ConfirmationRequested,
    EliteAdmitted,
    GeneralisationFailed,
    LessonsLoaded,
    MutationFailed,
    ParentSelected,
    TaskSkipped,
    TuningRequested,
)

__all__ = ["ArchiveAgent", "ArchiveState", "Cand", "SearchConfig", "TaskArchive", "cell_key"]

CELLS_PER_ISLAND = 4 * 4 * 4


class SearchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The archive's part of the run's config (:class:`kf.config.RunConfig`)."""

    budget: int = 20
    islands: int = 2
    max_in_flight: int = 2
    crossover_rate: float = 0.3
    migrate_every: int = 8
    llm: bool = False
    max_attempts: int = 3  # assignments of one candidate before it fails as lost
    # 2: first generations written by the LLM, backends derived here, unroutable
    # candidates failed with a reason, LLM look-ahead. Logs without the key are version 1
    # and replay as they were decided.
    search_version: int = 1
    device: str = "cpu"
    init: int = 0  # first-generation candidates an LLM writes per task (and per retry round)
    init_with_seeds: bool = False  # also for tasks that have seeds
    languages: list[str] = []  # languages asked for ([]: every language the device runs)
    llm_lookahead: int = 0  # selections beyond max_in_flight while the model answers
    # 3: a task's best kernel is tuned per shape set and device once its search budget is
    # spent, and the tuners' best configurations become candidates (agents/archive_tuning.py)
    # 4: every elite of the task is tuned, best first, within its tune_budget per device
    tune_budget: int = 0  # configurations per task and device (0: no tuning)
    # 5: a candidate whose source is an earlier one's up to comments and spacing (same
    # configuration, shape set and device) is a duplicate: recorded, never run again
    # 6: a child that beats its parent beyond the noise, or fails where it passed, is a
    # lesson (agents/lessons.py)
    # 7: a selection whose prompt quotes lessons has a control arm (the same, without
    # them), waited for like a selection; the two are compared and lessons verified or
    # retired by the comparisons (agents/lessons.py)
    # Issue 34: a result from a device not in this list that would enter the archive (an
    # elite, or a speed-up above confirm_above) is measured again on another device first
    # (ConfirmationRequested / CandidateConfirmed). None (logs without the key, or
    # KF_TRUSTED_DEVICES=*): every device's word is taken, as before.
    confirm_trusted: list[str] | None = None
    confirm_above: float = 10.0

    @classmethod
    def of(cls, config: RunConfig) -> SearchConfig:
        """The archive's part of ``config``."""
        s, llm, trusted = config.search, config.llm, config.trust.confirm_trusted
        return cls(
            budget=s.budget,
            islands=s.islands,
            max_in_flight=s.max_in_flight,
            crossover_rate=s.crossover_rate,
            migrate_every=s.migrate_every,
            llm=llm.llm,
            max_attempts=s.max_attempts,
            search_version=s.search_version,
            device=config.evaluation.device,
            init=llm.init,
            init_with_seeds=llm.init_with_seeds,
            languages=list(llm.languages),
            llm_lookahead=llm.llm_lookahead,
            tune_budget=config.tuning.tune_budget,
            confirm_trusted=list(trusted) if trusted is not None else None,
            confirm_above=config.trust.confirm_above,
        )


class Cand(msgspec.Struct, kw_only=True):
    """One candidate as the archive knows it."""

    id: str
    task: str
    island: int
    operator: str
    mutator: str
    family: str
    config: dict[str, Any] = {}
    parent_id: str | None = None
    selection: int | None = None
    status: str = "proposed"  # compiled | correct | profiled | failed | duplicate
    failure: str | None = None
    error: str | None = None
    speedup: float | None = None
    runtime_ms: float | None = None
    runtime_std_ms: float | None = None
    ref_ms: float | None = None
    cell: tuple[int, int, int] | None = None
    source: str = ""
    flags: list[str] = []  # the profile's flags ("code: detail")
    suspect: bool = False  # a flag makes its timing untrustworthy: never an elite or best
    generalisation: str | None = None  # why it failed on unseen shapes, if it did
    backend: str = "cpp-openmp"
    target: str = "cpu"
    device_id: str | None = None  # current assignment
    attempt: int = 0
    shape_index: int = 0  # a tuned candidate's shape set (>0: never an elite or best)
    tuned_on: str = ""  # a tuned candidate runs on the device it was tuned on
    # a result awaiting another device's measurement (ConfirmationRequested): who claimed
    # what; the candidate runs its stages again, on a device other than claimed_by
    confirming: bool = False
    claimed_by: str | None = None
    claimed_speedup: float | None = None

    @property
    def in_flight(self) -> bool:
        """Not yet finished (profiled or failed)."""
        return self.status not in ("profiled", "failed", "duplicate")


def cell_key(island: int, cell: Sequence[int]) -> str:
    """``"island:m.c.p"`` — the archive's map key for a cell on an island."""
    return f"{island}:{cell[0]}.{cell[1]}.{cell[2]}"


class DeviceSlot(msgspec.Struct, kw_only=True):
    """A device as announced: its kind, its backends and whether it is live."""

    kind: str
    backends: tuple[str, ...] = ()
    live: bool = True


def budget_of(t: TaskArchive, cfg: SearchConfig) -> int:
    """The task's search budget: its package's, else the run's."""
    return t.budget if t.budget is not None else cfg.budget


class TaskArchive(msgspec.Struct, kw_only=True):
    """Per-task search progress and its MAP-Elites grid."""

    name: str
    seeds: int = 0
    reference: str = ""  # the task's source (search version 6: a lesson's task features)
    #: the task's own budget and languages (a task package's kf.toml; None: the run's)
    budget: int | None = None
    languages: list[str] | None = None
    selections: int = 0  # issued (each uses one unit of budget)
    proposed: int = 0
    compiled: int = 0
    correct: int = 0
    profiled: int = 0
    failed: int = 0
    duplicates: int = 0  # proposed candidates found the same as an earlier one, never run
    pending: list[int] = []  # selections not yet answered by a proposal or failure
    controls: list[int] = []  # search version 7: control arms not yet answered (issue 48)
    elites: dict[str, str] = {}  # cell_key → candidate id
    skipped: str | None = None
    exhausted: bool = False
    inits: int = 0  # first-generation (``init``) selections issued
    round_left: int = 0  # init selections left in the current retry round
    first_failures: list[str] = []  # failed seed/init candidates while none is correct


class ArchiveState(msgspec.Struct, kw_only=True):
    """Everything the archive decides from."""

    run_id: str = ""
    seed: int = 0
    config: SearchConfig = SearchConfig()
    started: bool = False
    finished: bool = False
    llm_stopped: str | None = None  # the LLM budget ran out: no more selections
    tasks: dict[str, TaskArchive] = {}
    candidates: dict[str, Cand] = {}
    event_candidate: dict[str, str] = {}  # candidate event id → candidate id
    devices: dict[str, DeviceSlot] = {}
    queue: list[str] = []  # in-flight candidates waiting for a device, in proposal order
    plan: tuple[str, list[Event]] = ("", [])  # decisions planned by the last folded event
    # "task|device" (version 3) or "task|device|candidate" (version 4) → request
    tuning: dict[str, archive_tuning.Tuning] = {}
    # search version 5: a candidate's normal-form key (:func:`dedup_key`) → the candidate
    # judged (or being judged) under it
    normal: dict[str, str] = {}
    # search version 7: controlled comparisons of lessons and their counts (issue 48)
    trust: lessons.Trust = msgspec.field(default_factory=lessons.Trust)

    def best(self, task: str) -> Cand | None:
        """The fastest profiled candidate of ``task`` (:func:`best_candidate`): the archive
        tuning reads it here, so that it need not import this module."""
        return best_candidate(self, task)

    def summary(self) -> str:
        """A few lines per task: progress, best kernel, filled cells."""
        lines = [f"run {self.run_id} seed {self.seed} finished={self.finished}"]
        for name, t in self.tasks.items():
            best = best_candidate(self, name)
            best_s = (
                f"best {best.speedup:.2f}× ({best.id[:12]})" if best and best.speedup else "no best"
            )
            lines.append(
                f"  {name}: proposed {t.proposed}, compiled {t.compiled}, correct {t.correct}, "
                f"failed {t.failed}, "
                + (f"duplicates {t.duplicates}, " if t.duplicates else "")
                + f"{len(t.elites)} elite cells, {best_s}"
                + (f", skipped: {t.skipped}" if t.skipped else "")
            )
        return "\n".join(lines)


class ArchiveAgent(PlanningAgent[ArchiveState]):
    """MAP-Elites over kernel behaviour, with islands, migration and seeded selection."""

    kind = "archive"
    decides = True
    listens = (
        RunStarted,
        CandidateProposed,
        MutationFailed,
        CandidateCompiled,
        CandidateVerified,
        CandidateRejected,
        CandidateProfiled,
        GeneralisationFailed,
        ReactionFailed,
        DeviceAnnounced,
        DeviceLeft,
        DeviceLost,
        CandidateAssigned,
        LlmBudgetExhausted,
        TuningRequested,
        ConfigTuned,
        PromptChosen,
        LessonsLoaded,
    )

    def initial_state(self) -> ArchiveState:
        return ArchiveState()

    # -- the fold -------------------------------------------------------------------------

    def fold(self, state: ArchiveState, rec: Record, plan: list[Event]) -> None:
        ev = rec.event
        about = state.candidates.get(getattr(ev, "candidate_id", ""))
        was_in_flight = about is not None and about.in_flight
        self._fold(state, rec, plan)
        if (
            state.config.search_version >= 6
            and about is not None
            and was_in_flight
            and about.status in ("profiled", "failed")
            and not _unjudged(about)
        ):
            lessons.learned(state, about, plan)
        if state.config.search_version >= 7 and state.trust.trials:
            lessons.settle(state, plan, _unjudged)
        if state.started and not state.finished:
            self._dispatch(state, plan)
            self._top_up(state, plan)

    def _fold(self, state: ArchiveState, rec: Record, plan: list[Event]) -> None:
        ev = rec.event
        if isinstance(ev, RunStarted):
            self._start(state, ev, plan)
        elif isinstance(ev, CandidateProposed):
            self._proposed(state, ev, rec.event_id, plan)
        elif isinstance(ev, MutationFailed) and ev.mutator == TUNER_LABEL:
            archive_tuning.proposed(state, ev.task, "", -1)
        elif isinstance(ev, MutationFailed):
            t = state.tasks.get(ev.task)
            if t is not None:
                _answered(t, ev.selection, ev.arm)
            if state.config.search_version >= 7:
                lessons.failed(state.trust, ev, state.llm_stopped is not None)
        elif isinstance(ev, (PromptChosen, LessonsLoaded)):
            self._lessons(state, ev)
        elif isinstance(ev, CandidateAssigned):
            # the effect was applied when it was planned; remember the id for failures
            state.event_candidate[rec.event_id] = ev.candidate_id
        elif isinstance(ev, DeviceAnnounced):
            backends = ev.capabilities.get("backends", ())
            state.devices[ev.device_id] = DeviceSlot(
                kind=ev.kind, backends=tuple(str(b) for b in backends or ())
            )
        elif isinstance(ev, (DeviceLeft, DeviceLost)):
            self._device_gone(state, ev.device_id)
        elif isinstance(ev, CandidateCompiled):
            c = self._current(state, ev, rec.event_id)
            if c is not None and c.status == "proposed":
                if ev.report.ok:
                    c.status = "compiled"
                    state.tasks[c.task].compiled += 0 if c.confirming else 1
                else:
                    self._fail(state, c, ev.report.failure_kind or "compile_error", ev.report.error)
        elif isinstance(ev, CandidateVerified):
            c = self._current(state, ev, rec.event_id)
            if c is not None and c.status == "compiled":
                c.status = "correct"
                state.tasks[c.task].correct += 0 if c.confirming else 1
        elif isinstance(ev, CandidateRejected):
            c = self._current(state, ev, rec.event_id)
            if c is not None and c.in_flight:
                self._fail(state, c, ev.report.failure_kind or "incorrect", ev.report.error)
        elif isinstance(ev, CandidateProfiled):
            c = self._current(state, ev, rec.event_id)
            if c is not None and c.status == "correct":
                if ev.report.ok and c.confirming:
                    self._confirmed(state, c, ev, plan)
                elif ev.report.ok and self._needs_confirmation(state, c, ev):
                    self._ask_confirmation(state, c, ev, plan)
                elif ev.report.ok:
                    self._profiled(state, c, ev.report, plan)
                else:
                    self._fail(
                        state, c, ev.report.failure_kind or "profile_failed", ev.report.error
                    )
        elif isinstance(ev, GeneralisationFailed):
            self._generalisation_failed(state, ev)
        elif isinstance(ev, (TuningRequested, ConfigTuned)):
            archive_tuning.fold(state, rec, plan)
        elif isinstance(ev, ReactionFailed) and archive_tuning.failed(state, rec):
            pass
        elif isinstance(ev, ReactionFailed):
            cid = state.event_candidate.get(rec.envelope.caused_by or "")
            c = state.candidates.get(cid or "")
            if c is not None and c.in_flight:
                self._fail(state, c, f"agent_error:{ev.kind}", ev.error)
        elif isinstance(ev, LlmBudgetExhausted) and state.llm_stopped is None:
            state.llm_stopped = ev.reason

    def _lessons(self, state: ArchiveState, ev: PromptChosen | LessonsLoaded) -> None:
        """Search version 7 (issue 48): a library's counts; a prompt quoting lessons opens
        a controlled comparison, and its control arm is waited for like a selection."""
        if state.config.search_version < 7:
            return
        if isinstance(ev, LessonsLoaded):
            lessons.loaded(state.trust, ev)
            return
        t = state.tasks.get(ev.task)
        if ev.arm == "control" and t is not None:
            t.controls.append(ev.selection)
        lessons.chosen(state.trust, ev)

    def _start(self, state: ArchiveState, ev: RunStarted, plan: list[Event]) -> None:
        if state.started:
            return
        state.started = True
        state.run_id = ev.run_id
        state.seed = ev.seed
        state.config = SearchConfig.of(ev.run_config())
        for spec in ev.tasks:
            t = TaskArchive(
                name=spec.name,
                reference=spec.source if state.config.search_version >= 6 else "",
                seeds=len(spec.seeds),
                budget=spec.settings.get("budget"),
                languages=spec.settings.get("languages"),
            )
            state.tasks[spec.name] = t
            if not spec.seeds and not state.config.llm:
                t.skipped = (
                    "no seed kernel and no LLM configured: the offline mutator can only tune "
                    "and recombine existing kernels (add seeds/<task>.py or pass --llm-url)"
                )
                plan.append(TaskSkipped(task=spec.name, reason=t.skipped))

    def _current(self, state: ArchiveState, ev: Any, event_id: str) -> Cand | None:
        """The candidate a stage event is about, if it answers the current assignment.

        Results from an earlier assignment (a device declared lost that later spoke up)
        are ignored, so each candidate's outcome is counted once.
        """
        c = state.candidates.get(ev.candidate_id)
        if c is None or ev.device_id != c.device_id or ev.attempt != c.attempt:
            return None
        state.event_candidate[event_id] = c.id
        return c

    # -- routing ----------------------------------------------------------------------------

    def _device_gone(self, state: ArchiveState, device_id: str) -> None:
        slot = state.devices.get(device_id)
        if slot is not None:
            slot.live = False
        archive_tuning.device_gone(state, device_id)
        orphans = [
            c.id for c in state.candidates.values() if c.in_flight and c.device_id == device_id
        ]
        for cid in orphans:
            c = state.candidates[cid]
            c.device_id = None
            if c.attempt >= state.config.max_attempts:
                self._fail(state, c, "device_lost", f"device lost {c.attempt} times")
            elif cid not in state.queue:
                state.queue.append(cid)
        order = {cid: i for i, cid in enumerate(state.candidates)}
        state.queue.sort(key=order.__getitem__)

    def _dispatch(self, state: ArchiveState, plan: list[Event]) -> None:
        """Assign waiting candidates to the least-loaded live device that can run them."""
        if not state.queue:
            return
        load: dict[str, int] = {d: 0 for d, s in state.devices.items() if s.live}
        for c in state.candidates.values():
            if c.in_flight and c.device_id in load:
                load[c.device_id] += 1
        waiting: list[str] = []
        for cid in state.queue:
            c = state.candidates[cid]
            if not c.in_flight:
                continue
            kind = c.target.partition(":")[0]
            fits = sorted(
                (n, d)
                for d, n in load.items()
                if state.devices[d].kind == kind
                and (not state.devices[d].backends or c.backend in state.devices[d].backends)
                and (not c.tuned_on or c.confirming or d == c.tuned_on)
                and not (c.confirming and d == c.claimed_by)
            )
            if not fits and c.confirming:
                trusted = state.config.confirm_trusted or []
                if any(d not in state.devices for d in trusted):
                    waiting.append(cid)  # the run's own device has not announced itself yet
                else:
                    self._unconfirmable(state, c, plan)
                continue
            if not fits:
                reason = (
                    f"the device it was tuned on ({c.tuned_on}) is not live"
                    if c.tuned_on
                    else self._unroutable(state, c)
                )
                if reason is None:
                    waiting.append(cid)
                    continue
                self._fail(state, c, "unroutable", reason)
                plan.append(
                    CandidateUnroutable(
                        candidate_id=c.id, task=c.task, backend=c.backend, reason=reason
                    )
                )
                continue
            device = fits[0][1]
            load[device] += 1
            c.device_id = device
            c.attempt += 1
            plan.append(
                CandidateAssigned(
                    candidate_id=c.id,
                    task=c.task,
                    device_id=device,
                    attempt=c.attempt,
                    backend=c.backend if state.config.search_version >= 2 else "",
                )
            )
        state.queue = waiting

    @staticmethod
    def _unroutable(state: ArchiveState, c: Cand) -> str | None:
        """Why no live device can ever take ``c`` (None: wait, no device is live yet)."""
        if state.config.search_version < 2:
            return None
        live = {d: s for d, s in state.devices.items() if s.live}
        if not live:
            return None
        kind = c.target.partition(":")[0]
        same = {d: s for d, s in live.items() if s.kind == kind}
        if not same:
            seen = ", ".join(f"{d} ({s.kind})" for d, s in sorted(live.items()))
            return f"no live device of kind {kind} (live: {seen})"
        served = sorted({b for s in same.values() for b in s.backends})
        return (
            f"no live {kind} device runs backend {c.backend} "
            f"(they run: {', '.join(served) or 'nothing announced'})"
        )

    def _proposed(
        self, state: ArchiveState, ev: CandidateProposed, event_id: str, plan: list[Event]
    ) -> None:
        t = state.tasks.get(ev.task)
        if t is None or ev.candidate_id in state.candidates:
            return
        state.candidates[ev.candidate_id] = Cand(
            id=ev.candidate_id,
            task=ev.task,
            island=ev.island % max(1, state.config.islands),
            operator=ev.operator,
            mutator=ev.mutator,
            family=ev.family or param_family(ev.source),
            config=dict(ev.config),
            parent_id=ev.parent_id,
            selection=ev.selection,
            source=ev.source,
            backend=(
                backend_of(ev.source, ev.device) if state.config.search_version >= 2 else ev.backend
            ),
            target=ev.device,
            shape_index=ev.shape_index,
            tuned_on=ev.tuned_on,
        )
        if ev.tuned_on:
            archive_tuning.proposed(state, ev.task, ev.tuned_on, ev.shape_index, ev.parent_id or "")
        state.event_candidate[event_id] = ev.candidate_id
        t.proposed += 1
        if ev.selection is not None:
            _answered(t, ev.selection, ev.arm)
        if state.config.search_version >= 7:
            lessons.proposed(state.trust, ev)
        if state.config.search_version >= 5 and self._duplicate(state, ev, plan):
            return
        state.queue.append(ev.candidate_id)

    def _duplicate(self, state: ArchiveState, ev: CandidateProposed, plan: list[Event]) -> bool:
        """Whether ``ev``'s candidate is an earlier one's over again (search version 5):
        then it is recorded as such, counted, and never queued. An earlier candidate that
        failed for want of a device (lost, unroutable, an agent's error) was never judged:
        the new one takes its place."""
        if ev.operator == "tune":
            return False
        key, digest = dedup_key(ev)
        first = state.candidates.get(state.normal.get(key, ""))
        if first is None or first.id == ev.candidate_id or _unjudged(first):
            state.normal[key] = ev.candidate_id
            return False
        c = state.candidates[ev.candidate_id]
        c.status, c.failure = "duplicate", f"duplicate of {first.id}"
        state.tasks[c.task].duplicates += 1
        plan.append(
            CandidateDuplicate(
                candidate_id=c.id,
                task=c.task,
                duplicate_of=first.id,
                digest=digest,
                duplicate_status=first.status,
            )
        )
        return True

    def _fail(self, state: ArchiveState, c: Cand, kind: str, error: str | None) -> None:
        c.status = "failed"
        c.failure = kind
        c.error = (error or "")[:2000]
        t = state.tasks[c.task]
        t.failed += 1
        if c.operator in ("seed", "init") and not t.elites:
            t.first_failures.append(c.id)
            del t.first_failures[:-3]

    def _profiled(self, state: ArchiveState, c: Cand, r: ProfileReport, plan: list[Event]) -> None:
        c.status = "profiled"
        c.speedup = r.speedup
        c.runtime_ms = r.runtime_ms
        c.runtime_std_ms = r.runtime_std_ms
        c.ref_ms = r.ref_runtime_ms
        c.cell = describe(c.source).cell()
        c.flags = list(r.flags)
        c.suspect = is_suspect(r.flags)
        t = state.tasks[c.task]
        t.profiled += 1
        if not c.suspect and c.shape_index == 0:  # a speed-up at another shape ranks nowhere
            self._admit(state, t, c, c.island, plan, migrated_from=None)

    # -- confirmation of untrusted results (issue 34) ---------------------------------------

    def _needs_confirmation(self, state: ArchiveState, c: Cand, ev: CandidateProfiled) -> bool:
        """Whether a result from ``ev.device_id`` must be measured again elsewhere first."""
        return self._confirmation_reason(state, c, ev) is not None

    def _confirmation_reason(
        self, state: ArchiveState, c: Cand, ev: CandidateProfiled
    ) -> str | None:
        """Why a result from ``ev.device_id`` must be measured again elsewhere first, or None:
        the run names the devices it trusts, this is not one, and the result would count: a
        speed-up above the bound, the best of its cell, or a tuned candidate at another shape
        set (it ranks nowhere in the archive, but ``kf export`` dispatches to it there, by its
        speed-up, so its correctness and speed are one device's word otherwise)."""
        trusted = state.config.confirm_trusted
        r = ev.report
        if trusted is None or ev.device_id in trusted or is_suspect(r.flags):
            return None
        if c.shape_index != 0:
            return f"a tuned candidate at shape set {c.shape_index}, which kf export runs there"
        bound = state.config.confirm_above
        if r.speedup > bound:
            return f"a speed-up of {r.speedup:.2f}x, above {bound:g}x"
        t = state.tasks[c.task]
        incumbent = state.candidates.get(
            t.elites.get(cell_key(c.island, describe(c.source).cell()), "")
        )
        if incumbent is None or (incumbent.speedup or 0.0) < r.speedup:
            return "it would be the best of its cell"
        return None

    def _ask_confirmation(
        self, state: ArchiveState, c: Cand, ev: CandidateProfiled, plan: list[Event]
    ) -> None:
        """Hold the result; the candidate runs its stages again on another device."""
        speedup = ev.report.speedup
        reason = self._confirmation_reason(state, c, ev)
        c.confirming, c.claimed_by, c.claimed_speedup = True, ev.device_id, speedup
        c.status, c.device_id = "proposed", None
        c.runtime_ms, c.ref_ms = ev.report.runtime_ms, ev.report.ref_runtime_ms  # as claimed
        state.queue.append(c.id)
        plan.append(
            ConfirmationRequested(
                task=c.task,
                candidate_id=c.id,
                claimed_by=ev.device_id,
                claimed_speedup=speedup,
                reason=f"{ev.device_id} is not a device this run trusts, and {reason}",
            )
        )

    def _confirmed(
        self, state: ArchiveState, c: Cand, ev: CandidateProfiled, plan: list[Event]
    ) -> None:
        """Another device measured the candidate: it enters by the lower speed-up (the
        claim never counts for more than the other device saw); a claim more than twice
        that measurement is recorded as not confirmed, and flagged."""
        claimed = c.claimed_speedup or 0.0
        measured = ev.report.speedup
        accepted = claimed <= 2.0 * measured
        c.confirming = False
        note = f"{c.claimed_by} claimed {claimed:.2f}x, {ev.device_id} measured {measured:.2f}x"
        report = ev.report
        if measured > claimed:
            report = msgspec.structs.replace(report, speedup=claimed)
        if not accepted:
            flag = f"claim_not_confirmed: {note}"
            report = msgspec.structs.replace(report, flags=(*report.flags, flag))
        plan.append(
            CandidateConfirmed(
                task=c.task,
                candidate_id=c.id,
                claimed_by=c.claimed_by or "",
                claimed_speedup=claimed,
                confirmed_by=ev.device_id,
                measured_speedup=measured,
                accepted=accepted,
                reason=note if accepted else f"not confirmed: {note}",
            )
        )
        self._profiled(state, c, report, plan)

    def _unconfirmable(self, state: ArchiveState, c: Cand, plan: list[Event]) -> None:
        """No live device but the claimant can measure it: its claim stays unconfirmed,
        recorded, never an elite or a best."""
        claimed = c.claimed_speedup or 0.0
        c.confirming = False
        c.status, c.speedup, c.cell = "profiled", claimed, describe(c.source).cell()
        c.flags = [f"unconfirmed: no live device but {c.claimed_by} could measure it"]
        c.suspect = True
        state.tasks[c.task].profiled += 1
        plan.append(
            CandidateConfirmed(
                task=c.task,
                candidate_id=c.id,
                claimed_by=c.claimed_by or "",
                claimed_speedup=claimed,
                confirmed_by="",
                accepted=False,
                reason=c.flags[0],
            )
        )

    def _generalisation_failed(self, state: ArchiveState, ev: GeneralisationFailed) -> None:
        """Record why; an elite that fails leaves every cell it holds (and the best list)."""
        c = state.candidates.get(ev.candidate_id)
        if c is None:
            return
        c.generalisation = ev.reason[:2000]
        t = state.tasks.get(c.task)
        if t is not None:
            for key in [k for k, cid in t.elites.items() if cid == c.id]:
                del t.elites[key]

    def _admit(
        self,
        state: ArchiveState,
        t: TaskArchive,
        c: Cand,
        island: int,
        plan: list[Event],
        migrated_from: int | None,
    ) -> None:
        assert c.cell is not None
        assert c.speedup is not None
        key = cell_key(island, c.cell)
        incumbent = state.candidates.get(t.elites.get(key, ""))
        if incumbent is not None and (incumbent.speedup or 0.0) >= c.speedup:
            return
        t.elites[key] = c.id
        plan.append(
            EliteAdmitted(
                task=t.name,
                candidate_id=c.id,
                island=island,
                cell=c.cell,
                speedup=c.speedup,
                replaced=incumbent.id if incumbent is not None else None,
                migrated_from=migrated_from,
            )
        )

    # -- selection --------------------------------------------------------------------------

    def _in_flight(self, state: ArchiveState, task: str | None = None) -> int:
        n = 0
        for t in state.tasks.values():
            if task is None or t.name == task:
                n += len(t.pending) + len(t.controls)
        for c in state.candidates.values():
            if c.in_flight and (task is None or c.task == task):
                n += 1
        return n

    def _used(self, t: TaskArchive) -> int:
        return t.seeds + t.selections

    def _drafting(self, state: ArchiveState) -> bool:
        """Whether an LLM writes first generations in this run (search version 2)."""
        cfg = state.config
        return cfg.llm and cfg.search_version >= 2 and cfg.init > 0

    def _languages(self, state: ArchiveState, t: TaskArchive | None = None) -> list[str] | None:
        """Languages to ask for that a live device runs (None: no device of the kind is
        live); for ``t``, only those its package asks for, where it asks."""
        cfg = state.config
        kind = device_kind(cfg.device)
        wanted = cfg.languages or languages_for(cfg.device)
        if t is not None and t.languages is not None:
            wanted = [lang for lang in wanted if lang in t.languages]
        live = [s for s in state.devices.values() if s.live and s.kind == kind]
        if not live:
            return None
        served = {lang for s in live for lang in languages_for(cfg.device, s.backends)}
        return [lang for lang in wanted if lang in served]

    def _next_kind(self, state: ArchiveState, t: TaskArchive) -> str | None:
        """What the task's next selection is: ``init``, ``mutate``, or None (wait)."""
        if not self._drafting(state):
            return "mutate" if t.elites else None
        first_gen = t.seeds == 0 or state.config.init_with_seeds
        wants_init = first_gen and t.inits < state.config.init
        if not wants_init and t.elites:
            return "mutate"
        # no correct kernel yet: a new round once everything of the task has finished
        if (
            not wants_init
            and t.round_left <= 0
            and (t.proposed < t.seeds or self._in_flight(state, t.name) > 0)
        ):
            return None
        return "init" if self._languages(state, t) else None

    def _top_up(self, state: ArchiveState, plan: list[Event]) -> None:
        cfg = state.config
        in_flight = self._in_flight(state)
        limit = cfg.max_in_flight + (cfg.llm_lookahead if cfg.llm else 0)
        while in_flight < limit:
            eligible = []
            for t in state.tasks.values():
                more = self._used(t) < budget_of(t, cfg)
                if t.skipped is None and more and state.llm_stopped is None:
                    kind = self._next_kind(state, t)
                    if kind is not None:
                        eligible.append((self._used(t), t.name, kind))
            if not eligible:
                break
            _, name, kind = min(eligible)
            if kind == "init":
                self._select_init(state, state.tasks[name], plan)
            else:
                self._select(state, state.tasks[name], plan)
            in_flight += 1
        if self._drafting(state):
            langs = self._languages(state)
            if langs == []:
                # a device of the kind is live, but it runs none of the languages asked for
                wanted = cfg.languages or languages_for(cfg.device)
                for t in state.tasks.values():
                    if t.skipped is None and not t.elites and t.inits == 0 and t.seeds == 0:
                        t.skipped = (
                            f"no live device runs any of the languages asked for "
                            f"({', '.join(wanted)})"
                        )
                        t.exhausted = True
                        plan.append(TaskSkipped(task=t.name, reason=t.skipped))
        # tasks that can never go on: no elite, nothing in flight, seeds all done (without
        # an LLM writing first generations; with one, a new round is asked for instead)
        for t in state.tasks.values():
            if (
                t.skipped is None
                and not self._drafting(state)
                and not t.elites
                and not t.exhausted
                and t.proposed >= t.seeds
                and self._in_flight(state, t.name) == 0
            ):
                t.exhausted = True
                t.skipped = "no correct candidate to start from: every seed failed"
                plan.append(TaskSkipped(task=t.name, reason=t.skipped))
        if state.config.search_version >= 3:
            in_flight += archive_tuning.request(state, plan)
        if (
            in_flight == 0
            and all(
                t.skipped is not None
                or self._used(t) >= budget_of(t, cfg)
                or state.llm_stopped is not None
                for t in state.tasks.values()
            )
            and all(t.proposed >= t.seeds or t.skipped for t in state.tasks.values())
        ):
            state.finished = True
            plan.append(RunFinished(reason=_finish_reason(state)))

    def _select_init(self, state: ArchiveState, t: TaskArchive, plan: list[Event]) -> None:
        """A first-generation selection: the model writes a kernel from the reference alone
        (a retry round also shows it the evidence of the failed first candidates)."""
        cfg = state.config
        langs = self._languages(state, t) or []
        n = t.selections
        rng = _selection_rng(state.seed, t.name, n)
        first_gen = (t.seeds == 0 or cfg.init_with_seeds) and t.inits < cfg.init
        if not first_gen:
            if t.round_left <= 0:  # a new retry round
                t.round_left = cfg.init
            t.round_left -= 1
        # languages in turn, from a seeded starting point, so a generation covers them all
        offset = _selection_rng(state.seed, t.name, "language").randrange(len(langs))
        language = langs[(t.inits + offset) % len(langs)]
        t.inits += 1
        t.selections += 1
        t.pending.append(n)
        plan.append(
            ParentSelected(
                task=t.name,
                selection=n,
                island=n % max(1, cfg.islands),
                operator="init",
                parent_id="",
                rng_seed=rng.getrandbits(32),
                language=language,
                evidence=() if first_gen else tuple(t.first_failures),
            )
        )

    def _select(self, state: ArchiveState, t: TaskArchive, plan: list[Event]) -> None:
        cfg = state.config
        n = t.selections
        rng = _selection_rng(state.seed, t.name, n)
        island = n % max(1, cfg.islands)
        if cfg.islands > 1 and cfg.migrate_every > 0 and n > 0 and n % cfg.migrate_every == 0:
            self._migrate(state, t, plan)
        pool = self._pool(state, t, island)
        parent = self._tournament(rng, pool)
        operator, second = "mutate", None
        mates = [c for c in pool if c.family == parent.family and c.id != parent.id]
        if mates and rng.random() < cfg.crossover_rate:
            operator, second = "crossover", rng.choice(mates).id
        t.selections += 1
        t.pending.append(n)
        plan.append(
            ParentSelected(
                task=t.name,
                selection=n,
                island=island,
                operator=operator,
                parent_id=parent.id,
                second_parent_id=second,
                rng_seed=rng.getrandbits(32),
                language=language_of(parent.backend) if cfg.search_version >= 2 else "",
            )
        )

    def _pool(self, state: ArchiveState, t: TaskArchive, island: int) -> list[Cand]:
        prefix = f"{island}:"
        ids = [cid for key, cid in sorted(t.elites.items()) if key.startswith(prefix)]
        if not ids:
            ids = [cid for _, cid in sorted(t.elites.items())]
        seen: set[str] = set()
        pool: list[Cand] = []
        for cid in ids:
            if cid not in seen:
                seen.add(cid)
                pool.append(state.candidates[cid])
        return pool

    @staticmethod
    def _tournament(rng: random.Random, pool: list[Cand]) -> Cand:
        a, b = rng.choice(pool), rng.choice(pool)
        return a if (a.speedup or 0.0) >= (b.speedup or 0.0) else b

    def _migrate(self, state: ArchiveState, t: TaskArchive, plan: list[Event]) -> None:
        cfg = state.config
        for src in range(cfg.islands):
            members = [
                state.candidates[cid]
                for key, cid in sorted(t.elites.items())
                if key.startswith(f"{src}:")
            ]
            if not members:
                continue
            best = max(members, key=lambda c: (c.speedup or 0.0, c.id))
            self._admit(state, t, best, (src + 1) % cfg.islands, plan, migrated_from=src)


def dedup_key(ev: CandidateProposed) -> tuple[str, str]:
    """The key two candidates of a task share when they compile to the same code and run
    the same way (task, device, shape set, configuration, normal-form digest), and the
    digest."""
    digest = normal_digest(ev.source)
    config = json.dumps(ev.config, sort_keys=True, default=str)
    return f"{ev.task}|{ev.device}|{ev.shape_index}|{ev.tuned_on}|{config}|{digest}", digest


def _answered(t: TaskArchive, selection: int, arm: str) -> None:
    """A selection (or, for ``arm == "control"``, its control arm) was answered."""
    waiting = t.controls if arm == "control" else t.pending
    if selection in waiting:
        waiting.remove(selection)


def _unjudged(c: Cand) -> bool:
    """A candidate that failed before any stage could judge its code."""
    failure = c.failure or ""
    return c.status == "failed" and (
        failure in ("device_lost", "unroutable") or failure.startswith("agent_error")
    )


def _selection_rng(seed: int, task: str, n: object) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{task}:{n}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _finish_reason(state: ArchiveState) -> str:
    parts = []
    for t in state.tasks.values():
        parts.append(f"{t.name}: {t.skipped}" if t.skipped else f"{t.name}: budget spent")
    if state.llm_stopped is not None:
        parts.insert(0, f"stopped early: {state.llm_stopped}")
    return "; ".join(parts)


def best_candidate(state: ArchiveState, task: str) -> Cand | None:
    """The fastest profiled candidate of a task (ties: the earlier id order)."""
    best: Cand | None = None
    for c in state.candidates.values():
        if (
            c.task == task
            and c.shape_index == 0
            and c.status == "profiled"
            and c.speedup is not None
            and not c.suspect
            and c.generalisation is None
            and (best is None or c.speedup > (best.speedup or 0.0))
        ):
            best = c
    return best


def geomean(values: Sequence[float]) -> float | None:
    """Geometric mean of positive values (None when empty)."""
    vals = [v for v in values if v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))
