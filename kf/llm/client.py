"""A small client over ``openai.AsyncOpenAI`` for any OpenAI-compatible endpoint.

Per-call timeout, retries with exponential backoff on 429 and 5xx (and on timeouts and
lost connections), a concurrency limit, token counts and the cost of each call. Every
attempt is reported back (status, error, latency) so the caller can record the call
verbatim. The API key comes from ``KF_LLM_API_KEY``, falling back to ``OPENAI_API_KEY``;
local servers (vLLM, Ollama, llama.cpp) usually need none, and then a placeholder is sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kf.llm.budget import Pricing
from kf.settings import Settings, current

__all__ = ["CallOutcome", "ClientSettings", "LlmClient", "api_key_from_env"]

_RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


def api_key_from_env(env: dict[str, str] | None = None) -> str | None:
    """``KF_LLM_API_KEY``, else ``OPENAI_API_KEY``, else None."""
    return (current() if env is None else Settings.from_env(env)).llm_api_key


@dataclass(frozen=True)
class ClientSettings:
    """How to reach the endpoint and how patiently."""

    base_url: str
    api_key: str | None = None
    timeout_s: float = 120.0
    max_retries: int = 4
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    concurrency: int = 4
    temperature: float = 0.7
    max_tokens: int = 4096
    pricing: Pricing = field(default_factory=Pricing)


@dataclass(frozen=True)
class CallOutcome:
    """What one logical call (possibly several attempts) produced."""

    response: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    latency_s: float
    attempts: tuple[tuple[int | None, str | None, float], ...]
    error: str | None
    queued_s: float = 0.0  # waiting for one of the --llm-concurrency slots
    tool_calls: tuple[tuple[str, str, str], ...] = ()  # (id, name, arguments) asked for

    @property
    def ok(self) -> bool:
        """A response text came back."""
        return self.error is None and self.response is not None


class LlmClient:
    """Chat completions with timeout, retries, backoff, a concurrency limit and costs."""

    def __init__(self, settings: ClientSettings) -> None:
        # imported here, not with the module: every `kf` command imports this one (through
        # kf.app.cli's parser), and openai's import is about a second of the commands that
        # never call a model (report, replay, export, eval)
        import openai

        self.settings = settings
        self._client = openai.AsyncOpenAI(
            base_url=settings.base_url,
            api_key=settings.api_key or "not-needed",
            timeout=settings.timeout_s,
            max_retries=0,  # retries are ours, so every attempt is recorded
        )
        self._slots = asyncio.Semaphore(max(1, settings.concurrency))

    @property
    def parameters(self) -> dict[str, Any]:
        """The sampling parameters and limits sent with (or governing) every call."""
        s = self.settings
        return {
            "temperature": s.temperature,
            "max_tokens": s.max_tokens,
            "timeout_s": s.timeout_s,
            "max_retries": s.max_retries,
        }

    async def close(self) -> None:
        """Close the HTTP connections."""
        await self._client.close()

    async def chat(
        self,
        model: str,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> CallOutcome:
        """One logical call: retried on 429/5xx/timeouts with backoff; never raises for HTTP.

        With ``tools`` (OpenAI function tools), the answer may be tool calls instead of
        text: they come back in ``tool_calls`` and ``response`` is then the text beside
        them ("" when none).
        """
        import openai  # imported by __init__ already: a lookup

        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        s = self.settings
        attempts: list[tuple[int | None, str | None, float]] = []
        queued = time.monotonic()
        start = queued
        error: str | None = None
        async with self._slots:
            start = time.monotonic()  # latency counts from a free slot, not the queue
            for attempt in range(s.max_retries + 1):
                if attempt:
                    await asyncio.sleep(min(s.backoff_s * 2 ** (attempt - 1), s.max_backoff_s))
                t0 = time.monotonic()
                try:
                    resp = await self._client.chat.completions.create(
                        model=model,
                        messages=list(messages),  # type: ignore[arg-type]
                        temperature=s.temperature,
                        max_tokens=s.max_tokens,
                        **extra,
                    )
                except (openai.OpenAIError, ValueError, TypeError) as exc:
                    status, error, retry = _failure(exc, s.timeout_s)
                    attempts.append((status, error, time.monotonic() - t0))
                    if retry:
                        continue
                    break
                took = time.monotonic() - t0
                choice = resp.choices[0] if getattr(resp, "choices", None) else None
                text = choice.message.content if choice is not None else None
                calls = _tool_calls(choice.message) if choice is not None and tools else ()
                if calls and text is None:
                    text = ""
                if choice is None or not isinstance(text, str):
                    error = "malformed response: no choices[0].message.content"
                    attempts.append((200, error, took))
                    break
                attempts.append((200, None, took))
                usage = resp.usage
                pin = int(getattr(usage, "prompt_tokens", 0) or 0)
                pout = int(getattr(usage, "completion_tokens", 0) or 0)
                return CallOutcome(
                    response=text,
                    finish_reason=choice.finish_reason,
                    prompt_tokens=pin,
                    completion_tokens=pout,
                    cost_usd=s.pricing.cost(pin, pout),
                    latency_s=time.monotonic() - start,
                    attempts=tuple(attempts),
                    error=None,
                    queued_s=start - queued,
                    tool_calls=calls,
                )
        if error is not None and len(attempts) > s.max_retries:
            error = f"gave up after {len(attempts)} attempts; last: {error}"
        return CallOutcome(
            response=None,
            finish_reason=None,
            prompt_tokens=0,
            completion_tokens=0,
            cost_usd=0.0,
            latency_s=time.monotonic() - start,
            attempts=tuple(attempts),
            error=error or "no attempt made",
            queued_s=start - queued,
        )


def _failure(exc: Exception, timeout_s: float) -> tuple[int | None, str, bool]:
    """A failed attempt's HTTP status (None: no answer), its error, and whether to retry:
    on a status of ``_RETRYABLE_STATUS`` (408, 409, 429, 5xx), a timeout or a lost
    connection; not on another status or a malformed response."""
    import openai  # imported by LlmClient already: a lookup

    if isinstance(exc, openai.APIStatusError):
        retry = exc.status_code in _RETRYABLE_STATUS
        return exc.status_code, f"HTTP {exc.status_code}: {_short(exc.message)}", retry
    if isinstance(exc, openai.APITimeoutError):  # before its base, APIConnectionError
        return None, f"timed out after {timeout_s:g}s", True
    if isinstance(exc, openai.APIConnectionError):
        return None, f"connection failed: {_short(str(exc.__cause__ or exc))}", True
    return 200, f"malformed response: {type(exc).__name__}: {_short(str(exc))}", False


def _tool_calls(message: Any) -> tuple[tuple[str, str, str], ...]:
    """``(id, name, arguments)`` of each function call in a response message."""
    out: list[tuple[str, str, str]] = []
    for call in getattr(message, "tool_calls", None) or ():
        fn = getattr(call, "function", None)
        out.append(
            (
                str(getattr(call, "id", "") or ""),
                str(getattr(fn, "name", "") or ""),
                str(getattr(fn, "arguments", "") or ""),
            )
        )
    return tuple(out)


def _short(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
