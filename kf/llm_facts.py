"""The LLM facts: calls to a model recorded verbatim, the LLM budget running out, the
meta-prompt population (seeded, chosen, rewritten) and template parameters tuned per
input shape and device.

Calls, rewrites and tunings are observations (the world answered); seeding a prompt,
choosing one for a selection and asking for a rewrite are decisions of the prompt
evolver, recomputed by ``kf replay --check``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kf.events import Decision, Observation, event

__all__ = [
    "ConfigTuned",
    "EpisodeEnded",
    "LlmAttempt",
    "LlmBudgetExhausted",
    "LlmCalled",
    "LlmMessage",
    "LlmToolCall",
    "PromptChosen",
    "PromptRewriteFailed",
    "PromptRewriteRequested",
    "PromptRewritten",
    "PromptSeeded",
    "ToolCalled",
    "TuningTrial",
]


class LlmMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One chat message as sent to the model."""

    role: str
    content: str
    tool_call_id: str = ""  # a tool result (role "tool"): the call it answers


class LlmToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call a model asked for: its id, the tool's name and the arguments verbatim."""

    id: str
    name: str
    arguments: str = ""  # the JSON text the model wrote (maybe malformed)


class LlmAttempt(msgspec.Struct, frozen=True, kw_only=True):
    """One HTTP attempt of a call: its status (None: no answer), error and latency."""

    status: int | None = None
    error: str | None = None
    latency_s: float = 0.0


@event("llm.called")
class LlmCalled(Observation, frozen=True, kw_only=True):
    """kf called a model: the request and the response (or the error), verbatim, with usage."""

    call_id: str
    purpose: str  # mutate | prompt_rewrite
    model: str
    base_url: str
    parameters: dict[str, Any] = {}
    prompt_hash: str = ""
    messages: tuple[LlmMessage, ...] = ()
    response: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0
    attempts: tuple[LlmAttempt, ...] = ()
    error: str | None = None
    task: str = ""
    selection: int | None = None
    prompt_id: str = ""
    language: str = ""  # the kernel language asked for (mutations)
    prompt_tokens_estimated: int = 0  # kf's estimate before sending (for --llm-max-context)
    truncated: tuple[str, ...] = ()  # what was cut from the prompt to fit, and how much
    queued_s: float = 0.0  # seconds waiting for a --llm-concurrency slot (not in latency_s)
    # a turn of a tool-using episode: its id and turn number, and the tools the model
    # called; ``messages`` then holds only what was added since the previous turn (the
    # tool results and notes; the model's own message is the previous turn's response)
    episode: str = ""
    turn: int = 0
    tool_calls: tuple[LlmToolCall, ...] = ()


@event("llm.budget_exhausted")
class LlmBudgetExhausted(Observation, frozen=True, kw_only=True):
    """The run's LLM budget (tokens, calls or money) is spent; no more selections are made."""

    reason: str
    calls: int = 0
    tokens: int = 0
    cost_usd: float = 0.0


@event("prompt.seeded")
class PromptSeeded(Decision, frozen=True, kw_only=True):
    """The prompt evolver put a built-in meta-prompt into the population."""

    prompt_id: str
    regions: dict[str, str]


@event("prompt.chosen")
class PromptChosen(Decision, frozen=True, kw_only=True):
    """The prompt evolver chose the meta-prompt and model answering a parent selection."""

    task: str
    selection: int
    island: int
    operator: str
    parent_id: str
    prompt_id: str
    model: str
    second_parent_id: str | None = None
    rng_seed: int = 0
    language: str = ""  # the kernel language the selection asked for ("": any)
    evidence: tuple[str, ...] = ()  # failed candidates whose evidence the prompt carries
    # which mutator answers: "" the single-shot LLM call, "tools" a tool-using episode,
    # "cli" a coding-agent CLI (drawn by the run config's ``mutator_weights``)
    agent: str = ""
    # lessons from the run's library (``lesson.loaded``) the prompt quotes, chosen from the
    # task's features and the parent's diagnosis within a token budget (issue 48)
    lessons: tuple[str, ...] = ()
    # issue 48 (search version 7): a selection whose prompt quotes lessons is answered
    # twice, "lessons" with them and "control" without (same parent, prompt and model)
    arm: str = ""


@event("prompt.rewrite_requested")
class PromptRewriteRequested(Decision, frozen=True, kw_only=True):
    """The prompt evolver asked for one region of a meta-prompt to be rewritten by a model."""

    request: int
    prompt_id: str  # the parent prompt
    new_prompt_id: str
    operator: str  # improve | specialise | generalise | simplify
    region: str
    model: str
    task: str = ""
    fitness: str = ""  # how kernels written with the parent prompt fared, for the rewriter
    rng_seed: int = 0


@event("prompt.rewritten")
class PromptRewritten(Observation, frozen=True, kw_only=True):
    """A model rewrote a region of a meta-prompt; the new prompt joins the population."""

    request: int
    prompt_id: str
    parent_prompt_id: str
    operator: str
    region: str
    regions: dict[str, str]
    call_id: str
    model: str = ""


@event("prompt.rewrite_failed")
class PromptRewriteFailed(Observation, frozen=True, kw_only=True):
    """A requested prompt rewrite produced nothing usable (the reason says why)."""

    request: int
    parent_prompt_id: str
    reason: str
    call_id: str = ""


class TuningTrial(msgspec.Struct, frozen=True, kw_only=True):
    """One configuration timed for one input shape."""

    config: dict[str, Any]
    ok: bool
    runtime_ms: float = 0.0
    runtime_std_ms: float = 0.0
    ref_runtime_ms: float = 0.0
    error: str | None = None
    runtime_ci95_ms: float = 0.0


@event("tuning.config_tuned")
class ConfigTuned(Observation, frozen=True, kw_only=True):
    """A tuner timed configurations of a candidate's template on one input shape and device."""

    task: str
    candidate_id: str
    device_id: str
    family: str
    shape_index: int
    shape: str  # e.g. "[[64, 256]]": the input shapes of that shape set
    baseline_config: dict[str, Any]
    best_config: dict[str, Any] | None = None
    best_ms: float | None = None
    baseline_ms: float | None = None
    trials: tuple[TuningTrial, ...] = ()
    note: str = ""
    # search version 3: the answer to a ``search.tuning_requested`` (``last`` marks the
    # final shape set of the request); shape set 0 is then the task's own ``get_inputs()``
    requested: bool = False
    last: bool = False
    improved: bool = False  # best beat the baseline by more than the two timings' noise


@event("episode.tool_called")
class ToolCalled(Observation, frozen=True, kw_only=True):
    """A mutator's episode ran one tool for its model or agent; never enters the archive.

    ``result`` is what the model was shown; ``ran_on`` the device whose sandboxed runners
    ran it ("" for tools answered from the log, such as ``show_elite``).
    """

    episode: str
    tool: str
    task: str = ""
    selection: int | None = None
    turn: int = 0
    index: int = 0  # the episode's n-th tool call
    call_id: str = ""  # the model's id of the call
    arguments: str = ""  # verbatim
    ok: bool = False
    result: str = ""
    summary: dict[str, Any] = {}
    error: str | None = None  # the tool could not run (no device, timeout, malformed call)
    ran_on: str = ""
    latency_s: float = 0.0


@event("episode.ended")
class EpisodeEnded(Observation, frozen=True, kw_only=True):
    """A tool-using or coding-agent episode ended: how (``ended``), why, and what it cost.

    ``ended`` is ``answered`` (the model or agent gave a candidate), ``limit`` (turns, tool
    calls, tokens or wall time ran out), ``malformed`` (a tool call kf could not run),
    ``crash`` (the model call, a tool or the agent failed) or ``no_answer``.
    """

    episode: str
    kind: str  # tools | cli
    task: str
    selection: int | None = None
    model: str = ""
    ended: str = "answered"
    cause: str = ""
    candidate_id: str = ""
    turns: int = 0
    tool_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    command: str = ""  # cli: the command run
    exit_code: int | None = None  # cli
    transcript: str = ""  # cli: the command's output, trimmed
    files: tuple[str, ...] = ()  # cli: what the agent left in its folder
