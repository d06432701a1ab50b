"""kf's LLM layer: the endpoint client, the budget, prompt building and response parsing."""

from kf.llm.budget import Budget, Pricing, Usage
from kf.llm.client import CallOutcome, ClientSettings, LlmClient, api_key_from_env
from kf.llm.parse import Edit, ResponseError, apply_diffs, parse_edit, parse_region
from kf.llm.prompts import (
    EVOLVABLE_REGIONS,
    REWRITE_OPERATORS,
    SEED_REGIONS,
    Inspiration,
    MutationContext,
    mutation_messages,
    prompt_hash,
    rewrite_messages,
)

__all__ = [
    "EVOLVABLE_REGIONS",
    "REWRITE_OPERATORS",
    "SEED_REGIONS",
    "Budget",
    "CallOutcome",
    "ClientSettings",
    "Edit",
    "Inspiration",
    "LlmClient",
    "MutationContext",
    "Pricing",
    "ResponseError",
    "Usage",
    "api_key_from_env",
    "apply_diffs",
    "mutation_messages",
    "parse_edit",
    "parse_region",
    "prompt_hash",
    "rewrite_messages",
]
