"""The prompt evolver's pure fold: seeded choices, fitness, rewrite requests, determinism."""

from __future__ import annotations

from typing import Any

from agents.prompt_evolver import PromptEvolver
from kf.agent import AgentContext
from kf.events import Event, Record, make_envelope
from kf.facts import RunStarted
from kf.llm_facts import LlmBudgetExhausted, PromptChosen, PromptRewriteRequested, PromptRewritten
from kf.reports import ProfileReport, VerifyReport
from kf.search_facts import CandidateProfiled, CandidateProposed, CandidateRejected, ParentSelected


def feed(agent: PromptEvolver, events: list[Event]) -> tuple[Any, list[Event]]:
    state = agent.initial_state()
    out: list[Event] = []
    for i, ev in enumerate(events, 1):
        rec = Record(make_envelope(ev, run_id="r", source="t@x", event_id=f"e{i}", seq=i), ev)
        state = agent.evolve(state, rec)
        out.extend(agent.react(state, rec))
    return state, out


def started(**config: Any) -> RunStarted:
    cfg = {"llm": True, "llm_models": [["a", 3.0], ["b", 1.0]], **config}
    return RunStarted(run_id="r", seed=11, config=cfg)


def selected(n: int) -> ParentSelected:
    return ParentSelected(task="t", selection=n, island=0, operator="mutate", parent_id="p")


def outcome(n: int, speedup: float | None) -> list[Event]:
    cid = f"c{n}"
    prop = CandidateProposed(
        candidate_id=cid, task="t", source=f"#{n}", operator="diff", mutator="m", selection=n
    )
    if speedup is None:
        end: Event = CandidateRejected(
            candidate_id=cid, task="t", device_id="d", report=VerifyReport(correct=False)
        )
    else:
        end = CandidateProfiled(
            candidate_id=cid,
            task="t",
            device_id="d",
            report=ProfileReport(ok=True, speedup=speedup),
        )
    return [prop, end]


def agent() -> PromptEvolver:
    return PromptEvolver(AgentContext(run_id="r", agent_id="prompt_evolver@t"))


def test_prompt_evolver_is_inactive_without_llm() -> None:
    """An offline run gets no prompts and no decisions."""
    state, out = feed(agent(), [RunStarted(run_id="r", seed=1), selected(0)])
    assert out == [] and state.prompts == {}


def test_prompt_evolver_seeds_and_chooses_deterministically() -> None:
    """The seed prompt is recorded; choices and models repeat exactly for the same log."""
    events: list[Event] = [started(), *(selected(i) for i in range(6))]
    _, first = feed(agent(), events)
    _, second = feed(agent(), events)
    assert first == second
    chosen = [e for e in first if isinstance(e, PromptChosen)]
    assert len(chosen) == 6 and {c.prompt_id for c in chosen} == {"p0"}
    assert {c.model for c in chosen} <= {"a", "b"}


def test_prompt_evolver_scores_prompts_and_requests_rewrites() -> None:
    """Finished kernels score their prompt; every second one triggers a rewrite request."""
    events: list[Event] = [started(prompt_evolve_every=2)]
    for n, sp in enumerate([2.0, None]):
        events += [selected(n), *outcome(n, sp)]
    state, out = feed(agent(), events)
    p0 = state.prompts["p0"]
    assert p0.finished == 2 and p0.score_sum == 2.0 and p0.best == 2.0
    reqs = [e for e in out if isinstance(e, PromptRewriteRequested)]
    assert len(reqs) == 1 and reqs[0].prompt_id == "p0" and reqs[0].new_prompt_id == "p1"
    assert "mean score" in reqs[0].fitness


def test_prompt_evolver_tries_a_new_prompt_first() -> None:
    """A rewritten prompt joins the population and is chosen before it has any score."""
    events: list[Event] = [started(prompt_evolve_every=2)]
    for n, sp in enumerate([1.0, 1.0]):
        events += [selected(n), *outcome(n, sp)]
    _, out = feed(agent(), events)
    req = next(e for e in out if isinstance(e, PromptRewriteRequested))
    regions = {"strategy": "s2", "pitfalls": "p", "hardware": "h"}
    rewritten = PromptRewritten(
        request=req.request, prompt_id=req.new_prompt_id, parent_prompt_id="p0",
        operator=req.operator, region="strategy", regions=regions, call_id="c",
    )  # fmt: skip
    state, out = feed(agent(), [*events, rewritten, selected(2)])
    assert "p1" in state.prompts
    assert [e.prompt_id for e in out if isinstance(e, PromptChosen)][-1] == "p1"


def test_prompt_evolver_stops_rewrites_when_budget_spent() -> None:
    """After the LLM budget is spent no rewrite is requested."""
    events: list[Event] = [started(prompt_evolve_every=1), LlmBudgetExhausted(reason="x")]
    events += [selected(0), *outcome(0, 1.0)]
    _, out = feed(agent(), events)
    assert not [e for e in out if isinstance(e, PromptRewriteRequested)]
