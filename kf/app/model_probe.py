"""``kf extract``'s probe: the process that imports the user's model, runs it under the
profiler and writes each hot region's task code (``python -m kf.app.model_probe``).

The user's code runs here and only here: ``kf extract`` (:mod:`kf.app.extract`) starts
this module in a subprocess and reads back one JSON :class:`ProbeResult`. Its steps:

1. import ``path.py`` and call the entry (``build`` or ``build(device=...)``); it returns
   ``(model, [inputs, ...])`` or ``{"model": model, "inputs": [inputs, ...]}``, each
   ``inputs`` the positional arguments of one forward (a tuple, or one tensor);
2. move the model and the inputs to the device (dtypes kept), ``model.eval()``;
3. the regions: leaf modules (``leaf``), or the smallest modules above the leaves with
   the leaves under no such module (``fused``);
4. one forward per example input with hooks that record each region's calls: input and
   output shapes, dtypes and statistics (a call whose arguments are not all tensors, or
   that has keyword arguments, cannot be captured: the region says so);
5. per example input, ``repeats`` forwards under ``torch.profiler`` with a
   ``record_function`` range per region call and one around the model: a range's time is
   its CPU time on the CPU and the time of the device kernels launched inside it on a GPU;
6. each captured region's task code (:func:`kf.app.region_code.region_code`).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kf.app.manifest import ExampleInput, InputSignature, StateEntry, TensorSig
from kf.app.task_text import InputRecipe

__all__ = [
    "ProbeError",
    "ProbeResult",
    "ProbedRegion",
    "ProbedSig",
    "as_signature",
    "main",
    "probe",
]

MODEL_RANGE = "kf.model"
REGION_RANGE = "kf.region::"


class ProbeError(Exception):
    """The model cannot be probed at all; the message is one line saying what to do."""


class ProbedSig(msgspec.Struct, frozen=True, kw_only=True):
    """One input signature a region had in one example input's forward."""

    example: int
    inputs: list[InputRecipe]
    outputs: list[TensorSig]
    calls: int = 1


class ProbedRegion(msgspec.Struct, kw_only=True):
    """One region: where it is, what it saw, its time, and its task code or why none."""

    path: str
    module_class: str
    time_ms: list[float] = []  # per example input, one forward
    signatures: list[ProbedSig] = []
    source: str = ""
    how: str = ""
    state: list[StateEntry] = []
    error: str = ""


class ProbeResult(msgspec.Struct, kw_only=True):
    """What the probe found, or (``error``) why it could not probe the model."""

    error: str = ""
    model_class: str = ""
    device_name: str = ""
    torch_version: str = ""
    timing: str = ""
    examples: list[ExampleInput] = []
    regions: list[ProbedRegion] = []


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def load_entry(entry: str, device: str) -> tuple[Any, list[tuple[Any, ...]]]:
    """Import ``path.py:function`` and call it: the model and its example inputs."""
    path_text, sep, func = entry.rpartition(":")
    if not sep or not path_text or not func:
        raise ProbeError(f"{entry}: expected PATH.py:FUNCTION (e.g. my_model.py:build)")
    path = Path(path_text).resolve()
    if not path.is_file():
        raise ProbeError(f"{entry}: no file {path_text}")
    sys.path.insert(0, str(path.parent))  # the model's own imports, in this process only
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ProbeError(f"{entry}: {path_text} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        raise ProbeError(f"{entry}: importing {path_text} raised {_one_line(exc)}") from exc
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ProbeError(f"{entry}: {path_text} defines no function {func}")
    try:
        takes_device = "device" in inspect.signature(fn).parameters
        built = fn(device=device) if takes_device else fn()
    except BaseException as exc:
        raise ProbeError(f"{entry}: {func}() raised {_one_line(exc)}") from exc
    return _model_and_inputs(entry, func, built)


def _model_and_inputs(entry: str, func: str, built: Any) -> tuple[Any, list[tuple[Any, ...]]]:
    import torch

    contract = f"{func}() must return (model, [inputs, ...]) or {{'model': ..., 'inputs': [...]}}"
    if isinstance(built, dict) and "model" in built and "inputs" in built:
        model, examples = built["model"], built["inputs"]
    elif isinstance(built, tuple | list) and len(built) == 2:
        model, examples = built
    else:
        raise ProbeError(f"{entry}: {contract}, not a {type(built).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ProbeError(f"{entry}: {contract}; its model is a {type(model).__name__}")
    if isinstance(examples, torch.Tensor) or not isinstance(examples, list | tuple) or not examples:
        raise ProbeError(f"{entry}: {contract}; its inputs must be a non-empty list")
    out = [tuple(e) if isinstance(e, list | tuple) else (e,) for e in examples]
    return model, out


def _regions(model: Any, mode: str) -> list[tuple[str, Any]]:
    """(path, module) of the regions: leaves, or (``fused``) the smallest modules above
    leaves and the leaves under none of those."""
    named = list(model.named_modules())
    leaves = [(p, m) for p, m in named if not list(m.children())]
    if mode == "leaf":
        return leaves
    parents = [
        (p, m)
        for p, m in named
        if list(m.children()) and all(not list(c.children()) for c in m.children())
    ]
    inside = {f"{p}.{c}" if p else c for p, m in parents for c, _ in m.named_children()}
    return parents + [(p, m) for p, m in leaves if p not in inside]


def _recipe(torch: Any, t: Any) -> InputRecipe:
    dtype = str(t.dtype).removeprefix("torch.")
    if t.numel() == 0:
        return InputRecipe(shape=list(t.shape), dtype=dtype)
    if t.is_floating_point():
        t64 = t.detach().double()
        std = float(t64.std()) if t.numel() > 1 else 0.0
        return InputRecipe(shape=list(t.shape), dtype=dtype, mean=float(t64.mean()), std=std)
    if t.dtype == torch.bool:
        return InputRecipe(shape=list(t.shape), dtype=dtype, mean=float(t.double().mean()))
    return InputRecipe(shape=list(t.shape), dtype=dtype, low=int(t.min()), high=int(t.max()))


def _sig(t: Any) -> TensorSig:
    return TensorSig(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))


class _Capture:
    """Forward hooks on the regions that record each call's signature (and, for the first
    call of each region, its arguments and output, for writing its task code)."""

    def __init__(self, torch: Any, regions: list[tuple[str, Any]]) -> None:
        self.torch = torch
        self.example = 0
        self.seen: dict[str, dict[tuple[Any, ...], ProbedSig]] = {p: {} for p, _ in regions}
        self.first: dict[str, tuple[tuple[Any, ...], Any]] = {}
        self.errors: dict[str, str] = {}
        self.handles = [
            m.register_forward_hook(self._hook(p), with_kwargs=True) for p, m in regions
        ]

    def _hook(self, path: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            self._record(path, args, kwargs, out)

        return hook

    def _record(self, path: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        torch = self.torch
        if path in self.errors:
            return
        if kwargs:
            self.errors[path] = f"called with keyword arguments ({', '.join(sorted(kwargs))})"
            return
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                self.errors[path] = (
                    f"its argument {i} is not a tensor ({type(a).__name__}); a task's "
                    "inputs are tensors"
                )
                return
        outs = out if isinstance(out, tuple | list) else (out,)
        if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
            self.errors[path] = "it returns something other than a tensor or a tuple of tensors"
            return
        key = (self.example, *((tuple(a.shape), a.dtype) for a in args))
        had = self.seen[path].get(key)
        if had is not None:
            self.seen[path][key] = msgspec.structs.replace(had, calls=had.calls + 1)
            return
        self.seen[path][key] = ProbedSig(
            example=self.example,
            inputs=[_recipe(torch, a) for a in args],
            outputs=[_sig(o) for o in outs],
        )
        if path not in self.first:
            self.first[path] = (tuple(a.detach().clone() for a in args), out)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _ranges(regions: list[tuple[str, Any]]) -> list[Any]:
    """Hooks opening a ``record_function`` range per region call."""
    from torch.autograd.profiler import record_function

    stack: list[Any] = []

    def pre(path: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            rf: Any = record_function(REGION_RANGE + path)
            rf.__enter__()
            stack.append(rf)

        return hook

    def post(module: Any, args: Any, out: Any) -> None:
        stack.pop().__exit__(None, None, None)

    handles = []
    for p, m in regions:
        handles.append(m.register_forward_pre_hook(pre(p)))
        handles.append(m.register_forward_hook(post))
    return handles


def _profile(
    torch: Any, model: Any, example: tuple[Any, ...], device: str, repeats: int
) -> dict[str, float]:
    """Milliseconds per forward of the model (key ``MODEL_RANGE``) and of each region."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        model(*example)  # a warm-up forward, unprofiled
    with torch.no_grad(), profile(activities=activities) as prof:
        for _ in range(repeats):
            with record_function(MODEL_RANGE):
                model(*example)
            if cuda:
                torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue  # a GPU-side copy of a range: its kernels are counted on the CPU side
        if e.name == MODEL_RANGE or e.name.startswith(REGION_RANGE):
            us = e.device_time_total if cuda else e.cpu_time_total
            key = e.name.removeprefix(REGION_RANGE)
            times[key] = times.get(key, 0.0) + us / 1000.0 / repeats
    return times


def probe(entry: str, device: str, mode: str, repeats: int) -> ProbeResult:
    """Everything :mod:`kf.app.extract` needs (see the module docstring)."""
    import torch

    from kf.app.region_code import RegionCodeError, region_code

    model, examples = load_entry(entry, device)
    try:
        model = model.to(device).eval()
        examples = [tuple(_to(torch, a, device) for a in e) for e in examples]
    except Exception as exc:
        raise ProbeError(f"{entry}: moving the model to {device} raised {_one_line(exc)}") from exc
    regions = _regions(model, mode)
    capture = _Capture(torch, regions)
    for i, example in enumerate(examples):
        capture.example = i
        try:
            with torch.no_grad():
                model(*example)
        except Exception as exc:
            raise ProbeError(
                f"{entry}: the model's forward on example input {i} raised {_one_line(exc)}"
            ) from exc
    capture.close()
    handles = _ranges(regions)
    timed = [_profile(torch, model, e, device, repeats) for e in examples]
    for h in handles:
        h.remove()
    out = []
    for path, module in regions:
        r = ProbedRegion(
            path=path,
            module_class=f"{type(module).__module__}.{type(module).__qualname__}",
            time_ms=[t.get(path, 0.0) for t in timed],
            signatures=list(capture.seen[path].values()),
            error=capture.errors.get(path, ""),
        )
        if not r.error and path in capture.first:
            args, output = capture.first[path]
            try:
                code = region_code(torch, module, args, output)
                r.source, r.how = code.source, code.how
                r.state = [
                    StateEntry(task_key=a, module_key=b, shape=c, dtype=d, kind=e)
                    for a, b, c, d, e in code.state
                ]
            except RegionCodeError as exc:
                r.error = str(exc)
        out.append(r)
    return _result(torch, model, examples, timed, out, device, repeats)


def _to(torch: Any, value: Any, device: str) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _result(
    torch: Any,
    model: Any,
    examples: list[tuple[Any, ...]],
    timed: list[dict[str, float]],
    regions: list[ProbedRegion],
    device: str,
    repeats: int,
) -> ProbeResult:
    cuda = device.startswith("cuda")
    name = torch.cuda.get_device_name(torch.device(device)) if cuda else "cpu"
    clock = "device kernel time" if cuda else "CPU time"
    return ProbeResult(
        model_class=f"{type(model).__module__}.{type(model).__qualname__}",
        device_name=name,
        torch_version=str(torch.__version__),
        timing=f"torch.profiler {clock}, mean of {repeats} forwards per example input",
        examples=[
            ExampleInput(
                index=i,
                inputs=[_sig(a) for a in e if isinstance(a, torch.Tensor)],
                model_time_ms=t.get(MODEL_RANGE, 0.0),
            )
            for i, (e, t) in enumerate(zip(examples, timed, strict=True))
        ],
        regions=regions,
    )


def as_signature(sig: ProbedSig) -> InputSignature:
    """``sig`` as the manifest states it (shapes and dtypes, no statistics)."""
    return InputSignature(
        example=sig.example,
        inputs=[TensorSig(shape=r.shape, dtype=r.dtype) for r in sig.inputs],
        outputs=sig.outputs,
        calls=sig.calls,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kf.app.model_probe ENTRY --device D --regions M --repeats N --out F``."""
    p = argparse.ArgumentParser(prog="kf.app.model_probe")
    p.add_argument("entry")
    p.add_argument("--device", default="cpu")
    p.add_argument("--regions", default="leaf", choices=("leaf", "fused"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        result = probe(args.entry, args.device, args.regions, args.repeats)
    except ProbeError as exc:
        result = ProbeResult(error=str(exc))
    args.out.write_bytes(msgspec.json.encode(result))
    return 0 if not result.error else 2


if __name__ == "__main__":
    sys.exit(main())
