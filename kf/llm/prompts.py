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
    "LANGUAGE_GUIDES",
    "REWRITE_OPERATORS",
    "SEED_REGIONS",
    "Attempt",
    "Inspiration",
    "MutationContext",
    "Prompt",
    "Section",
    "dtype_line",
    "estimate_tokens",
    "fit_sections",
    "init_messages",
    "mutation_messages",
    "mutation_prompt",
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

_PARAMS_FORMAT = (
    "Template parameters (optional): a kernel may declare the choices it could be built with "
    "(block sizes, unrolling, thread counts, schedules, vector widths...) in one block at "
    "module level, as plain Python literals:\n"
    "# --- kf:params ---\n"
    'SPACE = {"BLOCK": [256, 512, 1024], "UNROLL": [1, 2, 4], "THREADS": [1, 2]}\n'
    'CONFIG = {"BLOCK": 512, "UNROLL": 2, "THREADS": 2}\n'
    "# --- kf:end ---\n"
    "SPACE maps each parameter (a C identifier) to a list of values (int, float, str or bool); "
    "CONFIG picks one value of each, on lines of its own. The module reads CONFIG when "
    "it builds (for example kf.native.build(SOURCE, defines=CONFIG) turns each entry into a "
    "-D define), and every CONFIG in SPACE must give a correct kernel. kf then tunes CONFIG "
    "for each input shape and device, and uses the best per shape."
)

_FORMAT = (
    "Answer in ONE of two forms:\n"
    "1. the complete new module in a single ```python block; or\n"
    "2. one or more SEARCH/REPLACE blocks against the parent module:\n"
    "<<<<<<< SEARCH\n(exact lines of the parent)\n=======\n(replacement lines)\n"
    ">>>>>>> REPLACE\n"
    "The module must define class ModelNew with the same constructor and forward as the "
    "reference Model.\n" + _PARAMS_FORMAT
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
    parent_outcome: str = ""  # the parent's evidence: errors, failing trials, timings
    language: str = ""
    lessons: str = ""  # lessons from earlier runs, quoted as data (kf.llm.lessons.quoted)


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


@dataclass(frozen=True)
class Attempt:
    """An earlier candidate shown to the model with what became of it."""

    candidate_id: str
    source: str
    outcome: str
    language: str = ""


@dataclass(frozen=True)
class Section:
    """One part of a prompt; ``drop`` orders what is cut first when the prompt is too long
    (0: never dropped), ``clip`` whether it may be shortened instead."""

    name: str
    text: str
    drop: int = 0
    clip: bool = False


@dataclass(frozen=True)
class Prompt:
    """Messages ready to send, kf's token estimate and what was cut to fit the context."""

    messages: list[dict[str, str]]
    tokens: int
    truncated: tuple[str, ...] = ()


LANGUAGE_GUIDES: dict[str, str] = {
    "cuda": (
        "Language: CUDA C++ on the GPU, built with torch.utils.cpp_extension.load_inline as "
        "KernelBench does. Keep PyTorch's headers out of the CUDA code, which then builds in "
        "seconds rather than a minute: `cuda_sources` holds the kernels and a plain C++ "
        "launcher (#include <cuda_runtime.h>; raw pointers, sizes and a cudaStream_t; no "
        "torch headers); `cpp_sources` holds #include <torch/extension.h> and "
        "<c10/cuda/CUDAStream.h>, the launcher's declaration and the wrapper taking and "
        "returning torch::Tensor, which checks the inputs, allocates the outputs and calls "
        "the launcher on c10::cuda::getCurrentCUDAStream(). Call load_inline(name=..., "
        "cpp_sources=..., cuda_sources=..., functions=[...], extra_cuda_cflags=['-O3']) at "
        "module level. ModelNew.forward calls the wrapper. Inputs arrive on the GPU; check "
        "bounds and handle any size."
    ),
    "triton": (
        "Language: Triton on the GPU: `import triton`, `import triton.language as tl`, one or "
        "more @triton.jit kernels, launched from ModelNew.forward with a grid computed from "
        "the input sizes (mask the tails). Inputs arrive on the GPU; allocate outputs with "
        "torch.empty on the inputs' device."
    ),
    "cpp": (
        "Language: C++ with OpenMP on the CPU. Build it with kf.native.build(source, "
        "defines={...}) (a g++ -O3 -march=native -fopenmp call returning a ctypes library; "
        'declare functions extern "C" and pass data_ptr()s and sizes) or with '
        "torch.utils.cpp_extension.load_inline(name=..., cpp_sources=..., functions=[...], "
        "extra_cflags=['-O3', '-fopenmp'], extra_ldflags=['-fopenmp']). Parallelise the outer "
        "loops with `#pragma omp parallel for` and vectorise the inner ones."
    ),
}

_INIT_FORMAT = (
    "Answer with the complete module in a single ```python block. It must define class "
    "ModelNew with the same constructor arguments and forward inputs and outputs as the "
    "reference Model, and compute forward with your own kernel (not with the PyTorch ops of "
    "the reference).\n" + _PARAMS_FORMAT
)


def estimate_tokens(text: str) -> int:
    """A conservative token estimate (about 3 characters a token for code and prose)."""
    return len(text) // 3 + 1


def fit_sections(
    sections: Sequence[Section], budget_tokens: int | None
) -> tuple[str, tuple[str, ...]]:
    """Join the sections, dropping (highest ``drop`` first, later ones first among equals)
    and then clipping what may be clipped until the estimate fits; say what was cut."""
    parts = list(sections)
    cut: list[str] = []

    def size() -> int:
        return estimate_tokens("\n\n".join(p.text for p in parts))

    if budget_tokens is None or size() <= budget_tokens:
        return "\n\n".join(p.text for p in parts), ()
    order = sorted(
        (i for i, p in enumerate(parts) if p.drop > 0), key=lambda i: (-parts[i].drop, -i)
    )
    dropped: set[int] = set()
    for i in order:
        if size() <= budget_tokens:
            break
        dropped.add(i)
        cut.append(f"{parts[i].name} dropped ({len(parts[i].text)} chars)")
        parts[i] = Section(name=parts[i].name, text="", drop=parts[i].drop)
    parts_kept = [p for i, p in enumerate(parts) if i not in dropped]
    parts = parts_kept
    while size() > budget_tokens:
        clippable = [i for i, p in enumerate(parts) if p.clip and len(p.text) > 400]
        if not clippable:
            break
        i = max(clippable, key=lambda j: len(parts[j].text))
        over_chars = (size() - budget_tokens) * 3 + 64
        keep = max(400, len(parts[i].text) - over_chars)
        text = parts[i].text
        head, tail = text[: keep * 2 // 3], text[len(text) - keep // 3 :]
        clipped = f"{head}\n# … ({len(text) - keep} characters cut to fit the context) …\n{tail}"
        cut.append(f"{parts[i].name} clipped from {len(text)} to {keep} chars")
        parts[i] = Section(name=parts[i].name, text=clipped, drop=parts[i].drop, clip=False)
    return "\n\n".join(p.text for p in parts), tuple(cut)


def _messages(sections: Sequence[Section], budget_tokens: int | None, system: str = "") -> Prompt:
    system = system or _SYSTEM
    room = None if budget_tokens is None else max(256, budget_tokens - estimate_tokens(system))
    user, cut = fit_sections(sections, room)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return Prompt(messages, estimate_tokens(system) + estimate_tokens(user), cut)


def _attempt_sections(title: str, attempts: Sequence[Attempt], drop: int) -> list[Section]:
    out = []
    for a in attempts:
        lang = f", {a.language}" if a.language else ""
        out.append(
            Section(
                name=f"outcome of {a.candidate_id[:12]}",
                text=f"# {title} {a.candidate_id[:12]}{lang}: what happened\n{a.outcome}",
                drop=drop,
            )
        )
        out.append(
            Section(
                name=f"source of {a.candidate_id[:12]}",
                text=f"```python\n{_clip(a.source, 8000)}\n```",
                drop=drop + 2,
                clip=True,
            )
        )
    return out


_HALF_NAMES = {
    "bfloat16": ("torch.bfloat16", ".bfloat16()", "torch.bf16"),
    "float16": ("torch.float16", "torch.half", ".half()"),
}


def dtype_line(reference: str) -> str:
    """What the prompt says of the task's dtypes, read from the reference's text: the
    half types it names (bf16 and fp16 kept as the model has them), or float32."""
    found = [
        name for name, spellings in _HALF_NAMES.items() if any(s in reference for s in spellings)
    ]
    if not found:
        return "The reference's tensors are float32 unless its code says otherwise."
    names = " and ".join(found)
    return (
        f"The reference uses {names} tensors: take the inputs in the dtypes the reference "
        "gets, and return each output in the reference's output dtype (a "
        f"{found[0]} output stays {found[0]}; an output of another dtype is rejected). "
        "Accumulate sums and dot products in float32. Outputs are judged at atol=rtol=1e-2 "
        "for half types, else within 3x eager's own error against a float64 run."
    )


def _opening(
    task: str,
    reference: str,
    device: Mapping[str, Any],
    language: str | None,
    regions: Mapping[str, str],
) -> list[Section]:
    """What every prompt opens with: the task's reference, the target device, the guide of
    the kernel's language (none for ``None``), and the meta-prompt's strategy, pitfalls and
    hardware notes."""
    sections = [
        Section(
            name="reference",
            text=f"# Task `{task}`: the PyTorch reference\n```python\n{reference}\n```",
            clip=True,
        ),
        Section(name="dtypes", text=f"# Dtypes\n{dtype_line(reference)}"),
        Section(name="device", text=f"# Target device\n{_device_lines(device)}", drop=3),
    ]
    if language is not None:
        sections.append(
            Section(name="language", text=f"# {LANGUAGE_GUIDES.get(language, language)}")
        )
    return [
        *sections,
        Section(name="strategy", text=f"# Strategy\n{regions.get('strategy', '')}", drop=2),
        Section(name="pitfalls", text=f"# Pitfalls\n{regions.get('pitfalls', '')}", drop=1),
        Section(name="hardware", text=f"# Hardware notes\n{regions.get('hardware', '')}", drop=3),
    ]


def init_messages(
    task: str,
    reference: str,
    language: str,
    regions: Mapping[str, str],
    device: Mapping[str, Any],
    attempts: Sequence[Attempt] = (),
    budget_tokens: int | None = None,
) -> Prompt:
    """Messages asking for a first kernel written from the reference alone (after failed
    first attempts, with their evidence)."""
    sections = _opening(task, reference, device, language, regions)
    sections += _attempt_sections("Earlier attempt", attempts, drop=4)
    job = (
        "Write a first, exactly correct kernel for this task"
        + (" that avoids the failures above" if attempts else "")
        + "; make it fast where that does not risk correctness."
    )
    sections.append(Section(name="job", text=f"# Your job\n{job}\n{_INIT_FORMAT}"))
    return _messages(sections, budget_tokens)


def _parent_sections(ctx: MutationContext) -> list[Section]:
    """The parent kernel with what kf measured of it: its speed or failure, the evidence,
    and its compiler report and hardware counters where there are any."""
    perf = []
    if ctx.parent_speedup is not None:
        perf.append(f"speedup {ctx.parent_speedup:.3f}x over PyTorch eager")
    if ctx.parent_runtime_ms is not None and ctx.parent_ref_ms is not None:
        perf.append(f"{ctx.parent_runtime_ms:.4f} ms vs eager {ctx.parent_ref_ms:.4f} ms")
    if ctx.parent_failure:
        perf.append(f"failed: {ctx.parent_failure.splitlines()[0][:200]}")
    sections = [
        Section(
            name="parent",
            text=(
                f"# Parent kernel {ctx.parent_id[:12]} ({'; '.join(perf) or 'not yet timed'})\n"
                f"```python\n{ctx.parent_source}\n```"
            ),
            clip=True,
        )
    ]
    if ctx.parent_outcome:
        sections.append(
            Section(
                name="parent evidence",
                text=f"# What kf measured of the parent\n{ctx.parent_outcome}",
            )
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
        sections.append(
            Section(
                name="build and counters",
                text="# What the parent's build and hardware counters say\n" + "\n".join(measured),
                drop=2,
            )
        )
    return sections


def mutation_prompt(ctx: MutationContext, budget_tokens: int | None = None) -> Prompt:
    """System and user messages asking for an improved child of the parent, fitted to the
    context budget (what was cut is in ``truncated``)."""
    sections = _opening(ctx.task, ctx.reference, ctx.device, ctx.language or None, ctx.regions)
    sections += _parent_sections(ctx)
    if ctx.second_parent_source:
        sections.append(
            Section(
                name="second parent",
                text=(
                    "# Second parent (combine the best ideas of both)\n"
                    f"```python\n{ctx.second_parent_source}\n```"
                ),
                clip=True,
            )
        )
    for ins in ctx.inspirations:
        sp = f"{ins.speedup:.3f}x" if ins.speedup is not None else "untimed"
        sections.append(
            Section(
                name=f"inspiration {ins.candidate_id[:12]}",
                text=(
                    f"# Inspiration {ins.candidate_id[:12]} (island {ins.island}, cell "
                    f"{ins.cell}, {sp})\n```python\n{_clip(ins.source, 4000)}\n```"
                ),
                drop=5,
            )
        )
    if ctx.failures:
        sections.append(
            Section(
                name="children's failures",
                text="# Recent failures of this parent's children (avoid repeating them)\n"
                + "\n".join(f"- {_clip(f, 600)}" for f in ctx.failures),
                drop=4,
            )
        )
    if ctx.lessons:
        sections.append(Section(name="lessons", text=ctx.lessons, drop=3))
    verb = "Combine the two parents into" if ctx.second_parent_source else "Write"
    sections.append(
        Section(
            name="job",
            text=f"# Your job\n{verb} a faster, still exactly correct kernel.\n{_FORMAT}",
        )
    )
    return _messages(sections, budget_tokens)


def mutation_messages(ctx: MutationContext) -> list[dict[str, str]]:
    """System and user messages asking for an improved child of the parent (unbounded)."""
    return mutation_prompt(ctx).messages


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
