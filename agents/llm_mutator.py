"""The LLM mutator: answers each ``PromptChosen`` with a model-written candidate.

An observer (its output is the world's answer, recorded verbatim): for every prompt
choice it builds a prompt from the task's reference, the parent kernel and its timings,
the recent failures of the parent's children, up to two inspirations from other archive
cells and islands, the target device's announced capabilities and the chosen
meta-prompt; calls the chosen model of the ensemble; records the call (``LlmCalled``:
request, response, usage, latency, every attempt) and then either a ``CandidateProposed``
(``mutator`` says "llm: <model> via <base_url>") or a ``MutationFailed`` naming what was
wrong (HTTP errors after retries, timeouts, garbage, an unappliable diff). It also
performs the prompt rewrites the prompt evolver asks for, and proposes the tasks' seed
kernels when the run starts.

Budget: usage is folded from ``llm.called`` events (so a restarted run keeps counting);
before each call the budget is checked, counting calls in flight. Once it is spent, the
mutator records ``LlmBudgetExhausted`` (the archive stops selecting and finishes the run)
and answers remaining choices with failed mutations.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from agents.cli_mutator import CliSpec, agent_label, run_cli_episode
from agents.tool_mutator import Elite, EpisodeResult, EpisodeSpec, ToolFn, run_episode
from agents.tool_server import BusTools
from agents.tuned import seed_candidates, tuned_candidate
from kf.agent import Agent, AgentContext
from kf.config import RunConfig
from kf.events import Event, Record, derived_id
from kf.facts import DeviceAnnounced, DeviceLeft, DeviceLost, RunStarted
from kf.kernels import params
from kf.kernels.backends import backend_of, device_kind, language_of
from kf.llm.budget import Budget, Pricing, Usage
from kf.llm.client import CallOutcome, ClientSettings, LlmClient, api_key_from_env
from kf.llm.evidence import compile_outcome, profile_outcome, verify_outcome
from kf.llm.lessons import quoted
from kf.llm.parse import Edit, ResponseError, parse_edit, parse_region
from kf.llm.prompts import (
    SEED_REGIONS,
    Attempt,
    Inspiration,
    MutationContext,
    Prompt,
    estimate_tokens,
    init_messages,
    mutation_prompt,
    prompt_hash,
    rewrite_messages,
)
from kf.llm.tools import ToolLimits, ToolReply, tool_specs
from kf.llm_facts import (
    LlmAttempt,
    LlmBudgetExhausted,
    LlmCalled,
    LlmMessage,
    LlmToolCall,
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
    CountersMeasured,
    EliteAdmitted,
    Lesson,
    LessonsLoaded,
    MutationFailed,
    TunedChosen,
)

__all__ = ["CandInfo", "LlmMutator", "LlmMutatorState", "llm_label"]

SEED_LABEL = "seed kernel from the task's seeds/ folder (no LLM)"


def llm_label(model: str, base_url: str) -> str:
    """The honest ``mutator`` field of a model-written candidate."""
    return f"llm: {model} via {base_url}"


class CandInfo(msgspec.Struct, kw_only=True):
    """What the mutator remembers of a candidate, for prompts."""

    task: str
    island: int
    parent_id: str | None = None
    speedup: float | None = None
    runtime_ms: float | None = None
    ref_ms: float | None = None
    failure: str | None = None
    cell: tuple[int, int, int] | None = None
    build: str | None = None  # the compiler's resource report (kf.cuda lines)
    counters: dict[str, float] | None = None  # ncu summary, for a task's best
    outcome: str = ""  # the evidence shown to a model: trimmed errors, failing trials, timings
    language: str = ""


class LlmMutatorState(msgspec.Struct, kw_only=True):
    """Tasks, candidates, elites, device capabilities, prompts and LLM usage, from the log."""

    run_id: str = ""
    seed: int = 0
    islands: int = 1
    device: str = "cpu"
    base_url: str = ""
    budget: Budget = Budget()
    config: RunConfig = RunConfig()
    references: dict[str, str] = {}
    seeds: dict[str, list[tuple[str, str]]] = {}
    sources: dict[str, str] = {}
    cands: dict[str, CandInfo] = {}
    elites: dict[str, dict[str, str]] = {}  # task → cell key → candidate id
    child_failures: dict[str, list[str]] = {}  # parent id → recent failures of its children
    device_caps: dict[str, Any] = {}
    live: dict[str, tuple[str, ...]] = {}  # live device id → the backends it announced
    live_kind: dict[str, str] = {}  # device id → cpu | cuda
    prompts: dict[str, dict[str, str]] = {}
    seen: dict[str, set[str]] = {}
    usage: Usage = msgspec.field(default_factory=Usage)
    call_ids: set[str] = set()
    budget_announced: bool = False
    lessons: dict[str, Lesson] = {}  # the run's loaded lessons (lesson.loaded), by id


def build_notes(log: str, limit: int = 12) -> str | None:
    """The resource lines of a compile log (registers, shared memory, spills, cache hits)."""
    lines = [line for line in log.splitlines() if line.startswith("kf.cuda")]
    return "\n".join(lines[-limit:]) or None


def _params(source: str) -> tuple[params.ParamSpace, params.Config] | None:
    """The module's kf:params (space, config), or None when it has none or a broken one."""
    try:
        return params.parse(source)
    except params.ParamsError:
        return None


def _child_failed(state: LlmMutatorState, c: CandInfo) -> None:
    """Remember ``c``'s failure among its parent's children's last three."""
    if c.parent_id is not None and c.failure:
        fails = state.child_failures.setdefault(c.parent_id, [])
        fails.append(c.failure)
        del fails[:-3]


def _duplicate(state: LlmMutatorState, ev: CandidateDuplicate | LessonsLoaded) -> None:
    """A candidate the archive found the same as an earlier one: a failure of its parent's
    child, so the next prompt says that this change changed nothing. (Also the run's
    lessons, kept by id for prompts to quote.)"""
    if isinstance(ev, LessonsLoaded):
        state.lessons = {x.lesson_id: x for x in ev.lessons}
        return
    c = state.cands.get(ev.candidate_id)
    if c is not None:
        c.failure = (
            f"duplicate: the same code as {ev.duplicate_of[:12]} once comments and spacing "
            "are set aside; change what the kernel does"
        )
        c.outcome = f"never ran: {c.failure}"
        _child_failed(state, c)


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


class LlmMutator(Agent[LlmMutatorState]):
    """Model-written candidates and prompt rewrites, every call recorded verbatim."""

    kind = "llm_mutator"
    # reactions waiting for the model at once; the client's --llm-concurrency limits the
    # HTTP calls actually in flight, so selections queue here, not in the archive
    concurrency = 64
    listens = (
        RunStarted,
        DeviceAnnounced,
        DeviceLeft,
        DeviceLost,
        CandidateProposed,
        CandidateCompiled,
        CandidateRejected,
        CandidateProfiled,
        CandidateUnroutable,
        CandidateDuplicate,
        CountersMeasured,
        EliteAdmitted,
        LlmCalled,
        LlmBudgetExhausted,
        PromptSeeded,
        PromptRewritten,
        PromptChosen,
        PromptRewriteRequested,
        TunedChosen,
        LessonsLoaded,
    )

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self._client: LlmClient | None = None
        self._in_flight = 0
        self._unfolded: dict[str, tuple[int, int, float]] = {}
        self._announced = False
        self._nc: Any = None  # the bus, for tool requests to the run's devices
        self._tool_load: dict[str, int] = {}

    def bind_bus(self, nc: Any) -> None:
        """The runner's connection: episodes send tool requests to devices over it."""
        self._nc = nc

    def initial_state(self) -> LlmMutatorState:
        return LlmMutatorState()

    def snapshot(self, state: LlmMutatorState) -> Any:
        return {"usage": state.usage, "candidates": len(state.sources)}

    def client(self, config: RunConfig) -> LlmClient:
        """The endpoint client, made on first use from the run config and agent options.

        Options (``kf agent llm_mutator --option KEY=VALUE``) override the run config's
        ``llm_*`` keys; the API key comes only from options or the environment.
        """
        if self._client is None:
            o = config.overridden(self.ctx.options).llm
            if not o.llm_url:
                raise ValueError("llm_mutator needs llm_url (an OpenAI-compatible base URL)")
            self._client = LlmClient(
                ClientSettings(
                    base_url=o.llm_url,
                    api_key=self.ctx.options.get("api_key") or api_key_from_env(),
                    timeout_s=o.llm_timeout_s,
                    max_retries=o.llm_max_retries,
                    backoff_s=o.llm_backoff_s,
                    concurrency=o.llm_concurrency,
                    temperature=o.llm_temperature,
                    max_tokens=o.llm_max_tokens,
                    pricing=Pricing(
                        usd_per_mtok_in=o.llm_usd_per_mtok_in,
                        usd_per_mtok_out=o.llm_usd_per_mtok_out,
                    ),
                )
            )
        return self._client

    async def on_stop(self) -> None:
        if self._client is not None:
            await self._client.close()

    # -- the fold ------------------------------------------------------------------------

    def evolve(self, state: LlmMutatorState, rec: Record) -> LlmMutatorState:
        ev = rec.event
        if isinstance(ev, RunStarted):
            state.run_id = ev.run_id
            state.seed = ev.seed
            state.config = config = ev.run_config()
            state.islands = config.search.islands or 1
            state.device = config.evaluation.device
            state.base_url = config.llm.llm_url
            state.budget = Budget.of(config)
            state.references = {t.name: t.source for t in ev.tasks}
            state.seeds = {t.name: list(t.seeds) for t in ev.tasks}
        elif isinstance(ev, DeviceAnnounced):
            state.device_caps = dict(ev.capabilities)
            backends = ev.capabilities.get("backends", ()) or ()
            state.live[ev.device_id] = tuple(str(b) for b in backends)
            state.live_kind[ev.device_id] = ev.kind
        elif isinstance(ev, (DeviceLeft, DeviceLost)):
            state.live.pop(ev.device_id, None)
        elif isinstance(ev, CandidateProposed):
            state.sources[ev.candidate_id] = ev.source
            state.seen.setdefault(ev.task, set()).add(_digest(ev.source))
            state.cands[ev.candidate_id] = CandInfo(
                task=ev.task,
                island=ev.island,
                parent_id=ev.parent_id,
                language=language_of(backend_of(ev.source, ev.device)),
            )
        elif isinstance(ev, CandidateUnroutable):
            c = state.cands.get(ev.candidate_id)
            if c is not None:
                c.failure = f"unroutable: {ev.reason}"
                c.outcome = f"never ran: {ev.reason}"
        elif isinstance(ev, (CandidateDuplicate, LessonsLoaded)):
            _duplicate(state, ev)
        elif isinstance(ev, CountersMeasured):
            c = state.cands.get(ev.candidate_id)
            # the model is told only the counters of a device the run trusts (issue 34: a
            # device's own word; None in logs before the list, or with every device trusted)
            if c is not None and ev.report.ok and state.config.trusted(ev.device_id):
                c.counters = dict(ev.report.summary)
        elif isinstance(ev, (CandidateCompiled, CandidateRejected)):
            c = state.cands.get(ev.candidate_id)
            if c is not None and isinstance(ev, CandidateCompiled) and ev.report.ok:
                c.build = build_notes(ev.report.log)
            ok = ev.report.ok if isinstance(ev, CandidateCompiled) else False
            if c is not None and not ok:
                kind = ev.report.failure_kind or "failed"
                c.failure = f"{kind}: {(ev.report.error or '').strip()[:800]}"
                c.outcome = (
                    compile_outcome(ev.report)
                    if isinstance(ev, CandidateCompiled)
                    else verify_outcome(ev.report)
                )
                _child_failed(state, c)
        elif isinstance(ev, CandidateProfiled):
            c = state.cands.get(ev.candidate_id)
            if c is not None:
                c.outcome = profile_outcome(ev.report)
            if c is not None and ev.report.ok:
                c.speedup = ev.report.speedup
                c.runtime_ms = ev.report.runtime_ms
                c.ref_ms = ev.report.ref_runtime_ms
        elif isinstance(ev, EliteAdmitted):
            state.elites.setdefault(ev.task, {})[f"{ev.island}:{ev.cell}"] = ev.candidate_id
            c = state.cands.get(ev.candidate_id)
            if c is not None:
                c.cell = ev.cell
        elif isinstance(ev, LlmCalled):
            if ev.call_id not in state.call_ids:
                state.call_ids.add(ev.call_id)
                if ev.error is None:
                    state.usage.add(ev.prompt_tokens, ev.completion_tokens, ev.cost_usd)
                else:
                    state.usage.add(0, 0, 0.0)
        elif isinstance(ev, LlmBudgetExhausted):
            state.budget_announced = True
        elif isinstance(ev, (PromptSeeded, PromptRewritten)):
            state.prompts[ev.prompt_id] = dict(ev.regions)
        return state

    # -- reactions -----------------------------------------------------------------------

    async def react(self, state: LlmMutatorState, rec: Record) -> Sequence[Event]:
        ev = rec.event
        if isinstance(ev, RunStarted):
            return seed_candidates(state, rec.event_id, mutator=SEED_LABEL)
        if isinstance(ev, PromptChosen):
            return await self._mutate(state, ev, rec.event_id)
        if isinstance(ev, PromptRewriteRequested):
            return await self._rewrite(state, ev, rec.event_id)
        if isinstance(ev, TunedChosen):  # a tuner's configuration: no model involved
            return [tuned_candidate(state.sources, ev, rec.event_id, island=0, device=state.device)]
        return ()

    def _budget_left(self, state: LlmMutatorState) -> str | None:
        used = msgspec.structs.replace(state.usage)
        for cid, (pin, pout, cost) in list(self._unfolded.items()):
            if cid in state.call_ids:
                del self._unfolded[cid]
            else:
                used.add(pin, pout, cost)
        return state.budget.exhausted(used, self._in_flight)

    def _refused(self, state: LlmMutatorState, failed: Callable[[str], Event]) -> list[Event]:
        """With the LLM budget spent: its announcement (once) and ``failed`` with the
        reason; else nothing."""
        reason = self._budget_left(state)
        return [] if reason is None else [*self._exhausted(state, reason), failed(reason)]

    def _exhausted(self, state: LlmMutatorState, reason: str) -> list[Event]:
        if state.budget_announced or self._announced:
            return []
        self._announced = True
        u = state.usage
        return [
            LlmBudgetExhausted(reason=reason, calls=u.calls, tokens=u.tokens, cost_usd=u.cost_usd)
        ]

    async def _call(
        self,
        state: LlmMutatorState,
        call_id: str,
        purpose: str,
        model: str,
        messages: list[dict[str, Any]],
        *,
        task: str = "",
        selection: int | None = None,
        prompt_id: str = "",
        prompt: Prompt | None = None,
        language: str = "",
        tools: list[dict[str, Any]] | None = None,
        record: list[dict[str, Any]] | None = None,
        episode: str = "",
        turn: int = 0,
    ) -> tuple[LlmCalled, CallOutcome]:
        client = self.client(state.config)
        self._in_flight += 1
        try:
            out = await client.chat(model, messages, tools)
        finally:
            self._in_flight -= 1
        self._unfolded[call_id] = (out.prompt_tokens, out.completion_tokens, out.cost_usd)
        called = LlmCalled(
            call_id=call_id,
            purpose=purpose,
            model=model,
            base_url=client.settings.base_url,
            parameters=client.parameters,
            prompt_hash=prompt_hash(messages),
            messages=tuple(
                LlmMessage(
                    role=str(m["role"]),
                    content=str(m.get("content") or ""),
                    tool_call_id=str(m.get("tool_call_id", "")),
                )
                for m in (messages if record is None else record)
            ),
            response=out.response,
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cost_usd=out.cost_usd,
            latency_s=out.latency_s,
            attempts=tuple(LlmAttempt(status=s, error=e, latency_s=t) for s, e, t in out.attempts),
            error=out.error,
            task=task,
            selection=selection,
            prompt_id=prompt_id,
            language=language,
            prompt_tokens_estimated=(
                prompt.tokens
                if prompt is not None
                else sum(estimate_tokens(str(m.get("content") or "")) for m in messages)
            ),
            truncated=prompt.truncated if prompt is not None else (),
            queued_s=out.queued_s,
            episode=episode,
            turn=turn,
            tool_calls=tuple(LlmToolCall(id=i, name=n, arguments=a) for i, n, a in out.tool_calls),
        )
        return called, out

    def _inspirations(
        self, state: LlmMutatorState, ev: PromptChosen, k: int = 2
    ) -> list[Inspiration]:
        elites = state.elites.get(ev.task, {})
        ids = sorted(set(elites.values()) - {ev.parent_id, ev.second_parent_id or ""})
        if not ids:
            return []
        rng = random.Random(ev.rng_seed)
        other_island = [c for c in ids if state.cands[c].island != ev.island]
        pool = other_island if len(other_island) >= k else ids
        picked = sorted(rng.sample(pool, min(k, len(pool))))
        return [
            Inspiration(
                candidate_id=c,
                island=state.cands[c].island,
                cell=state.cands[c].cell,
                speedup=state.cands[c].speedup,
                source=state.sources[c],
            )
            for c in picked
        ]

    async def _mutate(self, state: LlmMutatorState, ev: PromptChosen, event_id: str) -> list[Event]:
        def failed_as(who: str, reason: str) -> MutationFailed:
            return MutationFailed(
                task=ev.task, selection=ev.selection, reason=reason, mutator=who, arm=ev.arm
            )

        def failed(reason: str) -> MutationFailed:
            return failed_as(self._label(state, ev), reason)

        if ev.operator == "init":
            return await self._draft(state, ev, event_id, failed_as)
        parent = state.sources.get(ev.parent_id)
        if parent is None:
            return [failed(f"parent {ev.parent_id} was never proposed in this run")]
        if refused := self._refused(state, failed):
            return refused
        info = state.cands.get(ev.parent_id, CandInfo(task=ev.task, island=ev.island))
        ctx = MutationContext(
            task=ev.task,
            reference=state.references.get(ev.task, ""),
            parent_id=ev.parent_id,
            parent_source=parent,
            operator=ev.operator,
            regions=state.prompts.get(ev.prompt_id, SEED_REGIONS),
            parent_speedup=info.speedup,
            parent_runtime_ms=info.runtime_ms,
            parent_ref_ms=info.ref_ms,
            parent_failure=info.failure,
            parent_build=info.build,
            parent_counters=info.counters,
            second_parent_source=state.sources.get(ev.second_parent_id or ""),
            inspirations=self._inspirations(state, ev),
            failures=tuple(state.child_failures.get(ev.parent_id, ())),
            device=state.device_caps,
            parent_outcome=info.outcome,
            language=ev.language,
            lessons=quoted([state.lessons[i] for i in ev.lessons if i in state.lessons]),
        )
        prompt = mutation_prompt(ctx, self._prompt_budget(state))
        call_id = derived_id("llm-call", event_id)
        cand_id = derived_id("candidate", event_id)
        if ev.agent:
            events, edit, why, label, what = await self._episode(
                state, ev, event_id, cand_id, prompt, parent, info.outcome or info.failure or ""
            )
            if edit is None:
                return [*events, failed_as(label, why)]
        else:
            called, edit, why = await self._answer(state, ev, call_id, "mutate", prompt, parent)
            if edit is None:
                return [called, failed(why)]
            events, what, label = [called], f"llm call {call_id}", self._label(state, ev)
        parsed = _params(edit.source)
        crossed = ev.operator == "crossover" and ev.second_parent_id is not None
        return [
            *events,
            CandidateProposed(
                candidate_id=cand_id,
                task=ev.task,
                source=edit.source,
                operator=edit.kind,
                mutator=label,
                island=ev.island,
                selection=ev.selection,
                parent_id=ev.parent_id,
                second_parent_id=ev.second_parent_id if crossed else None,
                device=state.device,
                arm=ev.arm,
                lessons=ev.lessons,
                family=params.family(edit.source),
                config=dict(parsed[1]) if parsed else {},
                note=(
                    f"prompt {ev.prompt_id}; {what}; {edit.kind} "
                    f"({edit.blocks} block{'s' if edit.blocks != 1 else ''})"
                    + ("; crossover" if crossed else "")
                    + "".join(f"; {n}" for n in edit.notes)
                ),
            ),
        ]

    def _label(self, state: LlmMutatorState, ev: PromptChosen) -> str:
        """Who answers ``ev``, honestly: the model (with tools), or the agent command."""
        if ev.agent == "cli":
            return agent_label(state.config.agents.agent_cmd)
        if ev.agent == "tools":
            return f"llm+tools: {ev.model} via {state.base_url}"
        return llm_label(ev.model, state.base_url)

    def _tool_fn(self, state: LlmMutatorState, task: str) -> ToolFn:
        """Runs a device tool on a live device of the run that serves the module's backend
        (the least busy with this mutator's tools), over the bus."""
        limits = ToolLimits.of(state.config)

        async def run(tool: str, source: str) -> ToolReply:
            backend = backend_of(source, state.device)
            kind = device_kind(state.device)
            devices = sorted(
                d
                for d, backends in state.live.items()
                if state.live_kind.get(d) == kind and (not backends or backend in backends)
            )
            if not devices:
                return ToolReply(
                    ok=False,
                    text=f"no live {kind} device of this run runs backend {backend} now",
                    error="no device",
                )
            if self._nc is None:
                return ToolReply(ok=False, text="this mutator has no bus", error="no bus")
            dev = min(devices, key=lambda d: (self._tool_load.get(d, 0), d))
            self._tool_load[dev] = self._tool_load.get(dev, 0) + 1
            try:
                return await BusTools(self._nc, state.run_id).run(
                    dev,
                    tool,
                    task,
                    state.references.get(task, ""),
                    source,
                    seed=state.seed,
                    timeout_s=limits.tool_timeout_s,
                )
            finally:
                self._tool_load[dev] -= 1

        return run

    async def _episode(
        self,
        state: LlmMutatorState,
        ev: PromptChosen,
        event_id: str,
        cand_id: str,
        prompt: Prompt,
        parent: str | None,
        evidence: str,
    ) -> tuple[list[Event], Edit | None, str, str, str]:
        """A tool-using or coding-agent episode: ``(events, edit or None, why not, label,
        what the note says)``."""
        label = self._label(state, ev)
        episode = derived_id("episode", event_id)
        limits = ToolLimits.of(state.config)
        tool = self._tool_fn(state, ev.task)
        seen = state.seen.get(ev.task, set())
        result: EpisodeResult
        if ev.agent == "cli":
            result = await run_cli_episode(
                CliSpec(
                    episode=episode,
                    task=ev.task,
                    selection=ev.selection,
                    template=state.config.agents.agent_cmd,
                    timeout_s=state.config.agents.agent_timeout_s,
                    prompt=prompt,
                    reference=state.references.get(ev.task, ""),
                    parent=parent,
                    evidence=evidence,
                    tool_calls=limits.tool_calls,
                    seen=seen,
                ),
                tool,
            )
        else:

            async def call(
                conv: list[dict[str, Any]],
                new: list[dict[str, Any]],
                turn: int,
                tools: list[dict[str, Any]] | None,
            ) -> tuple[LlmCalled, CallOutcome]:
                return await self._call(
                    state,
                    derived_id("llm-call", event_id, "turn", turn),
                    "init" if ev.operator == "init" else "mutate",
                    ev.model,
                    conv,
                    task=ev.task,
                    selection=ev.selection,
                    prompt_id=ev.prompt_id,
                    prompt=prompt if turn == 0 else None,
                    language=ev.language,
                    tools=tools,
                    record=new,
                    episode=episode,
                    turn=turn,
                )

            elites = {
                cid: Elite(
                    id=cid,
                    source=state.sources[cid],
                    speedup=state.cands[cid].speedup,
                    cell=state.cands[cid].cell,
                    island=state.cands[cid].island,
                )
                for cid in sorted(set(state.elites.get(ev.task, {}).values()))
                if cid in state.sources and cid in state.cands
            }
            result = await run_episode(
                EpisodeSpec(
                    episode=episode,
                    task=ev.task,
                    selection=ev.selection,
                    model=ev.model,
                    prompt=prompt,
                    parent=parent,
                    limits=limits,
                    tools=tool_specs(gpu=device_kind(state.device) == "cuda"),
                    elites=elites,
                    seen=seen,
                    budget_left=lambda: self._budget_left(state),
                ),
                call,
                tool,
            )
        end = result.ended
        events: list[Event] = list(result.events)
        if end is not None:
            if result.source is not None:
                end = msgspec.structs.replace(end, candidate_id=cand_id)
            events.append(end)
        if result.source is None:
            return events, None, result.reason, label, ""
        edit = Edit(result.source, result.kind, notes=list(result.notes))
        what = f"{'agent command' if ev.agent == 'cli' else 'tool'} episode {episode}"
        if end is not None:
            what += f" ({end.turns} turns, {end.tool_calls} tool calls, {end.ended})"
        return events, edit, "", label, what

    async def _answer(
        self,
        state: LlmMutatorState,
        ev: PromptChosen,
        call_id: str,
        purpose: str,
        prompt: Prompt,
        parent: str | None,
    ) -> tuple[LlmCalled, Edit | None, str]:
        """Call the model with ``prompt`` and read its answer against ``parent``: the
        recorded call, and the edit or why there is none."""
        called, out = await self._call(
            state,
            call_id,
            purpose,
            ev.model,
            prompt.messages,
            task=ev.task,
            selection=ev.selection,
            prompt_id=ev.prompt_id,
            prompt=prompt,
            language=ev.language,
        )
        if not out.ok or out.response is None:
            return called, None, f"LLM call failed: {out.error}"
        try:
            edit = parse_edit(out.response, parent, finish_reason=out.finish_reason)
        except ResponseError as exc:
            return called, None, f"unusable LLM response: {exc}"
        # an arm of a controlled comparison is proposed even so: the archive records it as
        # a duplicate (never run), which its comparison scores as the candidate it repeats
        if not ev.arm and _digest(edit.source) in state.seen.get(ev.task, set()):
            return called, None, "the LLM's candidate duplicates one already proposed"
        return called, edit, ""

    def _prompt_budget(self, state: LlmMutatorState) -> int:
        """Tokens a prompt may take: ``llm_max_context`` less the answer's ``max_tokens``."""
        o = state.config.overridden(self.ctx.options).llm
        context, answer = o.llm_max_context, o.llm_max_tokens
        return max(1024, context - answer) if context > answer else max(1024, context // 2)

    async def _draft(
        self,
        state: LlmMutatorState,
        ev: PromptChosen,
        event_id: str,
        failed_as: Any,
    ) -> list[Event]:
        """A first-generation candidate: the model writes a kernel from the reference alone
        (in a retry round, with the evidence of the failed first attempts)."""
        label = self._label(state, ev)
        if refused := self._refused(state, lambda why: failed_as(label, why)):
            return refused
        attempts = [
            Attempt(
                candidate_id=cid,
                source=state.sources[cid],
                outcome=state.cands[cid].outcome or state.cands[cid].failure or "failed",
                language=state.cands[cid].language,
            )
            for cid in ev.evidence
            if cid in state.sources and cid in state.cands
        ]
        prompt = init_messages(
            ev.task,
            state.references.get(ev.task, ""),
            ev.language,
            state.prompts.get(ev.prompt_id, SEED_REGIONS),
            state.device_caps,
            attempts,
            self._prompt_budget(state),
        )
        call_id = derived_id("llm-call", event_id)
        cand_id = derived_id("candidate", event_id)
        if ev.agent:
            evidence = "\n\n".join(f"{a.candidate_id}: {a.outcome}" for a in attempts)
            events, edit, why, label, what = await self._episode(
                state, ev, event_id, cand_id, prompt, None, evidence
            )
            if edit is None:
                return [*events, failed_as(label, why)]
        else:
            called, edit, why = await self._answer(state, ev, call_id, "init", prompt, None)
            if edit is None:
                return [called, failed_as(label, why)]
            events, what = [called], f"llm call {call_id}"
        parsed = _params(edit.source)
        shown = f"; shown {len(attempts)} failed attempt(s)" if attempts else ""
        return [
            *events,
            CandidateProposed(
                candidate_id=cand_id,
                task=ev.task,
                source=edit.source,
                operator="init",
                mutator=label,
                island=ev.island,
                selection=ev.selection,
                device=state.device,
                arm=ev.arm,
                lessons=ev.lessons,
                family=params.family(edit.source),
                config=dict(parsed[1]) if parsed else {},
                note=(
                    f"first generation in {ev.language or 'any language'}; prompt "
                    f"{ev.prompt_id}; {what}{shown}" + "".join(f"; {n}" for n in edit.notes)
                ),
            ),
        ]

    async def _rewrite(
        self, state: LlmMutatorState, ev: PromptRewriteRequested, event_id: str
    ) -> list[Event]:
        def failed(reason: str, call_id: str = "") -> PromptRewriteFailed:
            return PromptRewriteFailed(
                request=ev.request, parent_prompt_id=ev.prompt_id, reason=reason, call_id=call_id
            )

        regions = state.prompts.get(ev.prompt_id)
        if regions is None:
            return [failed(f"prompt {ev.prompt_id} is unknown")]
        if refused := self._refused(state, failed):
            return refused
        messages = rewrite_messages(
            regions,
            ev.region,
            ev.operator,
            task=ev.task if ev.operator == "specialise" else "",
            reference=state.references.get(ev.task, ""),
            device=state.device_caps if ev.operator == "specialise" else None,
            fitness=ev.fitness,
        )
        call_id = derived_id("llm-call", event_id)
        called, out = await self._call(
            state, call_id, "prompt_rewrite", ev.model, messages, prompt_id=ev.prompt_id
        )
        if not out.ok or out.response is None:
            return [called, failed(f"LLM call failed: {out.error}", call_id)]
        try:
            text = parse_region(out.response)
        except ResponseError as exc:
            return [called, failed(f"unusable LLM response: {exc}", call_id)]
        return [
            called,
            PromptRewritten(
                request=ev.request,
                prompt_id=ev.new_prompt_id,
                parent_prompt_id=ev.prompt_id,
                operator=ev.operator,
                region=ev.region,
                regions=dict(sorted({**regions, ev.region: text}.items())),
                call_id=call_id,
                model=ev.model,
            ),
        ]
