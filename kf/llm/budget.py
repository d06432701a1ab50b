"""The LLM budget: limits on calls, tokens and money, and the usage folded from the log."""

from __future__ import annotations

import msgspec

from kf.config import RunConfig

__all__ = ["Budget", "Pricing", "Usage"]


class Pricing(msgspec.Struct, frozen=True, kw_only=True):
    """US dollars per million prompt and completion tokens (0: free, e.g. a local server)."""

    usd_per_mtok_in: float = 0.0
    usd_per_mtok_out: float = 0.0

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """The price of one call."""
        return (
            prompt_tokens * self.usd_per_mtok_in + completion_tokens * self.usd_per_mtok_out
        ) / 1e6


class Usage(msgspec.Struct, kw_only=True):
    """Calls, tokens and money spent so far (a fold over ``llm.called`` events)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    @property
    def tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def add(self, prompt_tokens: int, completion_tokens: int, cost_usd: float) -> None:
        """Count one call."""
        self.calls += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.cost_usd += cost_usd


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    """Limits for a run's LLM use; ``None`` means unlimited."""

    tokens: int | None = None
    calls: int | None = None
    usd: float | None = None

    @classmethod
    def of(cls, config: RunConfig) -> Budget:
        """The run's ``--llm-budget-tokens/calls/usd``."""
        llm = config.llm
        return cls(tokens=llm.llm_budget_tokens, calls=llm.llm_budget_calls, usd=llm.llm_budget_usd)

    def exhausted(self, used: Usage, in_flight: int = 0) -> str | None:
        """Why no further call may start (counting calls in flight), or None."""
        if self.calls is not None and used.calls + in_flight >= self.calls:
            return f"LLM call budget spent ({used.calls} of {self.calls} calls made)"
        if self.tokens is not None and used.tokens >= self.tokens:
            return f"LLM token budget spent ({used.tokens} of {self.tokens} tokens used)"
        if self.usd is not None and used.cost_usd >= self.usd:
            return f"LLM money budget spent (${used.cost_usd:.4f} of ${self.usd:.4f})"
        return None
