"""``kf export runs/*.db --model tasks/manifest.json -o kf_patch.py``: the verified kernels
of one or more runs, back into the user's model, as one module with ``apply(model)``.

For every task of the manifest (``kf extract``'s, :mod:`kf.app.manifest`), the runs whose
``run.started`` carries the same task text (its sha256) are read, and per (device kind,
input shapes, dtypes) the fastest kernel kf verified there is kept:

- at the task's own shapes (its ``get_inputs()``, the manifest's first signature): the
  task's best kernel (:func:`agents.archive.best_candidate`: profiled, not suspect,
  passed the generalisation gate), as plain ``kf export`` chooses it;
- at a tuning shape set (the manifest's signature of that index): each tuned candidate
  :func:`kf.app.export.tuned_choices` keeps (measured correct and fast at its own shapes),
  with its own source (its configuration applied);
- across runs, the larger verified speed-up over eager wins.

The module's header names, for every kernel, the run (id and log), the candidate, where
kf measured it, and its verified speed-ups; it says that the kernels' code runs unboxed
in the user's process. The module is the tables (:data:`MODEL`, :data:`KERNELS`,
:data:`REGIONS`, the kernels' sources) and the code of :mod:`kf.app.patch_runtime`, copied
verbatim, bound to them: ``apply(model, regions=None)``, ``remove(model)``, ``stats()``,
``reset_stats()``, ``kinds()``. A task no run verified a kernel for is named in the header;
its regions keep their code.
"""

from __future__ import annotations

import argparse
import hashlib
import pprint
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kf.app import patch_runtime
from kf.app.export import tuned_choices
from kf.app.manifest import ManifestError, ManifestTask, ModelManifest, read_manifest

__all__ = ["ExportRefused", "PatchKernel", "cmd_export_model", "export_model", "kernels_of_run"]


class ExportRefused(ValueError):
    """``kf export --model`` cannot write a patch; the message is one line."""


@dataclass(frozen=True, kw_only=True)
class PatchKernel:
    """One verified kernel of one run, at one (device kind, shapes, dtypes)."""

    task: str  # the manifest's task name
    run_id: str
    db: str
    candidate_id: str
    kind: str  # cpu, cuda
    target: str
    backend: str
    shape_index: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    speedup: float
    runtime_ms: float
    ref_ms: float
    speedup_vs_compiled: float | None
    compiled_ms: float | None
    config: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    device_id: str = ""
    unverified_log: str = ""  # the log's integrity failure, exported anyway

    @property
    def key(self) -> tuple[str, str, tuple[tuple[int, ...], ...], tuple[str, ...]]:
        return (self.task, self.kind, self.shapes, self.dtypes)


def _signature(
    task: ManifestTask, index: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    sig = task.signatures[index]
    return tuple(tuple(t.shape) for t in sig.inputs), tuple(t.dtype for t in sig.inputs)


def _run_tasks(envelopes: list[Any]) -> dict[str, str]:
    """The run's task sha256 → its name in the run (from ``run.started``)."""
    from kf.events import decode_event

    for env in envelopes:
        if env.type == "run.started":
            ev = decode_event(env)
            return {t.sha256: t.name for t in ev.tasks}  # type: ignore[attr-defined]
    return {}


def kernels_of_run(
    db: Path, manifest: ModelManifest, *, ignore_integrity: bool = False
) -> list[PatchKernel]:
    """Every verified kernel of the run at ``db`` for a task of ``manifest`` (see the
    module docstring); :class:`ExportRefused` for a log that cannot be read."""
    from agents.archive import best_candidate
    from kf.app.report import best_baselines, fold_archive
    from kf.log import EventLog, LogError

    try:
        with EventLog(db, readonly=True) as elog:
            state = fold_archive(elog, ignore_integrity=ignore_integrity)
            integrity = elog.verify()
            envelopes = list(elog.read())
    except LogError as exc:
        raise ExportRefused(str(exc)) from exc
    unverified = "" if integrity.ok else integrity.message()
    names = _run_tasks(envelopes)
    out: list[PatchKernel] = []
    for mtask in manifest.tasks:
        name = names.get(mtask.sha256)
        if name is None or name not in state.tasks:
            continue
        picks = []
        best = best_candidate(state, name)
        if best is not None:
            picks.append(best)
        for choice in tuned_choices(state, envelopes, name):
            picks.append(state.candidates[choice.candidate_id])
        for c in picks:
            if not 0 <= c.shape_index < len(mtask.signatures) or c.speedup is None:
                continue
            shapes, dtypes = _signature(mtask, c.shape_index)
            vs = best_baselines(envelopes, name, c.id)
            out.append(
                PatchKernel(
                    task=mtask.name,
                    run_id=state.run_id,
                    db=str(db),
                    candidate_id=c.id,
                    kind=c.target.partition(":")[0],
                    target=c.target,
                    backend=c.backend,
                    shape_index=c.shape_index,
                    shapes=shapes,
                    dtypes=dtypes,
                    speedup=c.speedup,
                    runtime_ms=c.runtime_ms or 0.0,
                    ref_ms=c.ref_ms or 0.0,
                    speedup_vs_compiled=vs["best_speedup_vs_compiled"],
                    compiled_ms=vs["compiled_ms"],
                    config=dict(c.config),
                    source=c.source,
                    device_id=c.tuned_on or c.device_id or "",
                    unverified_log=unverified,
                )
            )
    return out


def _chosen(kernels: list[PatchKernel], min_speedup: float) -> tuple[list[PatchKernel], list[str]]:
    """The fastest verified kernel per (task, device kind, shapes, dtypes), of those over
    ``min_speedup``; and one line per (task, shapes) whose fastest is not."""
    best: dict[Any, PatchKernel] = {}
    for k in kernels:
        if k.key not in best or k.speedup > best[k.key].speedup:
            best[k.key] = k
    kept = [best[key] for key in sorted(best) if best[key].speedup > min_speedup]
    slow = [
        f"task {k.task} at {[list(s) for s in k.shapes]} on {k.kind}: its fastest verified "
        f"kernel ({k.candidate_id}, run {k.run_id}) is {k.speedup:.2f}x over eager, not over "
        f"--min-speedup {min_speedup:g}: left out, the region keeps its code there"
        for k in (best[key] for key in sorted(best))
        if k.speedup <= min_speedup
    ]
    return kept, slow


def _literal(source: str) -> str:
    """``source`` as a readable Python string literal (raw, triple-quoted when it can be)."""
    if "'''" not in source and not source.endswith("\\") and "\r" not in source:
        return "r'''" + source + "'''"
    return repr(source)


def _kernel_line(kid: str, k: PatchKernel, paths: list[str]) -> str:
    shapes = ", ".join(f"{list(s)} {d}" for s, d in zip(k.shapes, k.dtypes, strict=True))
    vs_compiled = (
        f", {k.speedup_vs_compiled:.2f}x over torch.compile ({k.compiled_ms:.4f} ms)"
        if k.speedup_vs_compiled is not None and k.compiled_ms
        else ", no torch.compile time"
    )
    where = "its own shapes" if k.shape_index == 0 else f"tuning shape set {k.shape_index}"
    return (
        f"#   {kid}: {', '.join(paths)} (task {k.task}) at {shapes} on {k.kind} ({where})\n"
        f"#       run {k.run_id} ({k.db}), candidate {k.candidate_id}, backend {k.backend}, "
        f"measured on {k.device_id or k.target}\n"
        f"#       verified: {k.speedup:.2f}x over PyTorch eager ({k.runtime_ms:.4f} ms vs "
        f"{k.ref_ms:.4f} ms){vs_compiled}"
        + (f"; config {k.config}" if k.config else "")
        + (
            f"\n#       WARNING: its log failed its check: {k.unverified_log}"
            if k.unverified_log
            else ""
        )
    )


TRUST = """\
# TRUST: the kernels below are code kf's search wrote (an LLM, or kf's offline mutator),
# each embedded verbatim as a SOURCE_* string. kf ran them only inside its sandbox, and
# checked them there at the shapes each is dispatched to. apply() imports and runs them
# in YOUR process, unsandboxed, with your privileges: by importing this module you choose
# to trust them. Read them first; `kf check-model` runs the patched model in a separate
# process and judges it end to end before you do.
"""


def _header(
    manifest: ModelManifest,
    where: Path,
    ids: dict[Any, str],
    chosen: list[PatchKernel],
    slow: list[str],
) -> str:
    by_task = {t.name: t for t in manifest.tasks}
    lines = [
        f'"""kf export --model: verified kernels for {manifest.model_class}, swapped in by '
        'apply(model)."""',
        "",
        f"# model: {manifest.model_class} from {manifest.entry} "
        f"(sha256 {manifest.entry_sha256[:16]}), extracted on {manifest.device} "
        f"({manifest.device_name}), manifest {where}",
        TRUST.rstrip("\n"),
        "#",
        f"# kernels ({len(chosen)}), each with the run, candidate and verified speed-ups it "
        "came from:",
    ]
    lines += [_kernel_line(ids[k.key], k, by_task[k.task].module_paths) for k in chosen]
    covered = {k.task for k in chosen}
    idle = [t for t in manifest.tasks if t.name not in covered]
    if idle:
        lines.append("# regions no run verified a kernel for (they keep their own code):")
        lines += [f"#   {', '.join(t.module_paths)} (task {t.name})" for t in idle]
    if slow:
        lines.append("# verified kernels left out (no faster than eager at their shapes):")
        lines += [f"#   {line}" for line in slow]
    lines += [
        "#",
        "# use: import kf_patch; kf_patch.apply(model)  # then run it under torch.no_grad()",
        "#      kf_patch.stats(): per module path, calls that ran a kernel and calls that fell",
        "#      back to the original forward (a shape, dtype or device no kernel was verified at)",
    ]
    return "\n".join(lines) + "\n"


def patch_text(
    manifest: ModelManifest, where: Path, chosen: list[PatchKernel], slow: list[str]
) -> str:
    """The whole patch module (see the module docstring)."""
    ids = {k.key: f"k{i}" for i, k in enumerate(chosen)}
    kernels = {
        ids[k.key]: {
            "task": k.task,
            "kind": k.kind,
            "backend": k.backend,
            "candidate": k.candidate_id,
            "run": k.run_id,
            "speedup": round(k.speedup, 4),
            "config": k.config,
        }
        for k in chosen
    }
    regions = [
        {
            "task": t.name,
            "module_class": t.module_class,
            "paths": list(t.module_paths),
            "state": [[s.task_key, s.module_key, s.shape, s.dtype, s.kind] for s in t.state],
            "dispatch": [
                [k.kind, [list(s) for s in k.shapes], list(k.dtypes), ids[k.key]]
                for k in chosen
                if k.task == t.name
            ],
        }
        for t in manifest.tasks
    ]
    model = {
        "model_class": manifest.model_class,
        "entry": manifest.entry,
        "entry_sha256": manifest.entry_sha256,
    }
    sources = "\n\n".join(f"SOURCE_{ids[k.key]} = {_literal(k.source)}" for k in chosen)
    kernel_table = "KERNELS: dict[str, dict[str, Any]] = " + pprint.pformat(kernels, width=96)
    attach = "\n".join(f"KERNELS[{i!r}]['source'] = SOURCE_{i}" for i in ids.values())
    runtime = Path(patch_runtime.__file__).read_text()
    return (
        _header(manifest, where, ids, chosen, slow)
        + "\nfrom __future__ import annotations\n\nfrom typing import Any\n\n"
        + f"MODEL: dict[str, Any] = {pprint.pformat(model, width=96)}\n\n"
        + f"{kernel_table}\n\n"
        + f"REGIONS: list[dict[str, Any]] = {pprint.pformat(regions, width=96)}\n\n"
        + f"{sources}\n\n{attach}\n\n"
        + "# -- the runtime: kf/app/patch_runtime.py, copied verbatim -----------------------\n"
        + runtime.replace("from __future__ import annotations\n", "").replace(
            '__all__ = ["Dispatch", "Patch", "PatchError"]\n', ""
        )
        + _BINDINGS
    )


_BINDINGS = '''

# -- this patch ----------------------------------------------------------------------------

__all__ = ["PatchError", "apply", "kinds", "remove", "reset_stats", "stats"]

_PATCH = Patch(MODEL, KERNELS, REGIONS)


def apply(model: Any, regions: Any = None) -> Any:
    """Swap the verified kernels into ``model`` in place (only the module paths in
    ``regions``, when given); PatchError (one line) when it is not the model exported for."""
    return _PATCH.apply(model, regions)


def remove(model: Any) -> Any:
    """Give every patched region of ``model`` its own forward back."""
    return _PATCH.remove(model)


def stats() -> dict[str, Any]:
    """Per module path: calls that ran a kernel, calls that fell back and why."""
    return _PATCH.stats()


def reset_stats() -> None:
    """Forget the calls counted so far."""
    _PATCH.reset_stats()


def kinds() -> list[str]:
    """The device kinds this patch's kernels run on."""
    return _PATCH.kinds()
'''


def export_model(
    dbs: list[Path],
    manifest_path: Path,
    out: Path,
    *,
    ignore_integrity: bool = False,
    min_speedup: float = 1.0,
) -> tuple[list[PatchKernel], list[str]]:
    """Write the patch for ``manifest_path`` from the runs ``dbs`` at ``out``: the kernels
    it holds and one line per thing the user should know (a run that matched no task)."""
    try:
        manifest = read_manifest(manifest_path)
    except ManifestError as exc:
        raise ExportRefused(str(exc)) from exc
    if not manifest.tasks:
        raise ExportRefused(f"{manifest_path}: the manifest lists no task; run kf extract again")
    notes: list[str] = []
    found: list[PatchKernel] = []
    for db in dbs:
        mine = kernels_of_run(db, manifest, ignore_integrity=ignore_integrity)
        if not mine:
            notes.append(f"{db}: no verified kernel for a task of this manifest (same task text)")
        found += mine
    if not found:
        raise ExportRefused(
            f"no run of {', '.join(map(str, dbs))} verified a kernel for a task of "
            f"{manifest_path} (tasks are matched by their text's sha256): run kf run on the "
            "manifest's folder first"
        )
    chosen, slow = _chosen(found, min_speedup)
    notes += slow
    if not chosen:
        raise ExportRefused(
            f"no verified kernel of {', '.join(map(str, dbs))} is faster than eager by more "
            f"than --min-speedup {min_speedup:g}: there is nothing to patch"
        )
    text = patch_text(manifest, manifest_path, chosen, slow)
    out.write_text(text)
    notes += [f"{k.db}: {k.unverified_log}" for k in chosen if k.unverified_log]
    return chosen, notes


def cmd_export_model(args: argparse.Namespace) -> int:
    """``kf export DB... --model MANIFEST -o OUT``: print what the patch holds."""
    try:
        chosen, notes = export_model(
            list(args.db),
            args.model,
            args.output,
            ignore_integrity=args.ignore_integrity,
            min_speedup=args.min_speedup,
        )
    except ExportRefused as exc:
        print(f"kf export: {exc}", file=sys.stderr)
        return 2
    for line in notes:
        print(f"kf export: {line}", file=sys.stderr)
    tasks = sorted({k.task for k in chosen})
    digest = hashlib.sha256(args.output.read_bytes()).hexdigest()[:16]
    print(
        f"wrote {args.output} ({len(chosen)} kernel(s) for {len(tasks)} task(s) of "
        f"{args.model}; sha256 {digest}); it runs their code in your process: read its header"
    )
    return 0
