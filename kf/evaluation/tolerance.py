"""Which tolerance a candidate's outputs are judged at, and where it came from.

The default is KernelBench's: atol = rtol = 1e-4 (1e-2 for half types). A run can
choose another (``kf run`` / ``kf eval`` ``--atol``, ``--rtol``, or ``--tolerance PRESET``),
and a task file can declare its own with module-level literals::

    KF_ATOL = 1e-3          # and/or KF_RTOL = 1e-3
    KF_TOLERANCE = "kernelbench-verified"   # a named preset

An explicit ``--atol``/``--rtol`` wins over the task file, the task file over a run's
``--tolerance`` preset, and that over the default. The task file is read with ``ast``
(its code never runs in the grader); a value that is not a positive number literal is
ignored. Presets give a tolerance per output dtype:

``kernelbench``            1e-4, half types 1e-2 (the default)
``kernelbench-verified``   1e-3, half types 1e-2 (KernelBench-Verified's fp32 tolerance)
"""

from __future__ import annotations

import ast
from typing import Any

import msgspec

__all__ = ["PRESETS", "Tolerance", "declared", "resolve"]

_HALF = ("float16", "bfloat16")
#: preset → (tolerance for full-precision dtypes, tolerance for half types)
PRESETS: dict[str, tuple[float, float]] = {
    "kernelbench": (1e-4, 1e-2),
    "kernelbench-verified": (1e-3, 1e-2),
}


class Tolerance(msgspec.Struct, frozen=True, kw_only=True):
    """A run's choice (``RunStarted.config`` keys ``atol``, ``rtol``, ``tolerance``)."""

    atol: float | None = None
    rtol: float | None = None
    preset: str = ""

    @classmethod
    def of(cls, config: dict[str, Any]) -> Tolerance:
        """From a run config; missing keys (every older log) give the default."""
        atol, rtol = config.get("atol"), config.get("rtol")
        return cls(
            atol=float(atol) if atol is not None else None,
            rtol=float(rtol) if rtol is not None else None,
            preset=str(config.get("tolerance") or ""),
        )

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
        help=f"a named tolerance: {', '.join(sorted(PRESETS))} (kernelbench-verified: 1e-3 "
        "for fp32); a task's KF_ATOL/KF_RTOL and --atol/--rtol take precedence",
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
