"""Prompt building: the meta-prompt's regions, the mutation prompt and the rewrite prompt.

A meta-prompt is a dict of named regions. ``strategy``, ``pitfalls`` and ``hardware`` are
evolved by the prompt evolver; the answer format is fixed here (the parser depends on it)
and never evolved.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EVOLVABLE_REGIONS",
    "REWRITE_OPERATORS",
    "SEED_REGIONS",
    "Inspiration",
    "MutationContext",
    "mutation_messages",
    "prompt_hash",
    "rewrite_messages",
]

EVOLVABLE_REGIONS = ("strategy", "pitfalls", "hardware")
REWRITE_OPERATORS = ("improve", "specialise", "generalise", "simplify")

SEED_REGIONS: dict[str, str] = {
    "strategy": (
        "Make one focused change that should make the kernel faster while keeping it exactly "
        "correct: fuse passes, improve memory access (contiguous, vectorised), parallelise the "
        "outer loops, or expose a template parameter (kf:params) worth tuning."
    ),
    "pitfalls": (
        "Keep ModelNew's constructor signature and forward's inputs and outputs identical to "
        "the reference. Never modify the inputs in place. Handle every size, not only the "
        "example shapes. Do not cache outputs between calls."
    ),
    "hardware": ("Use the device's cores and vector width; keep working sets within the caches."),
}

_SYSTEM = (
    "You are an expert performance engineer who writes fast, correct kernels for PyTorch "
    "operations. You answer with code only, in the format requested."
)

_FORMAT = (
    "Answer in ONE of two forms:\n"
    "1. the complete new module in a single ```python block; or\n"
    "2. one or more SEARCH/REPLACE blocks against the parent module:\n"
    "<<<<<<< SEARCH\n(exact lines of the parent)\n=======\n(replacement lines)\n"
    ">>>>>>> REPLACE\n"
    "The module must define class ModelNew with the same constructor and forward as the "
    "reference Model. A kf:params block (SPACE and CONFIG dicts between '# --- kf:params ---' "
    "and '# --- kf:end ---') declares template parameters kf will tune."
)


def prompt_hash(messages: Sequence[Mapping[str, str]]) -> str:
    """sha256 of the messages' canonical JSON (what the model saw, exactly)."""
    text = json.dumps([dict(m) for m in messages], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Inspiration:
    """Another elite of the same task shown to the model for ideas."""

    candidate_id: str
    island: int
    cell: tuple[int, int, int] | None
    speedup: float | None
    source: str


@dataclass(frozen=True)
class MutationContext:
    """Everything a mutation prompt is built from."""

    task: str
    reference: str
    parent_id: str
    parent_source: str
    operator: str
    regions: Mapping[str, str]
    parent_speedup: float | None = None
    parent_runtime_ms: float | None = None
    parent_ref_ms: float | None = None
    parent_failure: str | None = None
    parent_build: str | None = None  # registers / shared memory / spills from its compile
    parent_counters: Mapping[str, float] | None = None  # ncu summary of its kernels
    second_parent_source: str | None = None
    inspirations: Sequence[Inspiration] = ()
    failures: Sequence[str] = ()
    device: Mapping[str, Any] = field(default_factory=dict)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "\n# … (truncated)"


def _device_lines(caps: Mapping[str, Any]) -> str:
    keys = (
        "kind",
        "model",
        "isa",
        "logical_cores",
        "physical_cores",
        "simd",
        "l1d_kib",
        "l2_kib",
        "l3_kib",
        "memory_gib",
        "measured_copy_bandwidth_gbs",
        "measured_matmul_gflops",
        "backends",
        "compilers",
    )
    lines = [f"- {k}: {caps[k]}" for k in keys if k in caps and caps[k] not in (None, "", [])]
    if not lines:
        lines = [f"- {k}: {v}" for k, v in sorted(caps.items())[:12]]
    return "\n".join(lines) or "- (no device has announced itself yet)"


def mutation_messages(ctx: MutationContext) -> list[dict[str, str]]:
    """System and user messages asking for an improved child of the parent."""
    r = ctx.regions
    parts = [
        f"# Task `{ctx.task}`: the PyTorch reference\n```python\n{_clip(ctx.reference, 6000)}\n```",
        f"# Target device\n{_device_lines(ctx.device)}",
        f"# Strategy\n{r.get('strategy', '')}",
        f"# Pitfalls\n{r.get('pitfalls', '')}",
        f"# Hardware notes\n{r.get('hardware', '')}",
    ]
    perf = []
    if ctx.parent_speedup is not None:
        perf.append(f"speedup {ctx.parent_speedup:.3f}x over PyTorch eager")
    if ctx.parent_runtime_ms is not None and ctx.parent_ref_ms is not None:
        perf.append(f"{ctx.parent_runtime_ms:.4f} ms vs eager {ctx.parent_ref_ms:.4f} ms")
    if ctx.parent_failure:
        perf.append(f"failed: {ctx.parent_failure}")
    parts.append(
        f"# Parent kernel {ctx.parent_id[:12]} ({'; '.join(perf) or 'not yet timed'})\n"
        f"```python\n{_clip(ctx.parent_source, 12000)}\n```"
    )
    measured = []
    if ctx.parent_build:
        measured.append(f"Compiler report:\n{_clip(ctx.parent_build, 1500)}")
    if ctx.parent_counters:
        c = ctx.parent_counters
        names = {
            "dram_throughput_pct": "DRAM throughput % of peak",
            "sm_throughput_pct": "SM throughput % of peak",
            "achieved_occupancy_pct": "achieved occupancy %",
            "dram_gbs": "DRAM GB/s",
            "kernels": "kernels per call",
        }
        measured.append(
            "Hardware counters (Nsight Compute), one call: "
            + ", ".join(f"{label} {c[k]:.1f}" for k, label in names.items() if k in c)
        )
    if measured:
        parts.append("# What the parent's build and hardware counters say\n" + "\n".join(measured))
    if ctx.second_parent_source:
        parts.append(
            "# Second parent (combine the best ideas of both)\n"
            f"```python\n{_clip(ctx.second_parent_source, 8000)}\n```"
        )
    for ins in ctx.inspirations:
        sp = f"{ins.speedup:.3f}x" if ins.speedup is not None else "untimed"
        parts.append(
            f"# Inspiration {ins.candidate_id[:12]} (island {ins.island}, cell {ins.cell}, {sp})\n"
            f"```python\n{_clip(ins.source, 4000)}\n```"
        )
    if ctx.failures:
        parts.append(
            "# Recent failures of this parent's children (avoid repeating them)\n"
            + "\n".join(f"- {_clip(f, 600)}" for f in ctx.failures)
        )
    verb = "Combine the two parents into" if ctx.second_parent_source else "Write"
    parts.append(f"# Your job\n{verb} a faster, still exactly correct kernel.\n{_FORMAT}")
    return [
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


_OPERATOR_HINTS = {
    "improve": "Make the region more useful: sharper, more concrete advice.",
    "specialise": "Specialise the region for the task and device below.",
    "generalise": "Generalise the region so it helps on any kernel and device.",
    "simplify": "Simplify the region: fewer words, same value.",
}


def rewrite_messages(
    regions: Mapping[str, str],
    region: str,
    operator: str,
    *,
    task: str = "",
    reference: str = "",
    device: Mapping[str, Any] | None = None,
    fitness: str = "",
) -> list[dict[str, str]]:
    """Messages asking a model to rewrite one region of a meta-prompt."""
    others = "\n".join(f"## {k}\n{v}" for k, v in sorted(regions.items()) if k != region)
    body = [
        "You maintain the instructions given to a kernel-writing model. Rewrite ONE region "
        f"of them: region `{region}`, operation `{operator}`. " + _OPERATOR_HINTS.get(operator, ""),
        f"## Current `{region}` region\n{regions.get(region, '')}",
        f"## The other regions (for context, do not repeat them)\n{others}",
    ]
    if fitness:
        body.append(f"## How kernels written with this prompt fared\n{fitness}")
    if task:
        body.append(f"## Task `{task}`\n```python\n{_clip(reference, 3000)}\n```")
    if device:
        body.append(f"## Device\n{_device_lines(device)}")
    body.append("Answer with the new region text only, inside one ``` block.")
    return [
        {"role": "system", "content": "You improve prompts for a kernel-optimisation system."},
        {"role": "user", "content": "\n\n".join(body)},
    ]
