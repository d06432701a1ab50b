"""``kf eval TASK CANDIDATE.py``: compile, verify and profile one candidate.

Exit status: 0 when the candidate is correct, 1 when it failed (any stage), 2 for bad
usage, a broken task, an unavailable device or no runner sandbox (the message goes to
stderr; ``--unsafe-no-sandbox`` evaluates without the box, and says so in the result).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import structlog

from kf.devices.names import DeviceError, parse_device
from kf.evaluation.grader.baseline_settings import BaselineSettingError
from kf.evaluation.grader.box import SandboxUnavailable, require
from kf.evaluation.grader.pipeline import evaluate
from kf.evaluation.grader.sandbox import RunnerStartError, configure_default_pool
from kf.evaluation.wire.tolerance import describe, tolerance_from_args
from kf.kernels.tasks import TaskError, load_task
from kf.reports import FLAG_REASONS, EvalResult, ProfileReport
from kf.settings import apply, current

__all__ = ["main"]


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kf eval", description="Compile, verify and time one candidate kernel.")
    p.add_argument(
        "task", help="task file (KernelBench format: Model, get_inputs, get_init_inputs)"
    )
    p.add_argument("candidate", help="candidate file defining ModelNew")
    p.add_argument("--device", default="cpu", help="device to evaluate on (default: cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed for inputs and parameters")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--counters",
        action="store_true",
        help="on a GPU, also read hardware counters with Nsight Compute (ncu)",
    )
    from kf.evaluation.wire.tolerance import add_options

    add_options(p)
    p.add_argument(
        "--request-log",
        metavar="FILE",
        help="write every runner request as a JSON line (its op, the runner's pid, the "
        "seconds it took, and on a GPU the device memory the runner's allocator reserved "
        "and allocated, at most during it and after it, in MB): where an evaluation's "
        "time and memory go",
    )
    p.add_argument(
        "--unsafe-no-sandbox",
        action="store_true",
        help="run the candidate outside kf's bubblewrap box (it can then read kf's "
        "environment and files); every result says so",
    )
    return p


def _human(result: EvalResult) -> str:
    lines = [f"task {result.task} on {result.device}"]
    if result.audit is not None and result.audit.degenerate:
        lines.append(
            f"DEGENERATE task: its outputs do not depend on its inputs ({result.audit.reason})"
        )
    if result.sandbox == "unsafe-no-sandbox":
        lines.append("UNSANDBOXED: the candidate ran outside kf's box (--unsafe-no-sandbox)")
    c, v, p = result.compile, result.verify, result.profile
    lines.append(f"compile: {'ok' if c.ok else 'FAILED'} ({c.duration_s:.2f}s)")
    if not c.ok:
        lines.append(f"  {c.failure_kind}: {c.error}")
        if c.log:
            lines.append("  " + c.log[-2000:].replace("\n", "\n  "))
    if v is not None:
        status = "correct" if v.correct else f"REJECTED ({v.failure_kind})"
        lines.append(
            f"verify: {status}, {v.trials} trials, max abs err {v.max_abs_err:.3g}, "
            f"max rel err {v.max_rel_err:.3g}"
        )
        if v.atol:
            lines.append(
                f"  tolerance {describe(v.atol, v.rtol)} ({v.tolerance_source or 'default'}); "
                f"the smallest atol=rtol that would pass: {v.min_tolerance:.2g}"
            )
        if v.rule:
            lines.append(f"  rule: {v.rule}")
        skipped = next((e.fp64_skipped for e in v.evidence if e.fp64_skipped), "")
        if skipped and not v.correct:
            lines.append(f"  judged by allclose alone: {skipped}")
        if v.float64_passed:
            lines.append(
                f"  {v.float64_passed} comparison(s) failed allclose and passed the float64 rule"
            )
        if not v.correct:
            lines.append(f"  {v.error}")
    if v is not None and v.variant_evidence:
        passed = sum(1 for e in v.variant_evidence if e.ok)
        total = len(v.variant_evidence)
        lines.append(f"generalisation gate: {passed}/{total} unseen shapes passed")
    if v is not None and v.distribution_evidence:
        passed = sum(1 for e in v.distribution_evidence if e.ok)
        total = len(v.distribution_evidence)
        lines.append(f"hidden inputs: {passed}/{total} input distributions passed")
    if p is not None:
        if p.ok:
            lines.append(
                f"profile: {p.runtime_ms:.4f} ms ± {p.runtime_ci95_ms:.4f} (n={p.trials}), "
                f"eager {p.ref_runtime_ms:.4f} ms, speedup {p.speedup:.2f}× "
                f"[{p.method}]"
            )
            lines.append(_compiled_line(p))
            lines += _hold_lines(p)
        else:
            lines.append(f"profile: FAILED ({p.failure_kind}): {p.error}")
    k = result.counters
    if k is not None and k.ok:
        s = k.summary
        lines.append(
            f"counters ({k.tool}): {int(s.get('kernels', 0))} kernel(s), "
            f"{s.get('duration_ns', 0) / 1e3:.1f} us, DRAM {s.get('dram_gbs', 0):.0f} GB/s "
            f"({s.get('dram_throughput_pct', 0):.0f}% of peak), SM "
            f"{s.get('sm_throughput_pct', 0):.0f}%, occupancy "
            f"{s.get('achieved_occupancy_pct', 0):.0f}%"
        )
    elif k is not None:
        lines.append(f"counters: none ({k.error})")
    if result.flags:
        verdict = "SUSPECT" if result.suspect else "flagged"
        lines.append(f"{verdict}: {len(result.flags)} finding(s)")
        for flag in result.flags:
            code = flag.split(":", 1)[0]
            why = FLAG_REASONS.get(code, "")
            lines.append(f"  - {flag}" + (f"  [{why}]" if why else ""))
    return "\n".join(lines)


def _hold_lines(p: ProfileReport) -> list[str]:
    """The other method's figures beside the headline's, and the clocks they ran at
    (issue 47: kf.evaluation.grader.graph_figures, clock_watch)."""
    lines = []
    if p.method != "events" and p.events_runtime_ms is not None:
        lines.append(
            f"  one call between events: {p.events_runtime_ms:.4f} ms, eager "
            f"{p.events_ref_runtime_ms or 0.0:.4f} ms, speedup {p.events_speedup or 0.0:.2f}×"
        )
    elif p.graph_calls:
        got = f"{p.graph_runtime_ms:.4f} ms" if p.graph_runtime_ms is not None else "none"
        lines.append(f"  {p.graph_calls} calls in a CUDA graph: {got} ({p.graph_error or 'ok'})")
    c = p.clocks
    if c:
        lines.append(
            f"  clocks: SM {c['sm_mhz'][0]}-{c['sm_mhz'][1]} MHz, memory "
            f"{c['mem_mhz'][0]}-{c['mem_mhz'][1]} MHz, {c['temp_c'][0]}-{c['temp_c'][1]} °C "
            f"({c['readings']} readings, {c['read_by']}; {c['retimed']} timing(s) retimed)"
        )
    return lines


def _compiled_line(p: ProfileReport) -> str:
    """The torch.compile baseline of a profile, or why there is none."""
    if p.compiled_runtime_ms is None:
        return f"  torch.compile: none ({p.compile_baseline_error}); speed-up against eager only"
    paid = (
        "compiled earlier, reused"
        if p.compile_baseline_cached
        else (f"compiled in {p.compile_baseline_s:.1f}s")
    )
    return (
        f"  torch.compile {p.compiled_runtime_ms:.4f} ms ({paid}), speedup "
        f"{p.speedup_vs_compiled or 0.0:.2f}×; against the better of the two "
        f"{p.speedup_vs_best or 0.0:.2f}×"
    )


def _write_request_log(path: Path) -> None:
    """The evaluation's runner requests (:data:`kf.evaluation.grader.sandbox.REQUESTS`) as JSON
    lines, in the order they ended."""
    from kf.evaluation.grader.sandbox import REQUESTS

    with path.open("w", encoding="utf-8") as out:
        for r in list(REQUESTS):
            row = {
                "op": r.op,
                "pid": r.pid,
                "wall_s": round(r.wall_s, 4),
                "runner_s": round(r.runner_s, 4),
                "peak_mb": round(r.peak_bytes / 1e6, 1),
                "held_mb": round(r.held_bytes / 1e6, 1),
                "peak_allocated_mb": round(r.peak_allocated_bytes / 1e6, 1),
                "allocated_mb": round(r.allocated_bytes / 1e6, 1),
            }
            out.write(json.dumps(row) + "\n")


def main(argv: list[str]) -> int:
    """Run ``kf eval`` with ``argv`` (the arguments after ``eval``); return the exit status."""
    if not structlog.is_configured():  # keep stdout for the result (--json)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        print(f"{exc}\n{_parser().format_usage().rstrip()}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    tolerance = tolerance_from_args(args)
    if isinstance(tolerance, str):
        print(f"kf eval: {tolerance}", file=sys.stderr)
        return 2
    if args.unsafe_no_sandbox:
        apply({"KF_UNSAFE_NO_SANDBOX": "1"})  # kf.evaluation.grader.box reads it
    try:
        device = parse_device(args.device)
        if device.startswith("cuda"):  # idle runners make their CUDA context ahead of use
            configure_default_pool(warm=current().runner_warm or device)
        task = load_task(args.task)
        candidate = Path(args.candidate)
        try:
            source = candidate.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            print(f"kf eval: {candidate}: cannot read candidate: {exc}", file=sys.stderr)
            return 2
        require()
        result = evaluate(
            task,
            source,
            device=device,
            seed=args.seed,
            counters=args.counters,
            tolerance=tolerance,
            build_timeout_s=args.build_timeout,
            audit=True,
        )
    except (
        TaskError,
        DeviceError,
        RunnerStartError,
        SandboxUnavailable,
        BaselineSettingError,
    ) as exc:
        print(f"kf eval: {exc}", file=sys.stderr)
        return 2
    finally:  # an evaluation that ends in an error is the one whose requests matter most
        if args.request_log:
            _write_request_log(Path(args.request_log))
    if args.json:
        print(json.dumps(result.summary()))
    else:
        print(_human(result))
        if result.error and not result.correct:
            print(f"kf eval: candidate failed: {result.error.splitlines()[0]}", file=sys.stderr)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
