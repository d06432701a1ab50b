"""The prompt evolver: a population of meta-prompts, co-evolved with the kernels.

A pure decision agent hosted by the archivist (the archive's plan-in-evolve pattern: the
fold computes the decisions and applies their effect at once; ``react`` returns the plan).

- On ``RunStarted`` (with an LLM configured) it seeds the built-in meta-prompt ``p0``.
- For each ``ParentSelected`` it decides which prompt and which model of the ensemble
  answer it (``PromptChosen``), seeded by sha256 of the run seed, the task and the
  selection number: a prompt never tried goes first; otherwise, with probability
  ``prompt_explore`` a uniformly drawn prompt, else the fittest. The model is drawn by
  weight from the same generator. With ``mutator_weights`` in the run config it also
  draws, from a generator of its own, which mutator answers (``agent``: the single-shot
  call, a tool-using episode or the coding-agent CLI).
- A prompt's fitness is the mean score of the kernels written with it (speedup when
  profiled correct, 0 when failed), with one pseudo-observation of ``PRIOR``.
- Every ``prompt_evolve_every`` finished kernels it asks for one region of a prompt (the
  better of two drawn) to be rewritten by a model (``PromptRewriteRequested``), until the
  population holds ``max_prompts`` prompts or the LLM budget is spent. The rewrite itself
  is an observation (``PromptRewritten``) made by the LLM mutator.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import msgspec

from kf.agent import PlanningAgent
from kf.config import RunConfig
from kf.events import Event, Record
from kf.facts import RunStarted
from kf.llm.lessons import retrieve, task_features
from kf.llm.prompts import EVOLVABLE_REGIONS, REWRITE_OPERATORS, SEED_REGIONS
from kf.llm_facts import (
    LlmBudgetExhausted,
    PromptChosen,
    PromptRewriteFailed,
    PromptRewriteRequested,
    PromptRewritten,
    PromptSeeded,
)
from kf.search_facts import (
    CandidateCompiled,
    CandidateDuplicate,
    CandidateProfiled,
    CandidateProposed,
    CandidateRejected,
    CandidateUnroutable,
    Lesson,
    LessonRetired,
    LessonsLoaded,
    LessonVerified,
    MutationFailed,
    ParentSelected,
)

__all__ = ["PRIOR", "EvolverConfig", "EvolverState", "PromptEvolver", "PromptStats"]

PRIOR = 0.5  # the score of one imagined kernel every prompt starts with


class EvolverConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings read from ``RunStarted.config``."""

    llm: bool = False
    llm_models: list[tuple[str, float]] = []
    prompt_evolve_every: int = 2
    max_prompts: int = 6
    prompt_explore: float = 0.25
    # which mutator answers a selection, by weight: "single" (one LLM call), "tools" (a
    # tool-using episode), "cli" (the --agent-cmd agent); empty: single-shot only
    mutator_weights: list[tuple[str, float]] = []

    @classmethod
    def of(cls, config: RunConfig) -> EvolverConfig:
        """The prompt evolver's part of a run's config."""
        llm = config.llm
        return cls(
            llm=llm.llm,
            llm_models=list(llm.llm_models),
            prompt_evolve_every=llm.prompt_evolve_every,
            max_prompts=llm.max_prompts,
            prompt_explore=llm.prompt_explore,
            mutator_weights=list(config.agents.mutator_weights),
        )


class PromptStats(msgspec.Struct, kw_only=True):
    """One meta-prompt and how its kernels fared."""

    id: str
    regions: dict[str, str]
    parent: str | None = None
    operator: str = "seed"
    region: str = ""
    chosen: int = 0
    finished: int = 0
    score_sum: float = 0.0
    best: float = 0.0

    @property
    def fitness(self) -> float:
        """Mean score with one pseudo-observation of :data:`PRIOR`."""
        return (self.score_sum + PRIOR) / (self.finished + 1)


class EvolverState(msgspec.Struct, kw_only=True):
    """The prompt population and which prompt each selection and candidate used."""

    seed: int = 0
    config: EvolverConfig = EvolverConfig()
    active: bool = False
    prompts: dict[str, PromptStats] = {}
    selection_prompt: dict[str, str] = {}  # "task:selection" → prompt id
    candidate_prompt: dict[str, str] = {}  # in-flight candidate id → prompt id
    finished: int = 0
    requests: int = 0
    open_requests: list[int] = []
    budget_spent: bool = False
    plan: tuple[str, list[Event]] = ("", [])
    # issue 48: the lessons the run loaded, the tasks' references and device, and each
    # candidate's diagnosis (ok | a failure class), from which a prompt's lessons are chosen
    lessons: list[Lesson] = []
    references: dict[str, str] = {}
    device: str = ""
    diagnosis: dict[str, str] = {}
    # search version 7: prompts of a task that quoted lessons so far (the turn of the
    # retrieval's schedule); each such selection is answered twice, with and without them
    version: int = 1
    turns: dict[str, int] = {}

    def summary(self) -> str:
        """One line per prompt: lineage, use and fitness."""
        lines = [f"{len(self.prompts)} prompts, {self.requests} rewrites requested"]
        for p in self.prompts.values():
            lines.append(
                f"  {p.id}: {p.operator} {p.region or ''} of {p.parent or '-'}; chosen {p.chosen}, "
                f"finished {p.finished}, fitness {p.fitness:.3f}, best {p.best:.3f}"
            )
        return "\n".join(lines)


def _lessons(state: EvolverState, ev: ParentSelected) -> tuple[str, ...]:
    """The lessons a selection's prompt quotes (issue 48): chosen from those the run
    loaded by the task's features and the parent's diagnosis, within a token budget."""
    if not state.lessons:
        return ()
    controlled = state.version >= 7
    chosen = retrieve(
        state.lessons,
        task=ev.task,
        features=task_features(state.references.get(ev.task, ""), ev.language),
        diagnosis=state.diagnosis.get(ev.parent_id, ""),
        device=state.device,
        turn=state.turns.get(ev.task, 0) if controlled else None,
    )
    if controlled and chosen:
        state.turns[ev.task] = state.turns.get(ev.task, 0) + 1
    return chosen


def _judged(state: EvolverState, ev: LessonVerified | LessonRetired) -> None:
    """A lesson the archive verified or retired: later prompts see it so."""
    status = "verified" if isinstance(ev, LessonVerified) else "retired"
    state.lessons = [
        msgspec.structs.replace(x, status=status) if x.lesson_id == ev.lesson_id else x
        for x in state.lessons
    ]


def _selection_key(ev: ParentSelected | CandidateProposed | MutationFailed) -> str:
    """How a selection's prompt is found again: ``task:selection``, and ``:control`` for
    the control arm of a controlled comparison (issue 48)."""
    arm = getattr(ev, "arm", "")
    return f"{ev.task}:{ev.selection}" + (":control" if arm == "control" else "")


def _rng(*parts: object) -> random.Random:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _pick_model(rng: random.Random, models: Sequence[tuple[str, float]]) -> str:
    usable = [(m, w) for m, w in models if w > 0]
    if not usable:
        return "default"
    total = sum(w for _, w in usable)
    x = rng.random() * total
    for name, weight in usable:
        x -= weight
        if x < 0:
            return name
    return usable[-1][0]


class PromptEvolver(PlanningAgent[EvolverState]):
    """Chooses a meta-prompt and a model per selection; asks for prompt rewrites."""

    kind = "prompt_evolver"
    decides = True
    listens = (
        RunStarted,
        ParentSelected,
        CandidateProposed,
        MutationFailed,
        CandidateCompiled,
        CandidateRejected,
        CandidateProfiled,
        CandidateUnroutable,
        CandidateDuplicate,
        PromptRewritten,
        PromptRewriteFailed,
        LlmBudgetExhausted,
        LessonsLoaded,
        LessonVerified,
        LessonRetired,
    )

    def initial_state(self) -> EvolverState:
        return EvolverState()

    def fold(self, state: EvolverState, rec: Record, plan: list[Event]) -> None:
        ev = rec.event
        if isinstance(ev, RunStarted):
            if not state.active and not state.prompts:
                state.seed = ev.seed
                config = ev.run_config()
                state.config = EvolverConfig.of(config)
                state.active = state.config.llm
                state.references = {t.name: t.source for t in ev.tasks}
                state.device = config.evaluation.device
                state.version = config.search.search_version
                if state.active:
                    regions = dict(sorted(SEED_REGIONS.items()))
                    state.prompts["p0"] = PromptStats(id="p0", regions=regions)
                    plan.append(PromptSeeded(prompt_id="p0", regions=regions))
        elif not state.active:
            pass
        elif isinstance(ev, LessonsLoaded):
            state.lessons = list(ev.lessons)
        elif isinstance(ev, (LessonVerified, LessonRetired)):
            _judged(state, ev)
        elif isinstance(ev, ParentSelected):
            chosen = self._choose(state, ev)
            plan.append(chosen)
            if chosen.arm == "lessons":  # the control arm: the same, without the lessons
                plan.append(msgspec.structs.replace(chosen, lessons=(), arm="control"))
                state.selection_prompt[f"{ev.task}:{ev.selection}:control"] = chosen.prompt_id
        elif isinstance(ev, CandidateProposed):
            pid = state.selection_prompt.pop(_selection_key(ev), None)
            if pid is not None and ev.selection is not None:
                state.candidate_prompt[ev.candidate_id] = pid
        elif isinstance(ev, MutationFailed):
            pid = state.selection_prompt.pop(_selection_key(ev), None)
            if pid is not None:
                self._finish(state, pid, 0.0, ev.task, plan)
        elif isinstance(ev, (CandidateUnroutable, CandidateDuplicate)):
            pid = state.candidate_prompt.pop(ev.candidate_id, None)
            if pid is not None:
                self._finish(state, pid, 0.0, ev.task, plan)
        elif isinstance(ev, (CandidateCompiled, CandidateRejected, CandidateProfiled)):
            ok = ev.report.ok if isinstance(ev, (CandidateCompiled, CandidateProfiled)) else False
            if state.lessons and not (isinstance(ev, CandidateCompiled) and ok):
                state.diagnosis[ev.candidate_id] = (
                    "ok" if ok else ev.report.failure_kind or "failed"
                )
            if isinstance(ev, CandidateCompiled) and ok:
                return
            pid = state.candidate_prompt.pop(ev.candidate_id, None)
            if pid is not None:
                score = ev.report.speedup if isinstance(ev, CandidateProfiled) and ok else 0.0
                self._finish(state, pid, score, ev.task, plan)
        elif isinstance(ev, PromptRewritten):
            if ev.request in state.open_requests:
                state.open_requests.remove(ev.request)
                state.prompts[ev.prompt_id] = PromptStats(
                    id=ev.prompt_id,
                    regions=dict(sorted(ev.regions.items())),
                    parent=ev.parent_prompt_id,
                    operator=ev.operator,
                    region=ev.region,
                )
        elif isinstance(ev, PromptRewriteFailed):
            if ev.request in state.open_requests:
                state.open_requests.remove(ev.request)
        elif isinstance(ev, LlmBudgetExhausted):
            state.budget_spent = True

    def _choose(self, state: EvolverState, ev: ParentSelected) -> PromptChosen:
        cfg = state.config
        rng = _rng(state.seed, "prompt", ev.task, ev.selection)
        prompts = list(state.prompts.values())
        untried = [p for p in prompts if p.chosen == 0]
        explore = rng.random() < cfg.prompt_explore
        if untried:
            chosen = untried[0]
        elif explore:
            chosen = rng.choice(prompts)
        else:
            chosen = max(prompts, key=lambda p: (p.fitness, -prompts.index(p)))
        chosen.chosen += 1
        model = _pick_model(rng, cfg.llm_models)
        agent = ""
        if cfg.mutator_weights:
            # its own generator, so runs without mutator_weights decide as they always did
            picked = _pick_model(
                _rng(state.seed, "agent", ev.task, ev.selection), cfg.mutator_weights
            )
            agent = "" if picked in ("single", "default") else picked
        state.selection_prompt[f"{ev.task}:{ev.selection}"] = chosen.id
        # the selection, every field of it, passed on with the prompt and model chosen for it
        selection = msgspec.structs.asdict(ev)
        lessons = _lessons(state, ev)
        arm = "lessons" if lessons and state.version >= 7 else ""
        return PromptChosen(
            **selection, prompt_id=chosen.id, model=model, agent=agent, lessons=lessons, arm=arm
        )

    def _finish(
        self, state: EvolverState, pid: str, score: float, task: str, plan: list[Event]
    ) -> None:
        p = state.prompts.get(pid)
        if p is None:
            return
        p.finished += 1
        p.score_sum += score
        p.best = max(p.best, score)
        state.finished += 1
        cfg = state.config
        if (
            cfg.prompt_evolve_every > 0
            and state.finished % cfg.prompt_evolve_every == 0
            and len(state.prompts) + len(state.open_requests) < cfg.max_prompts
            and not state.budget_spent
        ):
            plan.append(self._request(state, task))

    def _request(self, state: EvolverState, task: str) -> PromptRewriteRequested:
        n = state.requests
        rng = _rng(state.seed, "rewrite", n)
        prompts = list(state.prompts.values())
        a, b = rng.choice(prompts), rng.choice(prompts)
        parent = a if a.fitness >= b.fitness else b
        state.requests += 1
        state.open_requests.append(n)
        return PromptRewriteRequested(
            request=n,
            prompt_id=parent.id,
            new_prompt_id=f"p{n + 1}",
            operator=rng.choice(REWRITE_OPERATORS),
            region=rng.choice(EVOLVABLE_REGIONS),
            model=_pick_model(rng, state.config.llm_models),
            task=task,
            fitness=(
                f"{parent.finished} kernels finished, mean score {parent.fitness:.3f} "
                f"(speedup when correct, 0 when failed), best speedup {parent.best:.3f}"
            ),
            rng_seed=rng.getrandbits(32),
        )
