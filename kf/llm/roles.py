"""Which agents an LLM-driven run adds to ``kf run``."""

from __future__ import annotations

from typing import Any

__all__ = ["llm_roles"]


def llm_roles(llm: bool) -> tuple[list[Any], Any, list[Any]]:
    """``(hosted decision agents, the mutator, worker-side agents)`` for a run.

    With an LLM: the prompt evolver (hosted by the archivist) and the LLM mutator instead
    of the offline one. Without: nothing extra and the offline mutator. (The template
    tuner is a worker agent in every run: :func:`kf.orchestra.worker_agents`.)
    """
    from agents.mutator import OfflineMutator

    if not llm:
        return [], OfflineMutator, []
    from agents.llm_mutator import LlmMutator
    from agents.prompt_evolver import PromptEvolver

    return [PromptEvolver], LlmMutator, []
