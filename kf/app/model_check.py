"""``kf check-model``'s child process (``python -m kf.app.model_check``): the only process
that imports the user's model and the patch's kernels (both hostile to kf).

1. the entry's model and example inputs, on the device (:func:`kf.app.model_probe.load_entry`);
2. the patch module; a device kind none of its kernels runs on, or a CUDA device this
   machine does not have, is refused with one line; ``apply`` on a copy of the model
   (the original stays unpatched), its refusal (another model) one line too;
3. the input sets: the user's examples, and sets it never saw: each example drawn again
   at its statistics with other seeds, and the first example scaled by the grader's
   :data:`kf.evaluation.grader.grading.SCALES` (3, 0.01, -1;
   :func:`kf.evaluation.runner.variants.scale_inputs`), as kf checks a candidate;
4. per set, the patched model's output against the original's by a candidate's numerics
   rule (:func:`kf.evaluation.runner.compare.compare_outputs`, then
   :func:`~kf.evaluation.runner.compare.judge_float64` against the model run in float64,
   :func:`kf.evaluation.runner.float64.reference_in_float64`), with the patch's fallbacks;
   where it fails, each region is patched alone and judged, to name the wrong one;
5. per example input, end-to-end time of eager, ``torch.compile`` (of the original),
   the patched model, and the model with one region patched at a time, as kf times a
   kernel: warm-up calls, then rounds in turn of about equal time per side until each has
   its samples and time, a flush (L2, on a GPU) before each sample, one forward per
   sample between CUDA events (:mod:`kf.evaluation.runner.device`), the statistics of
   :func:`kf.evaluation.grader.timing_checks.timing_stats`.

Writes one JSON object (``error`` set when it could not check).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["check", "main"]

SEEDS = (1, 2)  # other draws of each example, at its statistics


class CheckError(Exception):
    """The check cannot run; the message is one line."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def _load_patch(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("kf_patch_under_check", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise CheckError(f"--patch {path}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise CheckError(f"--patch {path}: importing it raised {_one_line(exc)}") from exc
    if not callable(getattr(module, "apply", None)) or not callable(getattr(module, "kinds", None)):
        raise CheckError(f"--patch {path}: not a patch kf export --model wrote (no apply/kinds)")
    return module


def _device_ok(torch: Any, patch: Any, device: str) -> None:
    kind = device.partition(":")[0]
    kinds = list(patch.kinds())
    if kind not in kinds:
        backends = sorted({k["backend"] for k in patch.KERNELS.values()})
        raise CheckError(
            f"the patch's kernels run on {', '.join(kinds)} (backends {', '.join(backends)}), "
            f"not on --device {device}: check it on a {' or '.join(kinds)} device"
        )
    if kind == "cuda" and not torch.cuda.is_available():
        raise CheckError(
            f"--device {device}: this machine has no CUDA device, and the patch's kernels "
            "run on cuda: check it on a machine with a GPU"
        )


def _redraw(torch: Any, inputs: Sequence[Any], seed: int) -> list[Any]:
    """``inputs`` drawn again under ``seed``: floats at their mean and std, integers
    between their smallest and largest values, anything else as is."""
    gen = torch.Generator().manual_seed(seed)
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x64 = x.double()
            std = float(x64.std()) if x.numel() > 1 else 1.0
            fresh = torch.randn(x.shape, generator=gen, dtype=torch.float32) * std + float(
                x64.mean()
            )
            out.append(fresh.to(dtype=x.dtype, device=x.device))
        elif isinstance(x, torch.Tensor) and x.dtype != torch.bool and x.numel():
            low, high = int(x.min()), int(x.max())
            fresh = torch.randint(low, high + 1, x.shape, generator=gen, dtype=x.dtype)
            out.append(fresh.to(x.device))
        else:
            out.append(x)
    return out


def input_sets(torch: Any, examples: list[tuple[Any, ...]]) -> list[tuple[str, bool, list[Any]]]:
    """(label, seen by the user, inputs) for every set the check runs (module docstring)."""
    from kf.evaluation.grader.grading import SCALES
    from kf.evaluation.runner.variants import scale_inputs

    sets = [(f"example {i}", True, list(e)) for i, e in enumerate(examples)]
    for i, e in enumerate(examples):
        sets += [(f"example {i} drawn again, seed {s}", False, _redraw(torch, e, s)) for s in SEEDS]
    for factor in SCALES:
        scaled = scale_inputs(
            torch, [x.clone() if isinstance(x, torch.Tensor) else x for x in examples[0]], factor
        )
        if scaled is not None:
            sets.append((f"example 0 scaled by {factor:g}", False, scaled))
    return sets


def _outputs(torch: Any, out: Any) -> list[Any]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


class _Judge:
    """One input set's eager outputs and (once needed) its float64 run: judges outputs by
    a candidate's numerics rule."""

    def __init__(self, torch: Any, model: Any, inputs: list[Any]) -> None:
        self.torch, self.model, self.inputs = torch, model, inputs
        with torch.no_grad():
            self.expected = [o.detach() for o in _outputs(torch, model(*inputs))]
        self.exact: list[Any] | str | None = None

    def __call__(self, got: Any) -> dict[str, Any]:
        from kf.evaluation.runner.compare import compare_outputs, judge_float64
        from kf.evaluation.runner.float64 import reference_in_float64

        torch = self.torch
        got = _outputs(torch, got) if isinstance(got, torch.Tensor | list | tuple) else got
        verdict = compare_outputs(torch, self.expected, got)
        if verdict["ok"] or verdict["kind"] != "mismatch":
            return verdict
        if self.exact is None:
            self.exact = reference_in_float64(torch, self.model, self.inputs, self.expected)
        if isinstance(self.exact, str):
            return {**verdict, "fp64_skipped": self.exact}
        return judge_float64(torch, self.expected, list(got), self.exact, None)


def _forward(torch: Any, model: Any, inputs: list[Any]) -> Any:
    with torch.no_grad():
        return model(*inputs)


def _regions(patch: Any) -> list[dict[str, Any]]:
    """The patch's regions that have a kernel (a manifest task: its module paths)."""
    return [r for r in patch.REGIONS if r["dispatch"]]


def _correctness(torch: Any, patch: Any, model: Any, patched: Any, sets: list[Any]) -> list[Any]:
    results = []
    for label, seen, inputs in sets:
        judge = _Judge(torch, model, inputs)
        patch.reset_stats()
        try:
            verdict = judge(_forward(torch, patched, inputs))
        except Exception as exc:
            verdict = {"ok": False, "kind": "exception", "reason": _one_line(exc)}
        entry: dict[str, Any] = {
            "inputs": label,
            "seen": seen,
            "shapes": [list(x.shape) for x in inputs if isinstance(x, torch.Tensor)],
            "verdict": verdict,
            "calls": patch.stats()["regions"],
        }
        if not verdict["ok"]:
            entry["wrong_regions"] = _blame(torch, patch, patched, inputs, judge)
            patch.remove(patched)
            patch.apply(patched)
        results.append(entry)
    return results


def _blame(torch: Any, patch: Any, patched: Any, inputs: list[Any], judge: _Judge) -> list[Any]:
    """Each region patched alone on ``inputs``: those whose output fails, with why."""
    wrong = []
    for region in _regions(patch):
        patch.remove(patched)
        patch.apply(patched, region["paths"])
        try:
            verdict = judge(_forward(torch, patched, inputs))
        except Exception as exc:
            verdict = {"ok": False, "kind": "exception", "reason": _one_line(exc)}
        if not verdict["ok"]:
            wrong.append({"task": region["task"], "paths": region["paths"], "verdict": verdict})
    return wrong


def _sample(backend: Any, fn: Callable[[], Any]) -> float:
    backend.flush_cache()
    return float(backend.time_call_ns(fn)) / 1e6


def alternate(
    torch: Any, backend: Any, sides: dict[str, tuple[Callable[[], None], Callable[[], Any]]],
    warmup: int, min_trials: int, min_time_s: float, max_trials: int,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """kf's profile timing (:func:`kf.evaluation.grader.profiling`'s rounds) over several
    sides: ``name → (prepare, call)``, ``prepare`` run untimed before each of its rounds."""
    from kf.evaluation.grader.measuring import calls_in
    from kf.evaluation.grader.timing_checks import timing_stats

    samples: dict[str, list[float]] = {name: [] for name in sides}
    per: dict[str, int] = {}
    round_s = max(min_time_s / 10, 0.01)
    with torch.no_grad():
        for name, (prepare, call) in sides.items():
            prepare()
            warm = [_sample(backend, call) for _ in range(warmup)]
            per[name] = calls_in(round_s, statistics.median(warm or [1.0]))
        while min(len(s) for s in samples.values()) < max_trials:
            if all(len(s) >= min_trials and sum(s) >= min_time_s * 1e3 for s in samples.values()):
                break
            for name, (prepare, call) in sides.items():
                prepare()
                got = [_sample(backend, call) for _ in range(per[name])]
                samples[name] += got
                per[name] = calls_in(round_s, statistics.median(got))
    return {name: {**timing_stats(s), "samples": len(s)} for name, s in samples.items()}


def _timing(
    torch: Any, backend: Any, patch: Any, model: Any, patched: Any, examples: list[Any],
    opts: argparse.Namespace,
) -> list[dict[str, Any]]:  # fmt: skip
    compiled: Any = None
    compile_error = ""
    if opts.compile:
        try:
            compiled = torch.compile(model)
        except Exception as exc:
            compile_error = _one_line(exc)
    out = []
    for i, inputs in enumerate(examples):

        def nothing() -> None:
            return None

        def patch_all() -> None:
            patch.remove(patched)
            patch.apply(patched)

        sides: dict[str, tuple[Callable[[], None], Callable[[], Any]]] = {
            "eager": (nothing, functools.partial(model, *inputs)),
            "patched": (patch_all, functools.partial(patched, *inputs)),
        }
        error = compile_error
        if compiled is not None and not error:
            try:
                _forward(torch, compiled, list(inputs))  # compiles here, untimed
                sides["torch.compile"] = (nothing, functools.partial(compiled, *inputs))
            except Exception as exc:
                error = compile_error = _one_line(exc)
        for region in _regions(patch):

            def only(paths: list[str] = region["paths"]) -> None:
                patch.remove(patched)
                patch.apply(patched, paths)

            sides[f"region {region['task']}"] = (only, functools.partial(patched, *inputs))
        stats = alternate(
            torch, backend, sides, opts.warmup, opts.min_trials, opts.time_s, opts.max_trials
        )
        patch_all()
        out.append({"example": i, "sides": stats, "compile_error": error or None})
    return out


def check(opts: argparse.Namespace) -> dict[str, Any]:
    """The whole check (module docstring); :class:`CheckError` when it cannot run."""
    import torch

    from kf.app.model_probe import ProbeError, load_entry
    from kf.evaluation.runner.device import make_backend

    patch = _load_patch(Path(opts.patch))
    _device_ok(torch, patch, opts.device)
    try:
        model, examples = load_entry(opts.entry, opts.device)
        model = model.to(opts.device).eval()
        examples = [
            tuple(x.to(opts.device) if isinstance(x, torch.Tensor) else x for x in e)
            for e in examples
        ]
    except ProbeError as exc:
        raise CheckError(str(exc)) from exc
    patched = copy.deepcopy(model)
    try:
        patch.apply(patched)
    except patch.PatchError as exc:
        raise CheckError(str(exc)) from exc
    left_out = patch.stats()["left_out"]
    sets = input_sets(torch, list(examples))
    start = time.monotonic()
    correctness = _correctness(torch, patch, model, patched, sets)
    backend = make_backend(opts.device, time.perf_counter_ns)
    timing = _timing(torch, backend, patch, model, patched, list(examples), opts)
    return {
        "entry": opts.entry,
        "device": opts.device,
        "device_name": torch.cuda.get_device_name(opts.device)
        if opts.device.startswith("cuda")
        else "cpu",
        "torch_version": torch.__version__,
        "timer": backend.describe_timer(),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "patch_model": patch.MODEL,
        "kernels": {
            k: {n: v for n, v in d.items() if n != "source"} for k, d in patch.KERNELS.items()
        },
        "regions": [{"task": r["task"], "paths": r["paths"]} for r in _regions(patch)],
        "left_out": left_out,
        "correctness": correctness,
        "timing": timing,
        "check_s": time.monotonic() - start,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check and write its JSON to ``--out``."""
    p = argparse.ArgumentParser(prog="python -m kf.app.model_check")
    p.add_argument("entry")
    p.add_argument("--patch", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--time-s", type=float, default=0.5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--min-trials", type=int, default=20)
    p.add_argument("--max-trials", type=int, default=1000)
    opts = p.parse_args(argv)
    try:
        result = check(opts)
    except CheckError as exc:
        result = {"error": str(exc)}
    opts.out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
