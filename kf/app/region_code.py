"""A region of a user's model as self-contained task code: its ``Model`` class.

Runs in ``kf extract``'s probe process (:mod:`kf.app.model_probe`), the only process that
holds the user's module. Two ways, tried in order:

- ``nn``: a standard ``torch.nn`` module (its class defined under ``torch.nn``) whose
  constructor's arguments can all be read back from the module's attributes (``Linear``'s
  ``in_features``, ``out_features``, ``bias``; ``RMSNorm``'s ``normalized_shape``, ``eps``…)
  is written as a subclass of that class, so its state's keys are the module's own;
- ``export``: any other module is exported (``torch.export.export``, non-strict) at the
  inputs it was seen with, and its graph's code (ATen ops) is written as a function the
  ``Model`` calls, with the module's parameters and buffers as the ``Model``'s own.

Either way the written class is checked before it is kept: built in a fresh namespace,
given the module's real state, and run on the inputs the module was seen with, its output
must match the module's. Parameter values in the task are drawn at the real parameters'
mean and standard deviation (a norm's weight of ones stays ones); the real values are not
copied into the task.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

__all__ = ["RegionCode", "RegionCodeError", "region_code"]

_LITERAL = (int, float, bool, str, type(None))
_DEVICE = re.compile(r"device\(type='[a-z]+'(?:, index=\d+)?\)")


class RegionCodeError(Exception):
    """A region cannot be written as a task; the message is one line saying why."""


class RegionCode:
    """A region's task code: the ``Model`` class (and what it needs) as source, how it was
    written (``nn`` or ``export``), and its state as ``(task_key, module_key, shape,
    dtype, kind)`` rows."""

    def __init__(self, source: str, how: str, state: list[tuple[str, str, list[int], str, str]]):
        self.source = source
        self.how = how
        self.state = state


def region_code(torch: Any, module: Any, args: tuple[Any, ...], output: Any) -> RegionCode:
    """The task code for ``module``, checked against ``output`` (its output on ``args``);
    :class:`RegionCodeError` when neither way gives code that reproduces it."""
    why_not_nn = ""
    if _is_torch_nn(module) and not list(module.children()):
        try:
            code = _nn_code(torch, module, len(args))
            _check(torch, code, module, args, output)
            return code
        except RegionCodeError as exc:
            why_not_nn = f" (as torch.nn: {exc})"
    code = _export_code(torch, module, args, isinstance(output, torch.Tensor), why_not_nn)
    _check(torch, code, module, args, output)
    return code


def _is_torch_nn(module: Any) -> bool:
    return type(module).__module__.startswith("torch.nn.")


def _dtype(torch: Any, dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _fill_lines(torch: Any, module: Any, key_of: dict[str, str]) -> list[str]:
    """Lines of ``__init__`` drawing each floating-point tensor of the state at the real
    one's mean and standard deviation (``key_of``: module key → the Model's attribute)."""
    lines = []
    for mkey, tensor in module.state_dict(keep_vars=True).items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        t64 = tensor.detach().double()
        mean = float(t64.mean())
        std = float(t64.std()) if tensor.numel() > 1 else 0.0
        lines.append(f"        _fill(self.{key_of[mkey]}, {mean!r}, {std!r})")
    return lines


def _state_rows(
    torch: Any, module: Any, key_of: dict[str, str]
) -> list[tuple[str, str, list[int], str, str]]:
    params = {name for name, _ in module.named_parameters()}
    return [
        (
            key_of[k],
            k,
            list(t.shape),
            _dtype(torch, t.dtype),
            "parameter" if k in params else "buffer",
        )
        for k, t in module.state_dict(keep_vars=True).items()
    ]


def _nn_code(torch: Any, module: Any, nargs: int) -> RegionCode:
    """A subclass of the module's own ``torch.nn`` class, built with its arguments, whose
    forward takes ``nargs`` tensors named as the class's forward names them."""
    cls = type(module)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    first = next(iter(module.state_dict(keep_vars=True).values()), None)
    args: list[str] = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "device":
            continue
        if p.name == "dtype":
            if first is not None and first.is_floating_point():
                args.append(f"dtype=torch.{_dtype(torch, first.dtype)}")
            continue
        if not hasattr(module, p.name):
            if p.default is p.empty:
                raise RegionCodeError(f"{cls.__name__}'s argument {p.name!r} is not an attribute")
            continue
        value = getattr(module, p.name)
        if isinstance(value, torch.Tensor) or (value is None and p.name == "bias"):
            value = value is not None  # Linear's bias=True/False: the attribute is the tensor
        if isinstance(value, list):
            value = tuple(value)
        if not _is_literal(value):
            raise RegionCodeError(f"{cls.__name__}.{p.name} is a {type(value).__name__}")
        args.append(f"{p.name}={value!r}")
    key_of = {k: k for k in module.state_dict()}
    fills = _fill_lines(torch, module, key_of)
    names = _arg_names(cls, nargs)
    body = [
        f"class Model(nn.{cls.__name__}):",
        "    def __init__(self):",
        f"        super().__init__({', '.join(args)})",
        *fills,
        "",
        f"    def forward(self, {names}):",
        f"        return super().forward({names})",
    ]
    if not hasattr(torch.nn, cls.__name__) or getattr(torch.nn, cls.__name__) is not cls:
        raise RegionCodeError(f"{cls.__module__}.{cls.__name__} is not torch.nn.{cls.__name__}")
    return RegionCode("\n".join(body) + "\n", "nn", _state_rows(torch, module, key_of))


def _arg_names(cls: type, nargs: int) -> str:
    """The first ``nargs`` positional parameter names of ``cls.forward`` (else x0, x1…)."""
    try:
        params = list(inspect.signature(getattr(cls, "forward")).parameters.values())[1:]  # noqa: B009
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(names) < nargs:
        names = [f"x{i}" for i in range(nargs)]
    return ", ".join(names[:nargs])


def _is_literal(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_is_literal(v) for v in value)
    return isinstance(value, _LITERAL)


def _export_code(
    torch: Any, module: Any, args: tuple[Any, ...], single: bool, note: str
) -> RegionCode:
    """The module's ``torch.export`` graph as a function the task's ``Model`` calls
    (``single``: the module returns one tensor, not a tuple)."""
    from torch.export.graph_signature import InputKind, OutputKind

    try:
        ep = torch.export.export(module, args, strict=False)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RegionCodeError(
            f"torch.export cannot export it ({type(exc).__name__}: {first[:160]}): "
            "data-dependent control flow or an op export does not know"
            f"{note}; rewrite it without Python branches on tensor values to get a task"
        ) from exc
    sig = ep.graph_signature
    if any(o.kind != OutputKind.USER_OUTPUT for o in sig.output_specs):
        raise RegionCodeError("its forward writes to its own state (a buffer mutation)")
    state, users = [], []
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            users.append(spec.arg.name)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            state.append((spec.arg.name, spec.target))
        else:
            raise RegionCodeError(f"its graph holds a {spec.kind.name.lower()} kf cannot write")
    key_of = {target: target.replace(".", "__") for _, target in state}
    tensors = dict(module.state_dict(keep_vars=True))
    params = {name for name, _ in module.named_parameters()}
    init = []
    for _, target in state:
        t = tensors[target]
        kind = "nn.Parameter" if target in params else ""
        made = f"torch.empty({list(t.shape)}, dtype=torch.{_dtype(torch, t.dtype)})"
        if kind:
            init.append(f"        self.{key_of[target]} = nn.Parameter({made})")
        else:
            init.append(f"        self.register_buffer({key_of[target]!r}, {made})")
    graph = _graph_function(ep.graph_module.code)
    call = ", ".join([*(f"self.{key_of[t]}" for _, t in state), *users])
    body = [
        graph,
        "",
        "class Model(nn.Module):",
        "    def __init__(self):",
        "        super().__init__()",
        *init,
        *_fill_lines(torch, module, key_of),
        "",
        f"    def forward(self, {', '.join(users)}):",
        f"        _DEVICE[0] = {users[0]}.device" if users else "        pass",
        f"        out = _graph({call})",
        "        return out[0]" if single else "        return tuple(out)",
    ]
    rows = _state_rows(torch, module, key_of)
    rows = [r for r in rows if r[1] in key_of]
    return RegionCode("\n".join(body) + "\n", "export", rows)


def _graph_function(code: str) -> str:
    """An exported graph module's ``forward`` as a module-level ``_graph`` function: the
    tensor-metadata asserts dropped, a fixed device replaced by the inputs' device."""
    lines = []
    for line in code.strip("\n").splitlines():
        if "torch.ops.aten._assert_tensor_metadata" in line:
            continue
        lines.append(_DEVICE.sub("_DEVICE[0]", line))
    text = "\n".join(lines).rstrip()
    text = text.replace("def forward(self, ", "def _graph(", 1).replace(
        "def forward(self)", "def _graph()", 1
    )
    return "_DEVICE = [None]  # the device of the task's inputs, set by Model.forward\n\n\n" + text


def _check(torch: Any, code: RegionCode, module: Any, args: tuple[Any, ...], output: Any) -> None:
    """Build ``code``'s Model in a fresh namespace, give it the module's real state, and
    require its output on ``args`` to match ``output``."""
    from kf.app.task_text import PRELUDE

    ns: dict[str, Any] = {"__name__": "kf_region_check"}
    try:
        exec(compile(PRELUDE + code.source, "<region>", "exec"), ns)
        model = ns["Model"]()
        real = module.state_dict()
        model.load_state_dict({task: real[mod] for task, mod, *_ in code.state}, strict=True)
        model = model.to(next(iter(real.values())).device) if real else model
        with torch.no_grad():
            got = model(*args)
    except Exception as exc:
        raise RegionCodeError(
            f"the written task does not run ({type(exc).__name__}: {str(exc)[:160]})"
        ) from exc
    want = output if isinstance(output, tuple | list) else (output,)
    have = got if isinstance(got, tuple | list) else (got,)
    if len(want) != len(have):
        raise RegionCodeError(f"the written task returns {len(have)} outputs, not {len(want)}")
    for w, h in zip(want, have, strict=True):
        if h.shape != w.shape or h.dtype != w.dtype:
            raise RegionCodeError("the written task's output differs in shape or dtype")
        tol = 1e-2 if w.dtype in (torch.float16, torch.bfloat16) else 1e-5
        if w.is_floating_point() and not torch.allclose(h, w, atol=tol, rtol=tol):
            raise RegionCodeError("the written task's output differs from the module's")
        if not w.is_floating_point() and not torch.equal(h, w):
            raise RegionCodeError("the written task's output differs from the module's")
