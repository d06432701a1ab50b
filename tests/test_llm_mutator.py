"""The LLM mutator against the scripted server, and the budget stop ending the run cleanly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agents.llm_mutator import LlmMutator
from kf.agent import AgentContext
from kf.events import Event, Record, make_envelope
from kf.facts import RunFinished
from kf.llm_facts import LlmBudgetExhausted, LlmCalled, PromptChosen, PromptSeeded
from kf.search_facts import CandidateProposed, MutationFailed, ParentSelected
from tests.llm_server import ScriptedServer
from tests.test_archive import SEED_SRC, Driver, propose, started

_seq = 0


def rec(ev: Event) -> Record:
    global _seq
    _seq += 1
    return Record(make_envelope(ev, run_id="r", source="t@x", event_id=f"m{_seq}", seq=_seq), ev)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    """A scripted server, stopped after the test."""
    with ScriptedServer() as s:
        yield s


async def mutator_after_seed(url: str, **cfg: Any) -> tuple[LlmMutator, Any, str]:
    """A mutator that has folded the run start (with its seed proposed) and the seed prompt."""
    m = LlmMutator(AgentContext(run_id="r", agent_id="llm_mutator@t"))
    state = m.initial_state()
    config = {"llm": True, "llm_url": url, "llm_backoff_s": 0.01, "llm_max_retries": 1, **cfg}
    start = rec(started(**config))
    state = m.evolve(state, start)
    seeds = list(await m.react(state, start))
    assert len(seeds) == 1 and isinstance(seeds[0], CandidateProposed)
    state = m.evolve(state, rec(seeds[0]))
    state = m.evolve(state, rec(PromptSeeded(prompt_id="p0", regions={"strategy": "go fast"})))
    return m, state, seeds[0].candidate_id


def choice(parent: str, n: int = 0) -> PromptChosen:
    return PromptChosen(task="t", selection=n, island=0, operator="mutate", parent_id=parent,
                        prompt_id="p0", model="scripted", rng_seed=n)  # fmt: skip


async def answer(m: LlmMutator, state: Any, ev: Event) -> list[Event]:
    r = rec(ev)
    state = m.evolve(state, r)
    out = list(await m.react(state, r))
    for e in out:
        state = m.evolve(state, rec(e))
    return out


async def test_llm_mutator_proposes_a_diffed_candidate(server: ScriptedServer) -> None:
    """A SEARCH/REPLACE answer becomes a candidate labelled with model and URL."""
    old = 'CONFIG = {"UNROLL": 1, "CHUNK": 16, "SIMD": 0}'
    new = 'CONFIG = {"UNROLL": 2, "CHUNK": 16, "SIMD": 0}'
    assert old in SEED_SRC
    server.script = [{"content": f"<<<<<<< SEARCH\n{old}\n=======\n{new}\n>>>>>>> REPLACE"}]
    m, state, seed = await mutator_after_seed(server.url)
    out = await answer(m, state, choice(seed))
    await m.on_stop()
    called, cand = out
    assert isinstance(called, LlmCalled) and isinstance(cand, CandidateProposed)
    assert cand.mutator == f"llm: scripted via {server.url}" and cand.operator == "diff"
    assert cand.config == {"UNROLL": 2, "CHUNK": 16, "SIMD": 0} and new in cand.source
    assert "go fast" in called.messages[1].content and called.response is not None


async def test_llm_mutator_records_failures_as_failed_mutations(server: ScriptedServer) -> None:
    """Errors after retries and garbage answers are recorded calls plus MutationFailed."""
    server.script = [{"status": 500}, {"status": 500}, {"content": "lol"}]
    m, state, seed = await mutator_after_seed(server.url)
    first = await answer(m, state, choice(seed, 0))
    second = await answer(m, state, choice(seed, 1))
    await m.on_stop()
    assert isinstance(first[0], LlmCalled) and first[0].error is not None
    assert len(first[0].attempts) == 2
    assert isinstance(first[1], MutationFailed) and "LLM call failed" in first[1].reason
    assert isinstance(second[1], MutationFailed) and "unusable" in second[1].reason


async def test_llm_mutator_stops_at_the_call_budget(server: ScriptedServer) -> None:
    """With a one-call budget the second choice records the budget stop, not a call."""
    server.script = [{"content": "nothing useful"}]
    m, state, seed = await mutator_after_seed(server.url, llm_budget_calls=1)
    await answer(m, state, choice(seed, 0))
    out = await answer(m, state, choice(seed, 1))
    await m.on_stop()
    assert [type(e) for e in out] == [LlmBudgetExhausted, MutationFailed]
    assert len(server.requests) == 1


def test_archive_finishes_cleanly_when_llm_budget_spent() -> None:
    """After the budget stop the archive selects no more and finishes with the reason."""
    d = Driver()
    d.feed(started(budget=10, llm=True))
    d.feed(propose("s"))
    d.finish("s")
    sel = [e for e in d.decisions if isinstance(e, ParentSelected)]
    assert sel, "the archive should have selected parents"
    d.feed(LlmBudgetExhausted(reason="LLM call budget spent (1 of 1 calls made)"))
    for s in sel:
        d.feed(MutationFailed(task="t", selection=s.selection, reason="budget"))
    assert len([e for e in d.decisions if isinstance(e, ParentSelected)]) == len(sel)
    finished = [e for e in d.decisions if isinstance(e, RunFinished)]
    assert len(finished) == 1
    assert finished[0].reason.startswith("stopped early: LLM call budget spent")
