"""The LLM client against the scripted server, response parsing, and the budget."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kf.llm import (
    Budget,
    ClientSettings,
    LlmClient,
    Pricing,
    ResponseError,
    Usage,
    api_key_from_env,
    parse_edit,
    parse_region,
)
from tests.llm_server import ScriptedServer

PARENT = """import torch
from torch import nn

# --- kf:params ---
SPACE = {"BLOCK": [1, 2]}
CONFIG = {"BLOCK": 1}
# --- kf:end ---


class ModelNew(nn.Module):
    def forward(self, x):
        return x * 2
"""
MSG = [{"role": "user", "content": "make it fast"}]


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    """A scripted server, stopped after the test."""
    with ScriptedServer() as s:
        yield s


def client(url: str, **kw: object) -> LlmClient:
    opts: dict = {"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01, **kw}
    return LlmClient(ClientSettings(base_url=url, **opts))


async def test_client_returns_text_usage_and_cost(server: ScriptedServer) -> None:
    """A completion comes back with its token counts and priced cost."""
    server.script = [{"content": "one two three"}]
    c = client(server.url, pricing=Pricing(usd_per_mtok_in=1e6, usd_per_mtok_out=2e6))
    out = await c.chat("scripted", MSG)
    await c.close()
    assert out.ok and out.response == "one two three"
    assert (out.prompt_tokens, out.completion_tokens) == (3, 3)
    assert out.cost_usd == pytest.approx(3 * 1.0 + 3 * 2.0)
    assert server.requests[0]["model"] == "scripted"


async def test_client_retries_429_and_500_then_succeeds(server: ScriptedServer) -> None:
    """Rate limits and server errors are retried; every attempt is reported."""
    server.script = [{"status": 429}, {"status": 500}, {"content": "ok"}]
    c = client(server.url)
    out = await c.chat("scripted", MSG)
    await c.close()
    assert out.ok and out.response == "ok"
    assert [a[0] for a in out.attempts] == [429, 500, 200]


async def test_client_gives_up_after_retries(server: ScriptedServer) -> None:
    """Persistent 503s end in an error naming the attempts, not an exception."""
    server.script = [{"status": 503}] * 3
    c = client(server.url)
    out = await c.chat("scripted", MSG)
    await c.close()
    assert not out.ok and out.response is None
    assert "gave up after 3 attempts" in (out.error or "") and "503" in (out.error or "")


async def test_client_does_not_retry_400(server: ScriptedServer) -> None:
    """A client error is final: one attempt."""
    server.script = [{"status": 400, "error": "bad model"}, {"content": "never"}]
    c = client(server.url)
    out = await c.chat("scripted", MSG)
    await c.close()
    assert not out.ok and len(out.attempts) == 1 and "400" in (out.error or "")


async def test_client_times_out_a_hanging_server(server: ScriptedServer) -> None:
    """A request hanging past the timeout is retried, then reported as timed out."""
    server.script = [{"hang": 30}, {"hang": 30}]
    c = client(server.url, timeout_s=0.3, max_retries=1)
    out = await c.chat("scripted", MSG)
    await c.close()
    assert not out.ok and "timed out" in (out.error or "")
    assert [a[0] for a in out.attempts] == [None, None]


async def test_client_reports_a_garbage_body(server: ScriptedServer) -> None:
    """A 200 whose body is not a completion is a malformed response, not a crash."""
    server.script = [{"garbage": "{not json"}]
    c = client(server.url)
    out = await c.chat("scripted", MSG)
    await c.close()
    assert not out.ok and "malformed" in (out.error or "")


def test_client_api_key_prefers_kf_variable() -> None:
    """KF_LLM_API_KEY wins over OPENAI_API_KEY; neither gives None."""
    assert api_key_from_env({"KF_LLM_API_KEY": "a", "OPENAI_API_KEY": "b"}) == "a"
    assert api_key_from_env({"OPENAI_API_KEY": "b"}) == "b"
    assert api_key_from_env({}) is None


def test_parse_full_rewrite() -> None:
    """The python block defining ModelNew becomes the candidate."""
    new = PARENT.replace("x * 2", "x + x")
    edit = parse_edit(f"Here you go:\n```python\n{new}```\nEnjoy.", PARENT)
    assert edit.kind == "rewrite" and "x + x" in edit.source


def test_parse_search_replace_diff() -> None:
    """SEARCH/REPLACE blocks are applied to the parent, tolerating indentation drift."""
    resp = (
        '<<<<<<< SEARCH\nCONFIG = {"BLOCK": 1}\n=======\nCONFIG = {"BLOCK": 2}\n'
        ">>>>>>> REPLACE\n<<<<<<< SEARCH\n  return x * 2\n=======\n"
        "        return x + x\n>>>>>>> REPLACE\n"
    )
    edit = parse_edit(resp, PARENT)
    assert edit.kind == "diff" and edit.blocks == 2
    assert 'CONFIG = {"BLOCK": 2}' in edit.source and "return x + x" in edit.source


@pytest.mark.parametrize(
    ("response", "message"),
    [
        ("no code here", "no ```python block"),
        ("<<<<<<< SEARCH\nnot in parent\n=======\nx\n>>>>>>> REPLACE\n", "does not occur"),
        ("```python\nclass ModelNew(:\n```", "not valid Python"),
        ("```python\nclass Other: pass  # ModelNew\n```", "defines no class ModelNew"),
        (f"```python\n{PARENT}```", "unchanged"),
        ("", "empty"),
        (
            '<<<<<<< SEARCH\nCONFIG = {"BLOCK": 1}\n=======\nCONFIG = {"BLOCK": 7}\n'
            ">>>>>>> REPLACE\n",
            "kf:params",
        ),
    ],
)
def test_parse_rejects_unusable_responses(response: str, message: str) -> None:
    """Garbage, misses, syntax errors and no-ops raise ResponseError naming the problem."""
    with pytest.raises(ResponseError, match=message):
        parse_edit(response, PARENT)


def test_parse_region_takes_the_fenced_text() -> None:
    """A rewritten region is the fenced block's text; an empty one is refused."""
    assert parse_region("Sure!\n```\nUse AVX.\n```") == "Use AVX."
    with pytest.raises(ResponseError):
        parse_region("```\n\n```")


def test_budget_counts_calls_in_flight_tokens_and_money() -> None:
    """Each limit stops further calls once reached; unlimited budgets never do."""
    used = Usage()
    used.add(100, 50, 0.5)
    assert Budget().exhausted(used) is None
    assert "call budget" in (Budget(calls=2).exhausted(used, in_flight=1) or "")
    assert Budget(calls=3).exhausted(used, in_flight=1) is None
    assert "token budget" in (Budget(tokens=150).exhausted(used) or "")
    assert "money budget" in (Budget(usd=0.5).exhausted(used) or "")
