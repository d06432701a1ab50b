"""``kf run``'s LLM options and the run-config keys they become."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = [
    "MUTATOR_KINDS",
    "add_agent_options",
    "add_llm_options",
    "agent_config",
    "llm_config",
    "parse_models",
    "parse_mutators",
]


def add_llm_options(p: argparse.ArgumentParser) -> None:
    """``--llm-url``, ``--model NAME[=WEIGHT]`` (repeatable), budgets, timeouts, prices."""
    p.add_argument(
        "--llm-url",
        metavar="URL",
        help="OpenAI-compatible base URL (http://host:8000/v1); key from KF_LLM_API_KEY "
        "or OPENAI_API_KEY",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME[=WEIGHT]",
        help="model to call (repeatable: an ensemble, chosen per call by weight)",
    )
    p.add_argument("--llm-budget-tokens", type=int, metavar="N", help="stop after N tokens")
    p.add_argument("--llm-budget-calls", type=int, metavar="N", help="stop after N LLM calls")
    p.add_argument("--llm-budget-usd", type=float, metavar="USD", help="stop after this spend")
    p.add_argument("--llm-timeout", type=float, default=120.0, help="seconds per LLM attempt")
    p.add_argument("--llm-retries", type=int, default=4, help="retries on 429/5xx/timeouts")
    p.add_argument("--llm-concurrency", type=int, default=4, help="LLM calls at once")
    p.add_argument(
        "--llm-max-context",
        type=int,
        default=32768,
        metavar="TOKENS",
        help="the model's context window (estimated tokens); prompts are cut to fit, and "
        "what was cut is recorded",
    )
    p.add_argument(
        "--llm-max-tokens", type=int, default=4096, metavar="TOKENS", help="tokens per answer"
    )
    p.add_argument(
        "--init",
        type=int,
        default=4,
        metavar="N",
        help="first-generation kernels the LLM writes from the reference per task (and per "
        "retry round when none is correct)",
    )
    p.add_argument(
        "--init-with-seeds",
        action="store_true",
        help="also write a first generation for tasks that have seed kernels",
    )
    p.add_argument(
        "--language",
        default="auto",
        metavar="LANGS",
        help="languages the LLM writes: auto (every one the device runs: cuda,triton on a "
        "GPU; cpp on a CPU) or a comma list",
    )
    p.add_argument(
        "--llm-usd-per-mtok",
        nargs=2,
        type=float,
        default=(0.0, 0.0),
        metavar=("IN", "OUT"),
        help="price per million prompt and completion tokens (for cost and --llm-budget-usd)",
    )
    add_agent_options(p)


def add_agent_options(p: argparse.ArgumentParser) -> None:
    """``--mutators``, ``--agent-cmd`` and the per-episode limits of tool-using mutators."""
    p.add_argument(
        "--mutators",
        metavar="KIND=W,...",
        help="which mutator answers each selection, drawn by weight: single (one LLM call), "
        "tools (the model calls compile/check/time before it answers), cli (--agent-cmd); "
        "e.g. single=2,tools=1,cli=1 (default: single only, or cli with --agent-cmd)",
    )
    p.add_argument(
        "--agent-cmd",
        metavar="TEMPLATE",
        help="a coding-agent command run in a scratch folder with TASK.md, the parent and a "
        "./check script; it leaves its kernel in model_new.py. {dir}, {task_file}, {prompt}, "
        "{model_file}, {check} are replaced (shell-quoted)",
    )
    p.add_argument(
        "--agent-timeout", type=float, default=600.0, metavar="S", help="seconds per agent run"
    )
    p.add_argument("--tool-turns", type=int, default=8, help="model turns per tool episode")
    p.add_argument("--tool-calls", type=int, default=12, help="tool calls per episode")
    p.add_argument("--tool-tokens", type=int, default=200_000, help="tokens per tool episode")
    p.add_argument(
        "--tool-seconds", type=float, default=900.0, help="wall seconds per tool episode"
    )


MUTATOR_KINDS = ("single", "tools", "cli")


def parse_mutators(spec: str) -> list[tuple[str, float]]:
    """``"single=2,tools=1"`` → ``[("single", 2.0), ("tools", 1.0)]``; ValueError if bad."""
    out: list[tuple[str, float]] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, weight = part.partition("=")
        if name not in MUTATOR_KINDS:
            raise ValueError(
                f"--mutators: unknown kind {name!r} (known: {', '.join(MUTATOR_KINDS)})"
            )
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"--mutators {part!r}: the weight must be a number") from None
        if w < 0:
            raise ValueError(f"--mutators {part!r}: the weight must be ≥ 0")
        out.append((name, w))
    if not any(w > 0 for _, w in out):
        raise ValueError("--mutators needs at least one kind with a positive weight")
    return out


def agent_config(args: argparse.Namespace) -> dict[str, Any] | str:
    """The run-config keys of ``--mutators``/``--agent-cmd`` (empty when neither), or an error."""
    spec = getattr(args, "mutators", None)
    cmd = getattr(args, "agent_cmd", None)
    if not spec and not cmd:
        return {}
    try:
        weights = parse_mutators(spec) if spec else [("cli", 1.0)]
    except ValueError as exc:
        return str(exc)
    if any(n == "cli" and w > 0 for n, w in weights) and not cmd:
        return "--mutators cli=… needs --agent-cmd 'TEMPLATE'"
    if min(args.tool_turns, args.tool_calls, args.tool_tokens) < 1 or args.tool_seconds <= 0:
        return "--tool-turns, --tool-calls, --tool-tokens and --tool-seconds must be positive"
    if args.agent_timeout <= 0:
        return "--agent-timeout must be positive"
    cfg: dict[str, Any] = {
        "mutator_weights": [[n, w] for n, w in weights],
        "tool_turns": args.tool_turns,
        "tool_calls": args.tool_calls,
        "tool_tokens": args.tool_tokens,
        "tool_seconds": args.tool_seconds,
    }
    if cmd:
        cfg["agent_cmd"] = cmd
        cfg["agent_timeout_s"] = args.agent_timeout
    return cfg


def parse_models(specs: list[str]) -> list[tuple[str, float]]:
    """``["a=2", "b"]`` → ``[("a", 2.0), ("b", 1.0)]``; ValueError for a bad weight."""
    out: list[tuple[str, float]] = []
    for spec in specs:
        name, sep, weight = spec.rpartition("=") if "=" in spec else (spec, "", "")
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"--model {spec!r}: the weight must be a number") from None
        if not name or w < 0:
            raise ValueError(f"--model {spec!r}: expected NAME or NAME=WEIGHT (weight ≥ 0)")
        out.append((name, w))
    return out


def llm_config(args: argparse.Namespace) -> dict[str, Any] | str:
    """The run-config keys of the LLM options (empty without ``--llm-url``), or an error."""
    if not args.llm_url:
        if args.model:
            return "--model needs --llm-url"
        if getattr(args, "mutators", None) or getattr(args, "agent_cmd", None):
            return (
                "--mutators and --agent-cmd need --llm-url and --model (the model also "
                "writes prompt rewrites)"
            )
        return {}
    if not args.model:
        return "--llm-url needs at least one --model NAME[=WEIGHT]"
    try:
        models = parse_models(args.model)
    except ValueError as exc:
        return str(exc)
    if not any(w > 0 for _, w in models):
        return "at least one --model needs a positive weight"
    if args.init < 0:
        return "--init must be 0 or more"
    if args.llm_max_context <= args.llm_max_tokens // 2 or args.llm_max_tokens < 16:
        return "--llm-max-context must leave room for --llm-max-tokens (and that at least 16)"
    from kf.kernels.backends import parse_languages

    try:
        languages = parse_languages(args.language, getattr(args, "device", "cpu"))
    except ValueError as exc:
        return str(exc)
    names = ", ".join(m for m, _ in models)
    cfg: dict[str, Any] = {
        "llm_url": args.llm_url,
        "llm_models": [[m, w] for m, w in models],
        "mutator": f"llm: {names} via {args.llm_url}",
        "llm_timeout_s": args.llm_timeout,
        "llm_max_retries": args.llm_retries,
        "llm_concurrency": args.llm_concurrency,
        "llm_lookahead": args.llm_concurrency,
        "llm_max_context": args.llm_max_context,
        "llm_max_tokens": args.llm_max_tokens,
        "init": args.init,
        "init_with_seeds": bool(args.init_with_seeds),
        "llm_usd_per_mtok_in": args.llm_usd_per_mtok[0],
        "llm_usd_per_mtok_out": args.llm_usd_per_mtok[1],
    }
    cfg["languages"] = languages
    agents = agent_config(args)
    if isinstance(agents, str):
        return agents
    cfg.update(agents)
    kinds = {n for n, w in agents.get("mutator_weights", ()) if w > 0}
    if kinds - {"single"}:
        cfg["mutator"] = "; ".join(
            label
            for kind, label in (
                ("single", f"llm: {names} via {args.llm_url}"),
                ("tools", f"llm+tools: {names} via {args.llm_url}"),
                ("cli", f"agent-cmd: {agents.get('agent_cmd', '')}"),
            )
            if kind in kinds
        )
    for key, value in (
        ("llm_budget_tokens", args.llm_budget_tokens),
        ("llm_budget_calls", args.llm_budget_calls),
        ("llm_budget_usd", args.llm_budget_usd),
    ):
        if value is not None:
            cfg[key] = value
    return cfg
