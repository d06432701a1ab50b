"""The tools a mutator's model (or coding agent) may call, and how each one runs.

``compile(source)``, ``check(source)``, ``time(source)`` and, on a GPU, ``counters(source)``
run the candidate module in kf's sandboxed runners (:mod:`kf.evaluation`) on a device of
the run; ``show_elite(id)`` is answered from the log by the mutator itself. What a tool
returns is a :class:`ToolReply`: the text the model is shown (the same trimmed evidence a
child's prompt carries, :mod:`kf.llm.evidence`) and a small structured summary for the
record. Tool runs never enter the archive.

Checks and timings use inputs seeded differently from the pipeline's own verification
(:data:`TOOL_SEED_OFFSET`), so an agent cannot tune a kernel to the exact trial inputs it
will be judged on; timings are short (a few calls, no ``torch.compile`` baseline) and say
so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kf.config import RunConfig
from kf.llm.evidence import compile_outcome, profile_outcome, trim_error, verify_outcome

if TYPE_CHECKING:
    from kf.evaluation import GradingSession
    from kf.evaluation.grader.baseline_settings import Conditions
    from kf.evaluation.wire.tolerance import Tolerance

__all__ = [
    "DEVICE_TOOLS",
    "TOOL_SEED_OFFSET",
    "ToolLimits",
    "ToolReply",
    "ToolRequestError",
    "parse_arguments",
    "run_device_tool",
    "tool_specs",
]

#: Tools that need a device of the run (the others are answered from the log).
DEVICE_TOOLS = ("compile", "check", "time", "counters")

#: Added to the run's seed for a tool's check and timing inputs.
TOOL_SEED_OFFSET = 1_000_003

_DESCRIPTIONS = {
    "compile": "Build and import a candidate module (it must define ModelNew) in kf's "
    "sandbox on the target device. Returns the compiler's errors or resource report.",
    "check": "Verify a candidate module against the reference on seeded trials and on "
    "unseen input shapes, as kf's verifier does. Returns the verdict with its evidence "
    "(failing trial, max abs/rel error against atol/rtol).",
    "time": "Time a correct candidate module against PyTorch eager on the target device "
    "(a short session). Returns the times and the speed-up.",
    "counters": "Run a correct candidate once under Nsight Compute. Returns DRAM and SM "
    "throughput, occupancy, registers per kernel.",
}


def tool_specs(gpu: bool) -> list[dict[str, Any]]:
    """The OpenAI ``tools`` list: the device tools (``counters`` only on a GPU) and
    ``show_elite``."""
    out: list[dict[str, Any]] = []
    for name in DEVICE_TOOLS:
        if name == "counters" and not gpu:
            continue
        out.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": _DESCRIPTIONS[name],
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "source": {
                                "type": "string",
                                "description": "the whole Python module defining ModelNew",
                            }
                        },
                        "required": ["source"],
                    },
                },
            }
        )
    out.append(
        {
            "type": "function",
            "function": {
                "name": "show_elite",
                "description": "Show the source, speed-up and archive cell of an elite "
                "kernel of this task (ids as listed in the prompt; 'list' lists them).",
                "parameters": {
                    "type": "object",
                    "properties": {"id": {"type": "string"}},
                    "required": ["id"],
                },
            },
        }
    )
    return out


class ToolRequestError(ValueError):
    """A tool call kf cannot run: unknown tool, arguments that are not JSON, a missing field."""


def parse_arguments(name: str, arguments: str, tools: set[str]) -> dict[str, str]:
    """A tool call's arguments as a dict, or :class:`ToolRequestError` saying what is wrong."""
    if name not in tools:
        raise ToolRequestError(f"unknown tool {name!r} (available: {', '.join(sorted(tools))})")
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ToolRequestError(f"{name}: arguments are not JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(args, dict):
        raise ToolRequestError(f"{name}: arguments must be a JSON object")
    want = "id" if name == "show_elite" else "source"
    value = args.get(want)
    if not isinstance(value, str) or not value.strip():
        raise ToolRequestError(f"{name}: needs a non-empty string argument {want!r}")
    return {want: value}


@dataclass(frozen=True)
class ToolLimits:
    """What one episode may spend (per episode, not per run)."""

    turns: int = 8
    tool_calls: int = 12
    tokens: int = 200_000
    seconds: float = 900.0
    tool_timeout_s: float = 300.0

    @classmethod
    def of(cls, config: RunConfig) -> ToolLimits:
        """The run's ``--tool-turns``, ``--tool-calls``, ``--tool-tokens``, ``--tool-seconds``."""
        a = config.agents
        return cls(
            turns=a.tool_turns,
            tool_calls=a.tool_calls,
            tokens=a.tool_tokens,
            seconds=a.tool_seconds,
            tool_timeout_s=a.tool_timeout_s,
        )


@dataclass(frozen=True)
class ToolReply:
    """What a tool produced: the text for the model, a summary for the record."""

    ok: bool
    text: str
    summary: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the tool itself could not run
    ran_on: str = ""
    latency_s: float = 0.0

    def wire(self) -> dict[str, Any]:
        """As sent over the bus."""
        return {
            "ok": self.ok,
            "text": self.text,
            "summary": self.summary,
            "error": self.error,
            "ran_on": self.ran_on,
            "latency_s": self.latency_s,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ToolReply:
        """From a bus reply (a :class:`ToolRequestError`-free dict; bad fields → error)."""
        summary = data.get("summary")
        return cls(
            ok=bool(data.get("ok")),
            text=str(data.get("text", ""))[:20000],
            summary=dict(summary) if isinstance(summary, dict) else {},
            error=str(data["error"]) if data.get("error") is not None else None,
            ran_on=str(data.get("ran_on", "")),
            latency_s=float(data.get("latency_s", 0.0) or 0.0),
        )


def run_device_tool(
    tool: str,
    task_name: str,
    task_source: str,
    source: str,
    *,
    device: str,
    seed: int,
    timeout_s: float = 300.0,
    device_id: str = "",
    tolerance: Tolerance | None = None,
    conditions: Conditions | None = None,
) -> ToolReply:
    """Run one device tool in kf's sandboxed runners (blocking: call it in a thread), in
    one grading session at the run's ``tolerance`` and under its measuring
    ``conditions`` (a worker's :class:`agents.tool_server.ToolServer` hands down those
    its run recorded; None: the task's or KernelBench's tolerance, and the process's
    settings, as for ``kf eval``).

    Raises nothing for a bad candidate (that is the tool's answer); a broken task or a
    runner that could not start is a reply with ``error`` set.
    """
    from kf.evaluation import GradingSession
    from kf.kernels.tasks import Task, TaskError

    t0 = time.monotonic()
    try:
        task = Task.from_source(task_name, task_source)
        run = _TOOL_RUNNERS.get(tool)
        if run is None:
            return ToolReply(ok=False, text=f"unknown tool {tool!r}", error="unknown tool")
        if tool == "counters" and not device.startswith("cuda"):
            return ToolReply(ok=False, text="counters need a GPU", error="no GPU")
        session = GradingSession(
            task, source, device=device, seed=seed + TOOL_SEED_OFFSET, timeout_s=timeout_s,
            tolerance=tolerance, conditions=conditions,
        )  # fmt: skip
        reply = run(session)
    except TaskError as exc:
        reply = ToolReply(ok=False, text=f"the task is broken: {exc}", error=str(exc))
    except Exception as exc:  # a runner that could not start: the tool's failure, said so
        reply = ToolReply(
            ok=False, text=f"the tool failed: {type(exc).__name__}: {exc}", error=repr(exc)[:500]
        )
    return ToolReply(
        ok=reply.ok,
        text=reply.text,
        summary=reply.summary,
        error=reply.error,
        ran_on=device_id or device,
        latency_s=time.monotonic() - t0,
    )


def _compile_tool(session: GradingSession) -> ToolReply:
    """``compile``: the candidate built and imported, ``ModelNew`` constructed."""
    from kf.evaluation import compile_session

    c = compile_session(session, session.timeout_s)
    if c.ok:
        notes = [ln for ln in c.log.splitlines() if ln.startswith("kf.cuda")][-12:]
        text = "compiled and imported; ModelNew constructed" + (
            "\n" + "\n".join(notes) if notes else ""
        )
        if c.warnings:
            text += "\nwarnings: " + "; ".join(c.warnings[:6])
    else:
        text = compile_outcome(c)
    return ToolReply(ok=c.ok, text=text, summary={"compiled": c.ok})


def _check_tool(session: GradingSession) -> ToolReply:
    """``check``: built first, so a module that does not build gets the compiler's own
    lines; then verified on seeded trials and unseen shapes."""
    from kf.evaluation import compile_session, verify_session

    c = compile_session(session, session.timeout_s)
    if not c.ok:
        failure_kind = c.failure_kind or "compile_error"
        summary: dict[str, Any] = {"correct": False, "failure_kind": failure_kind}
        return ToolReply(ok=False, text=compile_outcome(c), summary=summary)
    v = verify_session(session)
    if v.correct:
        text = (
            f"correct: {sum(e.ok for e in v.evidence)} of {len(v.evidence)} seeded "
            f"trials passed (max abs err {v.max_abs_err:.3g}, max rel err "
            f"{v.max_rel_err:.3g}; atol {v.atol:g}, rtol {v.rtol:g})"
            + (f"; {len(v.variant_evidence)} unseen shapes passed" if v.variant_evidence else "")
        )
    else:
        text = verify_outcome(v)
    return ToolReply(
        ok=v.correct,
        text=text,
        summary={"correct": v.correct, "failure_kind": v.failure_kind or ""},
    )


def _time_tool(session: GradingSession) -> ToolReply:
    """``time``: a short timing session (kf's profiler times again), no ``torch.compile``
    baseline; the summary says under which TF32 setting the reference runner timed."""
    from kf.evaluation import Timing, profile_session

    timing = Timing(warmup=2, min_trials=5, min_time_s=0.2, max_trials=200)
    p = profile_session(session, timing, compile_baseline=False)
    text = profile_outcome(p) + "\n(a short timing session; kf's profiler times again)"
    return ToolReply(
        ok=p.ok,
        text=text,
        summary={"speedup": p.speedup, "runtime_ms": p.runtime_ms, "tf32": p.tf32} if p.ok else {},
    )


def _counters_tool(session: GradingSession) -> ToolReply:
    """``counters``: Nsight Compute's counters of the candidate's kernels (a GPU's)."""
    from kf.evaluation.grader.counters import counters_session

    k = counters_session(session)
    text = (
        "counters: " + ", ".join(f"{a} {b:.3g}" for a, b in sorted(k.summary.items()))
        if k.ok
        else f"counters failed: {trim_error(k.error or '', 800)}"
    )
    return ToolReply(ok=k.ok, text=text, summary=dict(k.summary))


_TOOL_RUNNERS: dict[str, Callable[[GradingSession], ToolReply]] = {
    "compile": _compile_tool,
    "check": _check_tool,
    "time": _time_tool,
    "counters": _counters_tool,
}
