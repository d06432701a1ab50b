"""``kf run``'s LLM options and the run-config keys they become."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_llm_options", "llm_config", "parse_models"]


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
    from kf.backends import parse_languages

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
    for key, value in (
        ("llm_budget_tokens", args.llm_budget_tokens),
        ("llm_budget_calls", args.llm_budget_calls),
        ("llm_budget_usd", args.llm_budget_usd),
    ):
        if value is not None:
            cfg[key] = value
    return cfg
