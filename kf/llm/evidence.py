"""What a model is told about an earlier candidate: the evidence kf gathered, trimmed.

Compile errors are cut down to their error lines (with the lines that show the offending
code) and the last line of a Python traceback; a failed verification names the trial, its
seed and how far off the output was (or the shape/dtype mismatch); a profile gives the
timings and speed-ups against each baseline that was timed.
"""

from __future__ import annotations

import re

from kf.reports import CompileReport, ProfileReport, VerifyReport

__all__ = ["compile_outcome", "profile_outcome", "trim_error", "verify_outcome"]

_ERROR_LINE = re.compile(
    r"(\berror\b|\bError\b|undefined reference|undeclared|no matching|cannot convert|"
    r"expected .* before|is not a member|incompatible)",
)
_NOISE = re.compile(
    r"^\s*(ninja: build stopped|FAILED: |\[\d+/\d+\] |subprocess\.CalledProcessError)"
)


def trim_error(text: str, limit: int = 1500) -> str:
    """The lines of a build or run error that matter: error lines with the two lines after
    each (the compiler's code excerpt and caret), and a traceback's final exception line."""
    text = (text or "").replace("\r\n", "\n").strip()
    if len(text) <= limit:
        return text
    lines = text.splitlines()
    keep: list[int] = []
    for i, line in enumerate(lines):
        if _ERROR_LINE.search(line) and not _NOISE.search(line):
            keep += [j for j in range(i, min(i + 3, len(lines))) if j not in keep]
        if len(keep) >= 30:
            break
    last = next((ln for ln in reversed(lines) if ln.strip()), "")
    picked = [lines[i] for i in sorted(keep)]
    if last and last not in picked:
        picked.append(last)
    out = "\n".join(picked) if picked else text[-limit:]
    if len(out) > limit:
        out = out[: limit - 20] + "\n… (trimmed)"
    skipped = len(lines) - len(picked)
    return out + (f"\n({skipped} other lines of output omitted)" if skipped > 0 else "")


def compile_outcome(report: CompileReport) -> str:
    """A failed build or import, for the model."""
    kind = report.failure_kind or "compile_error"
    error = (report.error or "").strip()
    details = trim_error(report.log) if report.log.strip() else ""
    if details and error and error in details:
        error = ""
    body = "\n".join(x for x in (error, details) if x) or "(no output)"
    return f"failed to build or import ({kind}):\n{body}"


def verify_outcome(report: VerifyReport) -> str:
    """A failed verification: which trial, how far off, or which mismatch."""
    kind = report.failure_kind or "incorrect"
    lines = [f"built, but verification failed ({kind})"]
    tol = f" (atol {report.atol:g}, rtol {report.rtol:g})" if report.atol or report.rtol else ""
    bad = [e for e in (*report.evidence, *report.variant_evidence) if not e.ok]
    for e in bad[:3]:
        where = f"unseen inputs {e.label}" if e.label else f"trial with seed {e.seed}"
        lines.append(
            f"- {where}: max abs err {e.max_abs_err:.3g}, max rel err {e.max_rel_err:.3g}{tol}"
            + (f": {e.reason}" if e.reason else "")
        )
    passed = sum(1 for e in report.evidence if e.ok)
    if report.evidence:
        lines.append(f"- {passed} of {len(report.evidence)} seeded trials passed")
    if report.error:
        lines.append(f"- error: {trim_error(report.error, 1000)}")
    if report.flags:
        lines.append("- flags: " + "; ".join(report.flags[:6]))
    return "\n".join(lines)


def profile_outcome(report: ProfileReport) -> str:
    """Timings and speed-ups of a correct candidate (or why timing failed)."""
    if not report.ok:
        why = trim_error(report.error or "", 800)
        return f"correct, but timing failed ({report.failure_kind}): {why}"
    lines = [
        f"correct; {report.runtime_ms:.4f} ms ± {report.runtime_std_ms:.4f} "
        f"({report.trials} timed calls) against PyTorch eager {report.ref_runtime_ms:.4f} ms: "
        f"{report.speedup:.3f}x"
    ]
    compiled = getattr(report, "compiled_runtime_ms", None)
    if compiled:
        vs = report.ref_runtime_ms and compiled and report.runtime_ms
        lines.append(
            f"torch.compile of the reference: {compiled:.4f} ms"
            + (f", so {compiled / report.runtime_ms:.3f}x against it" if vs else "")
        )
    if report.flags:
        lines.append("flags: " + "; ".join(report.flags[:6]))
    return "\n".join(lines)
