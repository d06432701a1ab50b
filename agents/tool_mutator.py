"""A tool-using mutation: an episode in which the model tests its kernel before it answers.

The model gets the usual prompt (a mutation's or a first generation's, :mod:`kf.llm.prompts`)
and OpenAI function tools (:mod:`kf.llm.tools`): ``compile``, ``check``, ``time``,
``counters`` on a GPU — run on a device of the run, in its sandboxed runners, by the
worker that hosts it (:mod:`agents.tool_server`) — and ``show_elite``, answered from the
log. It may call them over several turns; the message it ends with, without tool calls,
is its answer in the usual format (a whole module or SEARCH/REPLACE blocks), read by the
usual parser. That candidate then goes through the normal pipeline like any other; tool
runs never enter the archive.

Recorded: every model turn is an ``llm.called`` (with ``episode``, ``turn`` and the tool
calls it asked for), every tool result an ``episode.tool_called``, and the episode's end
an ``episode.ended`` with its cause and cost. Limits per episode
(:class:`~kf.llm.tools.ToolLimits`): turns (the last turn offers no tools and asks for
the answer), tool calls, tokens and wall time. An episode cut short (a limit, a failed
model call, a malformed tool call) is recorded with that cause; when it had a source that
``check`` passed, that source is its candidate (the note says so), else the selection's
mutation failed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kf.llm.client import CallOutcome
from kf.llm.parse import ResponseError, parse_edit
from kf.llm.prompts import Prompt
from kf.llm.tools import DEVICE_TOOLS, ToolLimits, ToolReply, ToolRequestError, parse_arguments
from kf.llm_facts import EpisodeEnded, LlmCalled, ToolCalled

__all__ = [
    "Elite",
    "EpisodeOf",
    "EpisodeResult",
    "EpisodeSpec",
    "episode_ended",
    "run_episode",
    "tool_called",
    "tools_note",
]

# (full conversation, messages to record, turn, tools offered) → the recorded call
CallFn = Callable[
    [list[dict[str, Any]], list[dict[str, Any]], int, list[dict[str, Any]] | None],
    Awaitable[tuple[LlmCalled, CallOutcome]],
]
ToolFn = Callable[[str, str], Awaitable[ToolReply]]  # (tool, source) → reply


@dataclass(frozen=True)
class Elite:
    """What ``show_elite`` shows of a kernel of the task."""

    id: str
    source: str
    speedup: float | None = None
    cell: tuple[int, int, int] | None = None
    island: int = 0


@dataclass
class EpisodeSpec:
    """One episode's inputs."""

    episode: str
    task: str
    selection: int | None
    model: str
    prompt: Prompt
    parent: str | None  # the parent's source (SEARCH/REPLACE answers apply to it)
    limits: ToolLimits
    tools: list[dict[str, Any]]  # the OpenAI tool specs offered
    elites: dict[str, Elite] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # sha256 of sources already proposed
    budget_left: Callable[[], str | None] = lambda: None


@dataclass
class EpisodeResult:
    """The recorded events, and the candidate's source (None: no candidate) or why not."""

    events: list[Any]
    source: str | None
    kind: str = "rewrite"
    notes: tuple[str, ...] = ()
    reason: str = ""
    ended: EpisodeEnded | None = None


class EpisodeOf(Protocol):
    """What an episode's spec (of either kind: tools, cli) says it is for."""

    episode: str
    task: str
    selection: int | None
    model: str


def episode_ended(
    spec: EpisodeOf, kind: str, ended: str, cause: str, t0: float, **cost: Any
) -> EpisodeEnded:
    """The end of ``spec``'s episode of ``kind`` (tools, cli), begun at monotonic ``t0``:
    ``ended`` for ``cause``; ``cost`` holds the kind's own fields (turns, tokens, command)."""
    return EpisodeEnded(
        episode=spec.episode,
        kind=kind,
        task=spec.task,
        selection=spec.selection,
        model=spec.model,
        ended=ended,
        cause=cause,
        seconds=time.monotonic() - t0,
        **cost,
    )


def tool_called(
    spec: EpisodeOf, name: str, index: int, arguments: str, reply: ToolReply, **call: Any
) -> ToolCalled:
    """The record of ``spec``'s episode's ``index``-th tool call, ``name`` with ``arguments``
    (verbatim), answered ``reply``; ``call``: a tools episode's turn and the model's id of
    the call (``turn``, ``call_id``)."""
    return ToolCalled(
        episode=spec.episode,
        tool=name,
        task=spec.task,
        selection=spec.selection,
        index=index,
        arguments=arguments,
        ok=reply.ok,
        result=reply.text,
        summary=reply.summary,
        error=reply.error,
        ran_on=reply.ran_on,
        latency_s=reply.latency_s,
        **call,
    )


def tools_note(tools: list[dict[str, Any]], limits: ToolLimits) -> str:
    """The section added to the prompt: the tools and the limits."""
    names = ", ".join(f"`{t['function']['name']}`" for t in tools)
    return (
        "\n\n## Tools\n"
        f"You may call these tools before you answer: {names}. `compile`, `check` and "
        "`time` take the whole module (defining ModelNew) as `source` and run it in kf's "
        "sandbox on the target device; `show_elite` takes an elite's id (or 'list'). "
        "Test your kernel: compile it, check it is correct, time it, fix what fails. "
        f"You have at most {limits.turns} turns and {limits.tool_calls} tool calls. When "
        "you are done, reply WITHOUT tool calls: that reply is your answer, in the answer "
        "format above."
    )


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def _show_elite(spec: EpisodeSpec, ident: str) -> ToolReply:
    if ident.strip().lower() == "list" or ident not in spec.elites:
        listing = "\n".join(
            f"- {e.id}: island {e.island}, cell {e.cell}, "
            + (f"{e.speedup:.3f}x" if e.speedup else "not timed")
            for e in spec.elites.values()
        )
        head = "" if ident.strip().lower() == "list" else f"no elite {ident!r}. "
        return ToolReply(
            ok=ident in spec.elites,
            text=head + ("elites of this task:\n" + listing if listing else "no elites yet"),
        )
    e = spec.elites[ident]
    speed = f"{e.speedup:.3f}x against eager" if e.speedup else "not timed"
    return ToolReply(
        ok=True,
        text=f"elite {e.id} (island {e.island}, cell {e.cell}, {speed}):\n```python\n"
        f"{e.source}\n```",
        summary={"speedup": e.speedup or 0.0},
    )


async def run_episode(spec: EpisodeSpec, call: CallFn, tool: ToolFn) -> EpisodeResult:
    """Play one episode to its end; never raises for the model's or a tool's failures."""
    lim = spec.limits
    names = {t["function"]["name"] for t in spec.tools}
    conv: list[dict[str, Any]] = [dict(m) for m in spec.prompt.messages]
    conv[-1] = {**conv[-1], "content": conv[-1]["content"] + tools_note(spec.tools, lim)}
    new: list[dict[str, Any]] = list(conv)
    events: list[Any] = []
    t0 = time.monotonic()
    pin = pout = calls = turns = 0
    ended, cause = "", ""
    last_checked: str | None = None
    answer: tuple[str, str, tuple[str, ...]] | None = None  # source, kind, notes

    def record_tool(turn: int, cid: str, name: str, arguments: str, reply: ToolReply) -> None:
        events.append(tool_called(spec, name, calls, arguments, reply, turn=turn, call_id=cid))

    for turn in range(lim.turns):
        if time.monotonic() - t0 > lim.seconds:
            ended, cause = "limit", f"wall time: {lim.seconds:g} s spent"
            break
        if pin + pout >= lim.tokens:
            ended, cause = "limit", f"tokens: {pin + pout} of {lim.tokens} used"
            break
        spent = spec.budget_left()
        if spent is not None:
            ended, cause = "limit", spent
            break
        last = turn == lim.turns - 1
        if last and turn > 0:
            note = {
                "role": "user",
                "content": "No tool turns are left: answer now with your best module, in the "
                "answer format, without tool calls.",
            }
            conv.append(note)
            new.append(note)
        called, out = await call(conv, new, turn, None if last else spec.tools)
        events.append(called)
        turns += 1
        pin += out.prompt_tokens
        pout += out.completion_tokens
        if not out.ok:
            ended, cause = "crash", f"LLM call failed: {out.error}"
            break
        if not out.tool_calls:
            try:
                edit = parse_edit(out.response or "", spec.parent, finish_reason=out.finish_reason)
            except ResponseError as exc:
                ended, cause = "no_answer", f"unusable LLM response: {exc}"
                break
            answer = (edit.source, edit.kind, tuple(edit.notes))
            ended = "answered"
            break
        conv.append(
            {
                "role": "assistant",
                "content": out.response or None,
                "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                    for cid, n, a in out.tool_calls
                ],
            }
        )
        new = []
        for cid, name, arguments in out.tool_calls:
            if calls >= lim.tool_calls:
                ended, cause = "limit", f"tool calls: all {lim.tool_calls} made"
                break
            calls += 1
            try:
                args = parse_arguments(name, arguments, names)
            except ToolRequestError as exc:
                record_tool(
                    turn, cid, name, arguments, ToolReply(ok=False, text="", error=str(exc))
                )
                ended, cause = "malformed", f"malformed tool call: {exc}"
                break
            if name in DEVICE_TOOLS:
                try:
                    reply = await tool(name, args["source"])
                except Exception as exc:  # a tool that could not run: recorded, episode ends
                    reply = ToolReply(ok=False, text="", error=f"{type(exc).__name__}: {exc}")
                    record_tool(turn, cid, name, arguments, reply)
                    ended, cause = "crash", f"tool {name} failed: {reply.error}"
                    break
            else:
                reply = _show_elite(spec, args["id"])
            record_tool(turn, cid, name, arguments, reply)
            if name == "check" and reply.ok:
                last_checked = args["source"]
            msg = {"role": "tool", "tool_call_id": cid, "content": reply.text or reply.error or ""}
            conv.append(msg)
            new.append(msg)
        if ended:
            break
    else:
        ended, cause = "limit", f"turns: all {lim.turns} taken"

    source: str | None = None
    kind, reason = "rewrite", ""
    notes: tuple[str, ...] = ()
    if answer is not None:
        source, kind, notes = answer
    elif last_checked is not None:
        source, kind = last_checked, "rewrite"
        notes = (f"episode cut short ({cause}); took the last source `check` passed",)
    else:
        reason = f"tool episode ended without a candidate ({ended}: {cause})"
    if source is not None and _digest(source) in spec.seen:
        reason = "the episode's candidate duplicates one already proposed"
        source = None
    tokens = {"prompt_tokens": pin, "completion_tokens": pout}
    end = episode_ended(spec, "tools", ended, cause, t0, turns=turns, tool_calls=calls, **tokens)
    return EpisodeResult(
        events=events, source=source, kind=kind, notes=notes, reason=reason, ended=end
    )
