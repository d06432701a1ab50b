"""robust-kbench task folders as kf tasks, converted at load time, never copied.

A robust-kbench task folder (SakanaAI/robust-kbench's ``tasks/<name>/``) holds
``func_forward.py`` (a functional ``forward_fn(...)``, a ``Model`` whose ``forward`` takes
``fn=forward_fn``, ``get_inputs(**config)``), ``config_forward.json`` (lists of single and
multi input, init and shared configs) and, where it has a backward pass,
``func_backward.py`` with ``config_backward.json``.

Each pass becomes one kf task whose text is self-contained (the task travels in the run's
log, so a remote worker needs no robust-kbench checkout): robust-kbench's file verbatim in
``RK_SOURCE``, its configurations in ``CONFIGS``, and a KernelBench-format ``Model`` whose
``forward`` takes ``forward_fn``'s arguments in order (the module's parameters are
inputs, so every configuration is an input set of one model):

- forward (task ``<name>``): ``Model.forward(*args)`` is ``forward_fn(*args)``;
- backward (task ``<name>_backward``): ``Model.forward(*args, grad_output)`` returns the
  gradients of ``forward_fn`` with respect to each floating-point tensor argument, in
  order (autograd of the reference), so a candidate must produce them.

Configurations are robust-kbench's (``ConfigTask.get_configs``): init x input x shared, the
shared keys laid over the other two. The singles' first is the task's ``get_inputs()``;
every other (the multis', deduplicated) is an entry of ``get_tuning_inputs()`` and of
``get_extra_inputs()``, so the tuner tunes for them and every candidate is verified on all
of them. ``shape_cap`` (``kf run --shape-cap N``, for small machines) sets every integer
of a configuration above N to N before anything is made; the task's text then says so.
"""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path
from typing import Any

from kf.kernels.tasks import Task, TaskError

__all__ = ["BACKWARD_SUFFIX", "is_robust_kbench", "load_folder"]

BACKWARD_SUFFIX = "_backward"
_KINDS = ("input", "init", "shared")


def is_robust_kbench(folder: Path) -> bool:
    """Whether ``folder`` looks like a robust-kbench task folder (either of its files)."""
    return (folder / "func_forward.py").is_file() or (folder / "config_forward.json").is_file()


def load_folder(folder: Path, *, shape_cap: int | None = None) -> list[Task]:
    """The folder's forward task and, where it has one, its backward task; raises
    :class:`TaskError` (one line naming the file and what to do) when a file is missing,
    unreadable or malformed."""
    tasks = [_task(folder, "forward", shape_cap)]
    if (folder / "func_backward.py").exists() or (folder / "config_backward.json").exists():
        tasks.append(_task(folder, "backward", shape_cap))
    return tasks


def _read(path: Path, what: str) -> str:
    if not path.is_file():
        raise TaskError(
            f"{path}: missing; a robust-kbench task folder holds func_<pass>.py and "
            f"config_<pass>.json for each pass ({what})"
        )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"{path}: cannot read: {exc}") from exc


def _task(folder: Path, kind: str, shape_cap: int | None) -> Task:
    func, config = folder / f"func_{kind}.py", folder / f"config_{kind}.json"
    source = _read(func, f"the {kind} pass's functional reference")
    configs = configurations(_read(config, f"the {kind} pass's shapes"), config, shape_cap)
    names = _forward_fn_args(source, func)
    name = folder.name + (BACKWARD_SUFFIX if kind == "backward" else "")
    text = _task_text(name, kind, func, source, configs, names, shape_cap)
    origin = {
        "format": "robust-kbench",
        "folder": str(folder),
        "pass": kind,
        "files": [func.name, config.name],
        "configs": len(configs),
        **({"shape_cap": shape_cap} if shape_cap else {}),
    }
    return Task.from_source(name, text, path=str(folder), origin=origin)


def configurations(
    text: str, path: Path, shape_cap: int | None = None
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(init config, input config)`` pairs of a robust-kbench config file: the singles'
    product first, then the multis' (each new one once), integers capped at ``shape_cap``."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(raw, dict) or not any(
        f"{n}_input_configs" in raw for n in ("single", "multi")
    ):
        raise TaskError(
            f"{path}: holds no single_input_configs or multi_input_configs "
            "(robust-kbench's lists of input, init and shared configs)"
        )
    lists = {key: _config_list(raw, key, path) for key in _keys()}
    out: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for group in ("single", "multi"):
        combos = itertools.product(
            lists[f"{group}_init_configs"],
            lists[f"{group}_input_configs"],
            lists[f"{group}_shared_configs"],
        )
        for init, inputs, shared in combos:
            pair = (
                _capped({**init, **shared}, shape_cap),
                _capped({**inputs, **shared}, shape_cap),
            )
            if pair not in out:
                out.append(pair)
    return out


def _keys() -> list[str]:
    return [f"{g}_{k}_configs" for g in ("single", "multi") for k in _KINDS]


def _config_list(raw: dict[str, Any], key: str, path: Path) -> list[dict[str, Any]]:
    """One of the six lists; a missing one is the other group's (or one empty config)."""
    group, rest = key.split("_", 1)
    other = ("multi" if group == "single" else "single") + "_" + rest
    value = raw.get(key, raw.get(other, [{}]))
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise TaskError(f"{path}: {key} must be a list of objects (config name → value)")
    return value or [{}]


def _capped(config: dict[str, Any], cap: int | None) -> dict[str, Any]:
    if not cap:
        return config
    return {
        k: min(v, cap) if isinstance(v, int) and not isinstance(v, bool) else v
        for k, v in config.items()
    }


def _forward_fn_args(source: str, path: Path) -> list[str]:
    """``forward_fn``'s parameter names, read with ``ast``; a file without ``forward_fn``,
    ``Model`` and ``get_inputs``, or whose ``forward_fn`` does not name its parameters, is
    refused."""
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise TaskError(f"{path}: syntax error at line {exc.lineno}: {exc.msg}") from exc
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    missing = [n for n in ("forward_fn", "Model", "get_inputs") if n not in defs]
    if missing:
        raise TaskError(
            f"{path}: defines no {', '.join(missing)} (a robust-kbench functional reference "
            "has forward_fn, a Model taking fn=forward_fn, and get_inputs)"
        )
    fn = defs["forward_fn"]
    if not isinstance(fn, ast.FunctionDef) or fn.args.vararg or fn.args.kwonlyargs:
        raise TaskError(
            f"{path}: forward_fn must be a function of named positional parameters "
            "(kf passes them as the task's inputs, in order)"
        )
    return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]


def _literal(text: str) -> str:
    """``text`` as a readable triple-quoted Python literal."""
    return "'''" + text.replace("\\", "\\\\").replace("'''", "\\'\\'\\'") + "'''"


_HEAD = '''\
"""robust-kbench task {name!r} ({kind} pass), as kf runs it.

Made by kf (kf.kernels.robust_kbench) from {func} and {config}{cap_note}.
The reference is robust-kbench's functional forward_fn (RK_SOURCE below, verbatim).
Model.forward takes forward_fn's arguments in order, the module's parameters included as
inputs, and {returns}. get_inputs() is the first of CONFIGS; the others are
get_tuning_inputs() and get_extra_inputs(): every candidate is verified on all of them.
"""

import inspect
import types

import torch
from torch import nn

RK_FILE = {rk_file!r}
RK_SOURCE = {source}
#: (init config, input config) pairs, robust-kbench's keys
CONFIGS = {configs!r}

rk = types.ModuleType("robust_kbench_" + {name!r})
rk.__file__ = RK_FILE
exec(compile(RK_SOURCE, RK_FILE, "exec"), rk.__dict__)
forward_fn = rk.forward_fn


class _Captured(Exception):
    pass


def _accepted(fn, config):
    """The keys of ``config`` that ``fn`` takes (all of them where it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(config)
    return {{k: v for k, v in config.items() if k in params}}


def _arguments(index):
    """forward_fn's arguments under CONFIGS[index]: robust-kbench's Model built from the
    init config and called on get_inputs(**input config), with fn catching its call."""
    init, inputs = CONFIGS[index]
    model = rk.Model(**_accepted(rk.Model, init))
    values = rk.get_inputs(**_accepted(rk.get_inputs, inputs))
    seen = []

    def catch(*args, **kwargs):
        seen.append(inspect.signature(forward_fn).bind(*args, **kwargs))
        raise _Captured

    try:
        model(*values, fn=catch)
    except _Captured:
        pass
    if not seen:
        raise RuntimeError("robust-kbench's Model.forward never called fn")
    seen[0].apply_defaults()
    return [
        v.detach().clone() if isinstance(v, torch.Tensor) else v
        for v in seen[0].arguments.values()
    ]
'''

_FORWARD = """

class Model(nn.Module):
    def forward(self, {params}):
        return forward_fn({params})


def _input_set(index):
    return _arguments(index)
"""

_BACKWARD = '''

def _gradients(args, grad_output):
    """The gradients of forward_fn(*args) against grad_output, for each floating-point
    tensor argument in order (zeros where forward_fn does not use it)."""
    with torch.enable_grad():
        leaves = [
            a.detach().requires_grad_(True)
            if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a
            for a in args
        ]
        wanted = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
        out = forward_fn(*leaves)
        grads = torch.autograd.grad(out, wanted, grad_output, allow_unused=True)
    return tuple(torch.zeros_like(w) if g is None else g for g, w in zip(grads, wanted))


class Model(nn.Module):
    def forward(self, {params}, grad_output):
        return _gradients([{params}], grad_output)


def _input_set(index):
    args = _arguments(index)
    with torch.no_grad():
        out = forward_fn(*args)
    return [*args, torch.randn_like(out)]
'''

_TAIL = '''

class _Sets:
    """CONFIGS[1:] as input sets, each made when asked for (one set, not all of them)."""

    def __len__(self):
        return len(CONFIGS) - 1

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return _input_set(i + 1)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def get_inputs():
    return _input_set(0)


def get_init_inputs():
    return []


def get_tuning_inputs():
    return _Sets()


def get_extra_inputs():
    return _Sets()
'''


def _task_text(
    name: str,
    kind: str,
    func: Path,
    source: str,
    configs: list[tuple[dict[str, Any], dict[str, Any]]],
    names: list[str],
    shape_cap: int | None,
) -> str:
    params = ", ".join(names)
    body = (_BACKWARD if kind == "backward" else _FORWARD).format(params=params)
    returns = (
        "returns the gradients of forward_fn against grad_output (its last input), one per "
        "floating-point tensor argument, in order"
        if kind == "backward"
        else "returns forward_fn's result"
    )
    head = _HEAD.format(
        name=name,
        kind=kind,
        func=f"{func.parent.name}/{func.name}",
        config=f"config_{kind}.json",
        cap_note=f", every config integer above {shape_cap} set to {shape_cap}"
        if shape_cap
        else "",
        returns=returns,
        rk_file=f"robust-kbench/{func.parent.name}/{func.name}",
        source=_literal(source),
        configs=configs,
    )
    return head + body + _TAIL
