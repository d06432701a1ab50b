"""Which tolerance a candidate's outputs are judged at, and where it came from.

The default (preset ``kf``) is KernelBench's atol = rtol = 1e-4 (1e-2 for half types),
with a second chance that knows fp32 arithmetic: an output that fails allclose passes
when its error against a float64 run of the reference is within
:data:`FLOAT64_MULTIPLIER` times eager fp32's own error plus a floor (``atol/10``), as
``torch._dynamo.utils.same`` judges (:func:`float64_rule`, :mod:`kf.evaluation.runner.float64`).
The presets ``kernelbench`` and ``kernelbench-verified`` are plain allclose, for tables
comparable with KernelBench's. A run can
choose another (``kf run`` / ``kf eval`` ``--atol``, ``--rtol``, or ``--tolerance PRESET``),
and a task file can declare its own with module-level literals::

    KF_ATOL = 1e-3          # and/or KF_RTOL = 1e-3
    KF_TOLERANCE = "kernelbench-verified"   # a named preset

An explicit ``--atol``/``--rtol`` wins over the task file, the task file over a run's
``--tolerance`` preset, and that over the default. The task file is read with ``ast``
(its code never runs in the grader); a value that is not a positive number literal is
ignored. Presets give a tolerance per output dtype:

``kf``                     1e-4, half types 1e-2, else the float64 rule (the default)
``kernelbench``            1e-4, half types 1e-2, plain allclose (KernelBench's)
``kernelbench-verified``   1e-3, half types 1e-2, plain allclose (KernelBench-Verified's)

The float64 rule, per output that fails allclose
(:func:`kf.evaluation.runner.compare.judge_float64`):
``rmse(candidate, fp64) <= m * rmse(eager, fp64) + atol/10`` with m = 2 (3 for half
types), as ``torch._dynamo.utils.same``; and, stricter than ``same``, its largest error
``max|candidate - fp64| <= 2m * max|eager - fp64| + atol/10``, so that one wrong element
among millions (a wrong index) is not averaged away.
"""

from __future__ import annotations

import ast
from typing import Any

import msgspec

from kf.config import RunConfig

__all__ = [
    "FLOAT64_FLOOR",
    "FLOAT64_MULTIPLIER",
    "PRESETS",
    "Tolerance",
    "declared",
    "float64_budget",
    "float64_rule",
    "resolve",
    "rule_of",
]

_HALF = ("float16", "bfloat16")
#: preset → (tolerance for full-precision dtypes, tolerance for half types)
PRESETS: dict[str, tuple[float, float]] = {
    "kf": (1e-4, 1e-2),
    "kernelbench": (1e-4, 1e-2),
    "kernelbench-verified": (1e-3, 1e-2),
}


#: the float64 rule: how many times eager fp32's error against float64 a candidate may
#: have, for full-precision and for half types (torch._dynamo.utils.same's)
FLOAT64_MULTIPLIER: tuple[float, float] = (2.0, 3.0)
#: the float64 rule's floor, as a share of the output's atol (``same``'s tol/10)
FLOAT64_FLOOR = 0.1
#: the largest error may be this many times the multiplier times eager's largest
MAX_ERROR_FACTOR = 2.0
#: presets judged by allclose alone
PLAIN_PRESETS = frozenset({"kernelbench", "kernelbench-verified"})


class Tolerance(msgspec.Struct, frozen=True, kw_only=True):
    """A run's choice (``RunStarted.config`` keys ``atol``, ``rtol``, ``tolerance``)."""

    atol: float | None = None
    rtol: float | None = None
    preset: str = ""

    @classmethod
    def of(cls, config: RunConfig) -> Tolerance:
        """From a run's config; what an older log did not record gives the default."""
        e = config.evaluation
        return cls(atol=e.atol, rtol=e.rtol, preset=e.tolerance)

    def config(self) -> dict[str, Any]:
        """The run-config keys for this choice (none for the default)."""
        out: dict[str, Any] = {}
        if self.atol is not None:
            out["atol"] = self.atol
        if self.rtol is not None:
            out["rtol"] = self.rtol
        if self.preset:
            out["tolerance"] = self.preset
        return out


def check_preset(name: str) -> str:
    """``name`` when it is a known preset; raises ValueError naming the known ones."""
    if name and name not in PRESETS:
        raise ValueError(f"unknown tolerance preset {name!r}: expected one of {sorted(PRESETS)}")
    return name


def declared(task_source: str) -> Tolerance:
    """The tolerance a task file declares (``KF_ATOL``, ``KF_RTOL``, ``KF_TOLERANCE``)."""
    try:
        tree = ast.parse(task_source)
    except SyntaxError:
        return Tolerance()
    found: dict[str, Any] = {}
    for stmt in tree.body:
        if not isinstance(stmt, ast.Assign | ast.AnnAssign) or stmt.value is None:
            continue
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        for t in targets:
            if isinstance(t, ast.Name) and t.id in ("KF_ATOL", "KF_RTOL", "KF_TOLERANCE"):
                try:
                    found[t.id] = ast.literal_eval(stmt.value)
                except ValueError:
                    continue

    def number(key: str) -> float | None:
        value = found.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
        return None

    preset = found.get("KF_TOLERANCE")
    return Tolerance(
        atol=number("KF_ATOL"),
        rtol=number("KF_RTOL"),
        preset=preset if isinstance(preset, str) and preset in PRESETS else "",
    )


def resolve(run: Tolerance | None, task_source: str) -> tuple[Tolerance, str]:
    """The tolerance a task's candidates are judged at in a run, and where it came from.

    Explicit run values, then the task's declaration, then the run's preset, then the
    task's preset, then KernelBench's default; ``atol`` and ``rtol`` are resolved on
    their own (a run's ``--atol`` with a task's ``KF_RTOL`` uses both).
    """
    run = run or Tolerance()
    task = declared(task_source)
    atol = run.atol if run.atol is not None else task.atol
    rtol = run.rtol if run.rtol is not None else task.rtol
    preset = run.preset or task.preset
    parts = []
    if run.atol is not None or run.rtol is not None:
        parts.append("this run's --atol/--rtol")
    if (task.atol is not None and run.atol is None) or (task.rtol is not None and run.rtol is None):
        parts.append("the task's KF_ATOL/KF_RTOL")
    if preset and (atol is None or rtol is None):
        parts.append(f"preset {preset}")
    source = ", ".join(parts) or "KernelBench's default"
    return Tolerance(atol=atol, rtol=rtol, preset=preset), source


def for_dtype(tol: Tolerance, dtype_name: str) -> tuple[float, float]:
    """(atol, rtol) for one output dtype under ``tol``."""
    full, half = PRESETS.get(tol.preset or "kernelbench", PRESETS["kernelbench"])
    base = half if dtype_name in _HALF else full
    return (tol.atol if tol.atol is not None else base, tol.rtol if tol.rtol is not None else base)


def float64_rule(tol: Tolerance) -> bool:
    """Whether an output that fails allclose gets the float64 rule (not the plain presets)."""
    return tol.preset not in PLAIN_PRESETS


def float64_budget(tol: Tolerance, dtype_name: str) -> tuple[float, float, float]:
    """(m, the largest error's multiple, floor) of the float64 rule for one output dtype."""
    m = FLOAT64_MULTIPLIER[1 if dtype_name in _HALF else 0]
    return m, MAX_ERROR_FACTOR * m, FLOAT64_FLOOR * for_dtype(tol, dtype_name)[0]


def rule_of(tol: Tolerance) -> str:
    """What a verification's ``rule`` says: how its outputs were judged."""
    if not float64_rule(tol):
        return "allclose"
    m, _, _ = float64_budget(tol, "float32")
    return (
        f"allclose, else within {m:g}x eager fp32's error against float64 + atol/10 "
        "(torch._dynamo.utils.same)"
    )


def describe(atol: float, rtol: float) -> str:
    """``atol=rtol=0.0001`` or ``atol=0.001 rtol=0.0001``."""
    return f"atol=rtol={atol:g}" if atol == rtol else f"atol={atol:g} rtol={rtol:g}"


def add_options(parser: Any, *, tolerance: bool = True) -> None:
    """``--build-timeout`` and (with ``tolerance``) ``--atol``, ``--rtol``, ``--tolerance``."""
    parser.add_argument(
        "--build-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a candidate's build may take, not counting a wait for a free core "
        "(default: $KF_BUILD_TIMEOUT_S, else 600)",
    )
    if not tolerance:
        return
    parser.add_argument(
        "--atol", type=float, default=None, help="absolute tolerance (default 1e-4; half 1e-2)"
    )
    parser.add_argument(
        "--rtol", type=float, default=None, help="relative tolerance (default 1e-4; half 1e-2)"
    )
    parser.add_argument(
        "--tolerance",
        default="",
        metavar="PRESET",
        help=f"a named tolerance: {', '.join(sorted(PRESETS))} (default kf: 1e-4, else within "
        "2x eager fp32's error against a float64 run; kernelbench: KernelBench's plain "
        "allclose; kernelbench-verified: plain allclose at 1e-3 for fp32); a task's "
        "KF_ATOL/KF_RTOL and --atol/--rtol take precedence",
    )


def tolerance_from_args(args: Any) -> Tolerance | str:
    """The run's :class:`Tolerance` from parsed ``--atol/--rtol/--tolerance``, or why not."""
    for name in ("atol", "rtol"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            return f"--{name} must be a positive number, not {value}"
    try:
        preset = check_preset(getattr(args, "tolerance", "") or "")
    except ValueError as exc:
        return str(exc)
    return Tolerance(atol=args.atol, rtol=args.rtol, preset=preset)
