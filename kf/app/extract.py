"""``kf extract``: from a user's model to KernelBench-format tasks, one per hot region.

``kf extract my_model.py:build -o tasks/ --device cuda:0`` runs the probe
(:mod:`kf.app.model_probe`) in a subprocess (the user's code never runs in this process),
then:

- groups identical regions (the same task code and the same input signatures, e.g. the
  q/k/v/o projections of an attention) into one task, whose share is theirs together;
- ranks the groups by their share of the model's time and keeps the ``--top N`` with at
  least ``--min-share``;
- writes one self-contained task per kept group (:mod:`kf.app.task_text`): its
  ``get_inputs()`` at the first shapes the regions saw, ``get_tuning_inputs()`` at the
  others (another example input's sequence length), so tuning and the generalisation gate
  cover them;
- writes ``manifest.json`` (:class:`kf.app.manifest.ModelManifest`): where each task
  comes from, its share, the skipped regions with one line each, and the coverage.

The entry point's contract: ``build()`` or ``build(device=...)`` (given the ``--device``
when it takes that parameter) returns ``(model, [inputs, ...])`` or
``{"model": model, "inputs": [inputs, ...]}``; each ``inputs`` is one forward's
positional arguments (a tuple, or a lone tensor). kf moves the model and the inputs to
the device and keeps their dtypes.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kf.app.manifest import (
    MANIFEST_NAME,
    ManifestError,
    ManifestTask,
    ModelManifest,
    SkippedRegion,
    read_manifest,
    write_manifest,
)
from kf.app.model_probe import ProbedRegion, ProbeResult, as_signature
from kf.app.task_text import task_text

__all__ = ["ExtractRefused", "ExtractRequest", "ExtractResult", "add_parser", "extract"]


_FILL = re.compile(r"_fill\(self\.(\w+), [^)\n]*\)")


class ExtractRefused(ValueError):
    """``kf extract`` cannot do what was asked; the message is one line."""


@dataclass(frozen=True, kw_only=True)
class ExtractRequest:
    """One extraction, as ``kf extract``'s flags name it."""

    entry: str  # path.py:function
    out: Path
    device: str = "cpu"
    top: int = 8
    min_share: float = 0.01
    regions: str = "leaf"  # or "fused"
    repeats: int = 3
    timeout_s: float = 1800.0


@dataclass(frozen=True)
class ExtractResult:
    """The manifest written, where, and one line per region left out."""

    manifest: ModelManifest
    path: Path
    skipped_lines: list[str] = field(default_factory=list)


def _probe(req: ExtractRequest) -> ProbeResult:
    """Run the probe in a subprocess and read its result."""
    with tempfile.TemporaryDirectory(prefix="kf-extract-") as tmp:
        out = Path(tmp) / "probe.json"
        argv = [sys.executable, "-m", "kf.app.model_probe", req.entry, "--device", req.device]
        argv += ["--regions", req.regions, "--repeats", str(req.repeats), "--out", str(out)]
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=req.timeout_s, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ExtractRefused(
                f"{req.entry}: the probe ran past {req.timeout_s:g} s and was stopped; "
                "give smaller example inputs or fewer --repeats"
            ) from exc
        if not out.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise ExtractRefused(
                f"{req.entry}: the probe process died (exit {proc.returncode}) before it "
                f"wrote a result: {last}"
            )
        result = msgspec.json.decode(out.read_bytes(), type=ProbeResult)
    if result.error:
        raise ExtractRefused(result.error)
    return result


def _key(r: ProbedRegion) -> tuple[Any, ...]:
    """What makes two regions the same task: their code and their input signatures."""
    sigs = tuple(
        dict.fromkeys(tuple((tuple(i.shape), i.dtype) for i in s.inputs) for s in r.signatures)
    )
    code = _FILL.sub(r"_fill(self.\1)", r.source)  # the draws' statistics differ
    return (code, r.how, r.error, r.module_class if r.error else "", sigs)


def _groups(regions: list[ProbedRegion], total_ms: float) -> list[tuple[float, list[Any]]]:
    """Groups of identical regions with their share, largest first."""
    grouped: dict[tuple[Any, ...], list[ProbedRegion]] = {}
    for r in regions:
        grouped.setdefault(_key(r), []).append(r)
    out = [
        (sum(sum(r.time_ms) for r in members) / total_ms, members) for members in grouped.values()
    ]
    return sorted(out, key=lambda g: -g[0])


def _name(rank: int, members: list[ProbedRegion]) -> str:
    cls = members[0].module_class.rsplit(".", 1)[-1]
    path = re.sub(r"[^A-Za-z0-9]+", "_", members[0].path or "model").strip("_")
    more = f"_x{len(members)}" if len(members) > 1 else ""
    return f"{rank}_{cls}_{path}{more}"


def _shape_sets(r: ProbedRegion) -> list[list[Any]]:
    """The distinct input signatures the region saw, first seen first, as recipes."""
    seen: dict[tuple[Any, ...], list[Any]] = {}
    for s in r.signatures:
        key = tuple((tuple(i.shape), i.dtype) for i in s.inputs)
        seen.setdefault(key, list(s.inputs))
    return list(seen.values())


def _write_task(
    req: ExtractRequest, probe: ProbeResult, rank: int, share: float, members: list[ProbedRegion]
) -> ManifestTask:
    first = members[0]
    name = _name(rank, members)
    paths = [m.path for m in members]
    header = (
        f"{first.module_class} at {', '.join(paths)} in {probe.model_class} "
        f"({req.entry}): {share:.1%} of the model's time on {req.device} "
        f"({probe.device_name}).\n\nWritten by kf extract; it imports no code of the model. "
        "get_inputs() has the shapes of the first example input; get_tuning_inputs() the "
        "other shapes the region saw.\n"
    )
    text = task_text(header, first.source, _shape_sets(first))
    path = req.out / f"{name}.py"
    path.write_text(text)
    return ManifestTask(
        name=name,
        file=path.name,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        module_class=first.module_class,
        module_paths=paths,
        how=first.how,
        signatures=[as_signature(s) for s in first.signatures],
        state=first.state,
        share=share,
        time_ms=sum(sum(m.time_ms) for m in members),
    )


def _check_out(out: Path) -> None:
    """Refuse an output folder that holds files kf extract did not write."""
    if out.exists() and not out.is_dir():
        raise ExtractRefused(f"-o {out}: a file, not a folder; name a folder for the tasks")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).exists():
        raise ExtractRefused(
            f"-o {out}: the folder holds files kf extract did not write; name an empty or "
            "new folder (one holding an earlier extract's manifest.json is rewritten)"
        )


def extract(req: ExtractRequest) -> ExtractResult:
    """Probe the model, write the tasks and the manifest (see the module docstring)."""
    if req.regions not in ("leaf", "fused"):
        raise ExtractRefused(f"--regions {req.regions}: expected leaf or fused")
    _check_out(req.out)
    probe = _probe(req)
    total = sum(e.model_time_ms for e in probe.examples)
    if total <= 0:
        raise ExtractRefused(f"{req.entry}: the profiler measured no time for the model")
    req.out.mkdir(parents=True, exist_ok=True)
    _remove_earlier(req.out)
    tasks: list[ManifestTask] = []
    skipped: list[SkippedRegion] = []
    for share, members in _groups(probe.regions, total):
        if members[0].error or not members[0].source:
            why = members[0].error or "it was never called by the model's forward"
            skipped.append(
                SkippedRegion(
                    module_paths=[m.path for m in members],
                    module_class=members[0].module_class,
                    share=share,
                    reason=why,
                )
            )
        elif len(tasks) < req.top and share >= req.min_share:
            tasks.append(_write_task(req, probe, len(tasks) + 1, share, members))
    coverage = sum(t.share for t in tasks)
    attributed = sum(sum(r.time_ms) for r in probe.regions) / total
    manifest = ModelManifest(
        entry=req.entry,
        entry_sha256=_entry_hash(req.entry),
        model_class=probe.model_class,
        device=req.device,
        device_name=probe.device_name,
        torch_version=probe.torch_version,
        regions=req.regions,
        timing=probe.timing,
        examples=probe.examples,
        model_time_ms=total,
        tasks=tasks,
        skipped=skipped,
        coverage=coverage,
        unattributed=max(0.0, 1.0 - attributed),
    )
    path = req.out / MANIFEST_NAME
    write_manifest(manifest, path)
    lines = [
        f"skipped {', '.join(s.module_paths)} ({s.module_class}, {s.share:.1%} of the "
        f"model's time): {s.reason}"
        for s in skipped
    ]
    return ExtractResult(manifest=manifest, path=path, skipped_lines=lines)


def _remove_earlier(out: Path) -> None:
    """Remove the task files an earlier extract's manifest in ``out`` lists (only those)."""
    if not (out / MANIFEST_NAME).exists():
        return
    try:
        old = read_manifest(out / MANIFEST_NAME)
    except ManifestError as exc:
        raise ExtractRefused(f"-o {out}: {exc}; name an empty or new folder") from exc
    for t in old.tasks:
        (out / Path(t.file).name).unlink(missing_ok=True)


def _entry_hash(entry: str) -> str:
    path = Path(entry.rpartition(":")[0])
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def add_parser(sub: Any) -> None:
    """``kf extract``'s parser, under the ``kf`` command's subparsers."""
    ex = sub.add_parser("extract", help="write tasks for the hot regions of your own model")
    ex.add_argument("entry", help="PATH.py:FUNCTION returning (model, [inputs, ...])")
    ex.add_argument("-o", "--output", type=Path, required=True, help="folder for the tasks")
    ex.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    ex.add_argument("--top", type=int, default=8, help="at most this many tasks (default 8)")
    ex.add_argument(
        "--min-share",
        type=float,
        default=0.01,
        help="leave out regions under this share of the model's time (default 0.01)",
    )
    ex.add_argument(
        "--regions",
        choices=("leaf", "fused"),
        default="leaf",
        help="leaf modules (default), or the smallest modules above them, exported whole",
    )
    ex.add_argument("--repeats", type=int, default=3, help="profiled forwards per input")
    ex.add_argument("--json", action="store_true", help="print the manifest as JSON")
    ex.set_defaults(func=cmd_extract)


def cmd_extract(args: argparse.Namespace) -> int:
    """``kf extract``: print each task, each skipped region and the coverage."""
    req = ExtractRequest(
        entry=args.entry,
        out=args.output,
        device=args.device,
        top=args.top,
        min_share=args.min_share,
        regions=args.regions,
        repeats=args.repeats,
    )
    try:
        result = extract(req)
    except ExtractRefused as exc:
        print(f"kf extract: {exc}", file=sys.stderr)
        return 2
    for line in result.skipped_lines:
        print(f"kf extract: {line}", file=sys.stderr)
    m = result.manifest
    if args.json:
        print(msgspec.json.encode(m).decode())
        return 0
    for t in m.tasks:
        print(f"{t.share:6.1%}  {t.file}  ({', '.join(t.module_paths)})")
    print(
        f"{len(m.tasks)} tasks cover {m.coverage:.1%} of {m.model_class}'s time on "
        f"{m.device} ({m.timing}); {m.unattributed:.1%} is outside any region; "
        f"manifest: {result.path}"
    )
    return 0
