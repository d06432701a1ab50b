"""``kf export`` with tuned configurations: a drop-in module that dispatches by input shape.

When the run tuned the task's kernel per shape set (search version 3), every tuned
candidate measured correct and fast at its own shape set (``operator="tune"``,
``shape_index > 0``, profiled, not suspect, never failing the generalisation gate) is a
row of the exported module's ``DISPATCH`` table: (device kind, the call's input shapes)
→ the configuration tuned for them, with a comment naming the candidate, the device it was
tuned on and what kf measured. A call whose inputs match no row runs the default: the
task's best kernel, as a plain export writes it. Where one (device kind, shapes) was
tuned on several devices, the row with the best measured speed-up is kept. Only candidates
tuned from the default's template (its ``kf.kernels.params.family``) are rows: with every elite
tuned (search version 4), one tuned from another elite's template at some shape is
measured in the run but its configuration means nothing to the default's code.

The module defines ``ModelNew`` as a subclass of the default kernel's ``ModelNew``; the
variants are built from the same template with their configuration applied
(:func:`kf.kernels.params.apply`), constructed with the same random state, and share the
default's parameters and buffers (so ``state_dict`` and ``load_state_dict`` are the
default's, and the variants follow ``.to()``). ``ModelNew.choose(*inputs)`` says which
configuration a call would run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kf.events import Envelope, decode_event
from kf.kernels import params
from kf.kernels.tuning import parse_shape

__all__ = ["Choice", "dispatch_module", "tuned_choices"]


@dataclass(frozen=True)
class Choice:
    """One row of the dispatch table."""

    kind: str  # device kind: cpu, cuda
    shapes: tuple[tuple[int, ...], ...]
    config: dict[str, Any]
    candidate_id: str
    device_id: str
    speedup: float
    runtime_ms: float
    ref_ms: float
    note: str
    family: str = ""  # the tuned candidate's template family ("": not known)


def tuned_choices(
    state: Any, envelopes: Iterable[Envelope], task: str, family: str = ""
) -> list[Choice]:
    """The best measured tuned candidate per (device kind, input shapes) of ``task``, of
    template ``family`` only when one is given."""
    shapes: dict[str, str] = {}
    notes: dict[str, str] = {}
    for env in envelopes:
        if env.type == "kernel.candidate_proposed":
            ev = decode_event(env)
            if getattr(ev, "task", "") == task and getattr(ev, "shape_index", 0) > 0:
                shapes[ev.candidate_id] = ev.shape  # type: ignore[attr-defined]
                notes[ev.candidate_id] = ev.note  # type: ignore[attr-defined]
    best: dict[tuple[str, tuple[tuple[int, ...], ...]], Choice] = {}
    for c in state.candidates.values():
        shape = parse_shape(shapes.get(c.id, ""))
        if (
            shape is None
            or c.status != "profiled"
            or c.suspect
            or c.generalisation is not None
            or c.speedup is None
            or (family and c.family != family)
        ):
            continue
        kind = c.target.partition(":")[0]
        choice = Choice(
            kind=kind,
            shapes=shape,
            config=dict(c.config),
            candidate_id=c.id,
            device_id=c.tuned_on or c.device_id or "",
            speedup=c.speedup,
            runtime_ms=c.runtime_ms or 0.0,
            ref_ms=c.ref_ms or 0.0,
            note=notes.get(c.id, ""),
            family=c.family,
        )
        key = (kind, shape)
        if key not in best or choice.speedup > best[key].speedup:
            best[key] = choice
    return [best[k] for k in sorted(best)]


def _literal(source: str) -> str:
    """``source`` as a readable Python string literal (raw, triple-quoted when it can be)."""
    if "'''" not in source and not source.endswith("\\") and "\r" not in source:
        return "r'''" + source + "'''"
    return repr(source)


def _comment(text: str) -> str:
    return " ".join(text.split())


def _dispatch_rows(default_source: str, choices: list[Choice]) -> tuple[list[str], list[str]]:
    """The DISPATCH table's rows (a comment and an entry per choice), and why any choice
    was left out (its configuration does not fit the default, or another template family)."""
    family = params.family(default_source)
    rows: list[str] = []
    left_out: list[str] = []
    for ch in choices:
        try:
            params.apply(default_source, ch.config)
        except params.ParamsError as exc:
            left_out.append(f"{ch.candidate_id}: its configuration does not fit the default: {exc}")
            continue
        if ch.family and ch.family != family:
            left_out.append(f"{ch.candidate_id}: tuned from another template")
            continue
        rows.append(
            f"    # candidate {ch.candidate_id}, tuned on {ch.device_id}: {ch.speedup:.2f}x over "
            f"PyTorch eager at these shapes ({ch.runtime_ms:.4f} ms vs {ch.ref_ms:.4f} ms)\n"
            f"    # tuner: {_comment(ch.note)}\n"
            f"    ({ch.kind!r}, {ch.shapes!r}): {ch.config!r},"
        )
    return rows, left_out


def dispatch_module(
    header: str, default_source: str, choices: list[Choice]
) -> tuple[str, list[str]]:
    """The module's text, and why any choice was left out (another template family)."""
    rows, left_out = _dispatch_rows(default_source, choices)
    default_config = params.parse(default_source)
    table = "\n".join(rows)
    text = (
        f'''{header}#
# Dispatch by input shape: a call whose (device kind, input shapes) is a key of DISPATCH
# runs the template with that configuration; every other call runs the default (the
# task's best kernel, CONFIG {default_config[1] if default_config else {}!r}).
"""kf export: the task's best kernel, with configurations tuned per input shape."""

from typing import Any

import torch

from kf.kernels import params
from kf.kernels.tasks import import_source

DISPATCH: dict[tuple[str, tuple[tuple[int, ...], ...]], dict[str, Any]] = {{
{table}
}}

TEMPLATE = {_literal(default_source)}

_default = import_source(__name__ + ".default", TEMPLATE)


'''
        + _DISPATCH_CODE
    )
    return text, left_out


#: the exported module after its DISPATCH table and template: the dispatching ``ModelNew``
_DISPATCH_CODE = '''def _key(inputs: tuple[Any, ...]) -> tuple[str, tuple[tuple[int, ...], ...]]:
    kind = next((x.device.type for x in inputs if isinstance(x, torch.Tensor)), "cpu")
    return kind, tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else () for x in inputs)


def _tie(variant: torch.nn.Module, owner: torch.nn.Module) -> None:
    """Make ``variant`` use ``owner``'s parameters and buffers (same names, same template)."""
    pairs = (("_parameters", owner.named_parameters), ("_buffers", owner.named_buffers))
    for table, named in pairs:
        mine = dict(named(remove_duplicate=False))
        theirs = getattr(variant, "named" + table)(remove_duplicate=False)
        for name, _ in list(theirs):
            path, _, leaf = name.rpartition(".")
            sub = variant.get_submodule(path) if path else variant
            getattr(sub, table)[leaf] = mine[name]


class ModelNew(_default.ModelNew):  # type: ignore[name-defined,misc]
    """The default kernel, dispatching the shapes in DISPATCH to their tuned configuration."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        state = torch.random.get_rng_state()
        super().__init__(*args, **kwargs)
        after = torch.random.get_rng_state()
        variants = {}
        for i, (key, config) in enumerate(DISPATCH.items()):
            module = import_source(f"{__name__}.tuned{i}", params.apply(TEMPLATE, config))
            torch.random.set_rng_state(state)
            variant = module.ModelNew(*args, **kwargs)
            _tie(variant, self)
            variants[key] = variant
        torch.random.set_rng_state(after)
        object.__setattr__(self, "_kf_variants", variants)  # not submodules: they share ours

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        out = super()._apply(fn, *args, **kwargs)
        for variant in getattr(self, "_kf_variants", {}).values():
            _tie(variant, self)
        return out

    def choose(self, *inputs: Any) -> dict[str, Any] | None:
        """The tuned configuration a call with these inputs runs (None: the default)."""
        return DISPATCH.get(_key(inputs))

    def forward(self, *inputs: Any) -> Any:
        variant = self._kf_variants.get(_key(inputs))
        if variant is None:
            return super().forward(*inputs)
        return variant(*inputs)
'''
