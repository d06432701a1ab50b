"""``kf check-model my_model.py:build --patch kf_patch.py --device cuda:0 -o check.json``:
the whole model, patched, judged and timed end to end.

The user's model and the patch's kernels run in a child process
(:mod:`kf.app.model_check`); this process reads its JSON, adds a summary and prints it:

- ``passed``: every input set (the user's examples and the sets they never saw) gave the
  patched model's outputs within a candidate's numerics rule of the original's; a failed
  set names the regions that fail when patched alone (``wrong_regions``);
- per example input, the mean end-to-end time of eager, ``torch.compile`` and the patched
  model, the patched model's speed-up over each, and each region's share of the gain:
  (eager − the model with that region alone patched) / (eager − the patched model);
- the fallbacks the patch took, per module path, on each input set.

``kf report check.json`` prints the same summary again. Exit codes: 0 passed, 1 the
patched model is wrong on some input set, 2 the check could not run (one line).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["CHECK_KIND", "add_parser", "cmd_check_model", "format_check", "is_check", "summarise"]

CHECK_KIND = "kf.check-model"


def _entry_changed(entry: str, recorded: str) -> bool:
    """Whether the entry's file differs from the one the manifest recorded."""
    path = Path(entry.rpartition(":")[0])
    try:
        return bool(recorded) and hashlib.sha256(path.read_bytes()).hexdigest() != recorded
    except OSError:
        return False


def _gains(sides: dict[str, Any]) -> dict[str, Any]:
    """The patched model's speed-ups and each region's share of its gain, from means."""
    eager = sides["eager"]["mean"]
    patched = sides["patched"]["mean"]
    compiled = sides.get("torch.compile", {}).get("mean")
    gain = eager - patched
    shares = {
        name.removeprefix("region "): {
            "ms": s["mean"],
            "gain_ms": eager - s["mean"],
            "share": (eager - s["mean"]) / gain if gain > 0 else None,
        }
        for name, s in sides.items()
        if name.startswith("region ")
    }
    return {
        "eager_ms": eager,
        "compiled_ms": compiled,
        "patched_ms": patched,
        "speedup_vs_eager": eager / patched if patched > 0 else None,
        "speedup_vs_compiled": compiled / patched if compiled and patched > 0 else None,
        "regions": shares,
    }


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` (the child's) with ``kind``, ``passed``, ``failures``, ``fallbacks`` and
    per-example ``gains`` added."""
    sets = result["correctness"]
    failures = [
        {
            "inputs": s["inputs"],
            "reason": s["verdict"].get("reason"),
            "regions": [w["task"] for w in s.get("wrong_regions", [])],
            "paths": [p for w in s.get("wrong_regions", []) for p in w["paths"]],
        }
        for s in sets
        if not s["verdict"]["ok"]
    ]
    fallbacks: dict[str, dict[str, int]] = {}
    for s in sets:
        for path, c in s["calls"].items():
            total = fallbacks.setdefault(path, {"kernel": 0, "fallback": 0})
            total["kernel"] += c["kernel"]
            total["fallback"] += c["fallback"]
    return {
        **result,
        "kind": CHECK_KIND,
        "passed": not failures,
        "failures": failures,
        "fallbacks": fallbacks,
        "gains": [{"example": t["example"], **_gains(t["sides"])} for t in result["timing"]],
    }


def _ms(value: float | None) -> str:
    return f"{value:.4f} ms" if value is not None else "—"


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "—"


def format_check(report: dict[str, Any]) -> str:
    """The check as text: verdict, input sets, times and shares, fallbacks."""
    lines = [
        f"kf check-model: {report['model_class']} ({report['entry']}) on {report['device']} "
        f"({report['device_name']}, torch {report['torch_version']})",
        f"numerics: {'PASSED' if report['passed'] else 'FAILED'} on "
        f"{len(report['correctness'])} input sets ({sum(s['seen'] for s in report['correctness'])} "
        "the user's, the rest never seen)",
    ]
    for s in report["correctness"]:
        v = s["verdict"]
        mark = "ok  " if v["ok"] else "FAIL"
        err = f"max abs err {v.get('max_abs_err', 0):.3g}, rule {v.get('rule', '?')}"
        lines.append(f"  {mark} {s['inputs']}: {err}" + ("" if v["ok"] else f": {v['reason']}"))
        for w in s.get("wrong_regions", []):
            lines.append(
                f"       wrong when patched alone: {', '.join(w['paths'])} (task {w['task']}): "
                f"{w['verdict'].get('reason')}"
            )
    for g in report["gains"]:
        lines.append(
            f"example {g['example']}: eager {_ms(g['eager_ms'])}, torch.compile "
            f"{_ms(g['compiled_ms'])}, patched {_ms(g['patched_ms'])}: {_x(g['speedup_vs_eager'])} "
            f"over eager, {_x(g['speedup_vs_compiled'])} over torch.compile (means)"
        )
        for task, r in g["regions"].items():
            share = f"{r['share']:.0%}" if r["share"] is not None else "—"
            lines.append(
                f"  {task} alone: {_ms(r['ms'])}, gain {r['gain_ms']:+.4f} ms, share {share}"
            )
    lines.append("calls per module path over the input sets (kernel / fallback to the original):")
    for path, c in sorted(report["fallbacks"].items()):
        lines.append(f"  {path}: {c['kernel']} / {c['fallback']}")
    lines += [f"left out at apply: {line}" for line in report.get("left_out", [])]
    if report.get("entry_changed"):
        lines.append("note: the entry's file changed since kf extract (its sha256 differs)")
    lines.append(f"timer: {report['timer']}")
    return "\n".join(lines)


def is_check(path: Path) -> bool:
    """Whether ``path`` is a check-model JSON (``kf report`` shows it)."""
    if path.suffix != ".json":
        return False
    try:
        return bool(json.loads(path.read_text()).get("kind") == CHECK_KIND)
    except (OSError, ValueError, AttributeError):
        return False


def _run_child(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kf-check-model-") as tmp:
        out = Path(tmp) / "check.json"
        argv = [sys.executable, "-m", "kf.app.model_check", args.entry, "--patch", str(args.patch)]
        argv += ["--device", args.device, "--out", str(out), "--time-s", str(args.time_s)]
        argv += ["--compile" if args.compile else "--no-compile"]
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=args.timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return {"error": f"the check ran past {args.timeout:g} s and was stopped"}
        if not out.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
            return {"error": f"the check's process died (exit {proc.returncode}): {last}"}
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def cmd_check_model(args: argparse.Namespace) -> int:
    """``kf check-model``: run the child, summarise, print, write ``-o``."""
    result = _run_child(args)
    if result.get("error"):
        print(f"kf check-model: {result['error']}", file=sys.stderr)
        return 2
    report = summarise(result)
    report["entry_changed"] = _entry_changed(args.entry, report["patch_model"]["entry_sha256"])
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(format_check(report))
    for f in report["failures"]:
        where = ", ".join(f["paths"]) or "no single region (only together)"
        print(f"kf check-model: wrong on {f['inputs']}: {where}: {f['reason']}", file=sys.stderr)
    return 0 if report["passed"] else 1


def add_parser(sub: Any) -> None:
    """``kf check-model``'s parser, under the ``kf`` command's subparsers."""
    c = sub.add_parser("check-model", help="judge and time your model patched by kf export --model")
    c.add_argument("entry", help="PATH.py:FUNCTION returning (model, [inputs, ...])")
    c.add_argument("--patch", type=Path, required=True, help="the module kf export --model wrote")
    c.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    c.add_argument("-o", "--output", type=Path, help="write the check as JSON here")
    c.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the original under torch.compile (default on)",
    )
    c.add_argument(
        "--time-s", type=float, default=0.5, help="least timed seconds per side (default 0.5)"
    )
    c.add_argument(
        "--timeout", type=float, default=3600.0, help="stop the check after this many seconds"
    )
    c.set_defaults(func=cmd_check_model)
