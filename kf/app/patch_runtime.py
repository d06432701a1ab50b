"""The runtime of a model patch: the code ``kf export --model`` copies, verbatim, into the
module it writes (``kf_patch.py``), after the patch's tables. The patch is one file; it
needs torch, and kf only to import its kernels' source (:func:`kf.kernels.tasks.import_source`).

:class:`Patch` takes the tables (the model the manifest describes, the kernels, the
regions and their dispatch rows) and replaces, in place, each region's ``forward`` with a
:class:`Dispatch`: an instance attribute that shadows the class's method, so the model's
module tree, ``state_dict`` keys and hooks stay as they were, and :meth:`Patch.remove`
takes it away again. A call runs a kernel only when its inputs' (device kind, shapes,
dtypes) is a dispatch row (a shape set kf verified the kernel at), every argument is a
tensor, autograd is not recording (kernels were verified forward only: run under
``torch.no_grad()`` or ``torch.inference_mode()``), and the region's parameters still
have the dtypes of the manifest; any other call runs the region's original ``forward``
and is counted (:meth:`Patch.stats`), with why. Inputs go to a kernel contiguous (as kf
verified it on ``get_inputs()``'s tensors): a strided view is copied first.

A kernel's ``ModelNew`` is built once per module path, under a forked RNG (the caller's
random state is untouched), and takes the region's own parameters and buffers (the
manifest's ``task_key`` → ``module_key``): the kernel's tensors *are* the model's. A
kernel whose ``ModelNew`` has no such tensor, one of another shape, or parameters of its
own is left out with a warning (its calls fall back) and listed in ``stats()``.

:meth:`Patch.apply` first checks the whole model against the manifest (its class, every
region's module path, class and state shapes) and refuses with one line
(:class:`PatchError`) before it changes anything.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

__all__ = ["Dispatch", "Patch", "PatchError"]


class PatchError(Exception):
    """The patch cannot be applied to this model here; the message is one line."""


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _same_class(obj: Any, recorded: str) -> bool:
    """Whether ``obj``'s class is ``recorded`` (module path and qualified name; a model
    file imported under another package name still matches by its qualified name)."""
    qual = type(obj).__qualname__
    return _class_name(obj) == recorded or recorded == qual or recorded.endswith("." + qual)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors(module: Any) -> dict[str, Any]:
    """A module's parameters and buffers by their ``state_dict`` key."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


class Dispatch:
    """A region module's ``forward`` while patched: a kernel where one was verified for
    the call's inputs, the original ``forward`` elsewhere (counted)."""

    def __init__(
        self, patch: Patch, path: str, module: Any, rows: dict[Any, Any], state: list[Any]
    ) -> None:
        import torch

        self.torch, self.patch, self.path, self.module = torch, patch, path, module
        self.rows = rows  # (kind, shapes, dtypes) -> (kernel id, the kernel's module)
        self.state = state  # (task_key, module_key, shape, dtype, kind) rows
        self.original = type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        why = self._why_not(args, kwargs)
        if why is None:
            kind = args[0].device.type
            key = (
                kind,
                tuple(tuple(a.shape) for a in args),
                tuple(_dtype_name(a.dtype) for a in args),
            )
            row = self.rows.get(key)
            if row is None:
                why = f"no kernel verified at {list(map(list, key[1]))} {list(key[2])} on {kind}"
            else:
                kernel_id, kernel = row
                self.patch.count(self.path, kernel_id)
                return kernel(*(a.contiguous() for a in args))
        self.patch.count(self.path, None, why)
        return self.original(*args, **kwargs)

    def _why_not(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Why a call cannot go to a kernel before its shapes are looked at, or None."""
        torch = self.torch
        if kwargs or not args or not all(isinstance(a, torch.Tensor) for a in args):
            return "an argument that is not a tensor, or a keyword argument"
        if torch.is_grad_enabled() and (
            any(a.requires_grad for a in args) or any(p.requires_grad for p in self._own())
        ):
            return "autograd is recording (kernels are forward only: use torch.no_grad())"
        own = self._own()
        for (_, _, _, dtype, _), tensor in zip(self.state, own, strict=True):
            if _dtype_name(tensor.dtype) != dtype:
                return f"the region's state is {_dtype_name(tensor.dtype)}, verified as {dtype}"
        return None

    def _own(self) -> list[Any]:
        tensors = _tensors(self.module)
        return [tensors[row[1]] for row in self.state]


class Patch:
    """A patch's tables and what :meth:`apply` did with them (see the module docstring).

    ``model``: ``{"model_class", "entry", "entry_sha256"}``; ``kernels``: kernel id →
    ``{"task", "kind", "backend", "candidate", "run", "source", ...}``; ``regions``: per
    manifest task ``{"task", "module_class", "paths", "state", "dispatch"}``, ``state``
    rows ``[task_key, module_key, shape, dtype, kind]``, ``dispatch`` rows ``[kind,
    shapes, dtypes, kernel id]``."""

    def __init__(
        self, model: dict[str, Any], kernels: dict[str, dict[str, Any]], regions: list[Any]
    ) -> None:
        self.model, self.kernels, self.regions = model, kernels, regions
        self.modules: dict[str, Any] = {}  # kernel id -> its imported module
        self.built: dict[tuple[str, str, int], Any] = {}  # (kernel id, path, module) -> kernel
        self.calls: dict[str, dict[str, Any]] = {}
        self.left_out: list[str] = []

    # -- counting ------------------------------------------------------------------------

    def count(self, path: str, kernel_id: str | None, why: str = "") -> None:
        """One call of region ``path``: to ``kernel_id``, or (None) a fallback, and why."""
        entry = self.calls.setdefault(path, {"kernel": 0, "fallback": 0, "why": {}})
        if kernel_id is not None:
            entry["kernel"] += 1
        else:
            entry["fallback"] += 1
            entry["why"][why] = entry["why"].get(why, 0) + 1

    def stats(self) -> dict[str, Any]:
        """Calls per module path (``kernel``, ``fallback``, ``why`` it fell back), and the
        kernels left out at :meth:`apply` with why."""
        calls = {p: {**c, "why": dict(c["why"])} for p, c in self.calls.items()}
        return {"regions": calls, "left_out": list(self.left_out)}

    def reset_stats(self) -> None:
        """Forget the calls counted so far."""
        self.calls.clear()

    # -- checking ------------------------------------------------------------------------

    def kinds(self) -> list[str]:
        """The device kinds the patch's kernels run on (``cpu``, ``cuda``)."""
        return sorted({k["kind"] for k in self.kernels.values()})

    def check(self, model: Any) -> list[tuple[Any, str, Any]]:
        """(region, path, module) for every module path of the manifest; :class:`PatchError`
        (one line) when ``model`` is not the model the patch was exported for."""
        recorded = self.model["model_class"]
        again = f"export the patch again from {self.model['entry']} as it is now"
        if not _same_class(model, recorded):
            raise PatchError(
                f"kf_patch: this patch is for {recorded} ({self.model['entry']}); apply() was "
                f"given a {_class_name(model)}"
            )
        found = []
        for region in self.regions:
            for path in region["paths"]:
                try:
                    module = model.get_submodule(path)
                except AttributeError:
                    raise PatchError(
                        f"kf_patch: the model has no module {path} (region {region['task']}); "
                        f"it is not the model the patch was exported for: {again}"
                    ) from None
                why = self._differs(region, module)
                if why is not None:
                    raise PatchError(f"kf_patch: {path}: {why}; {again}")
                found.append((region, path, module))
        return found

    @staticmethod
    def _differs(region: dict[str, Any], module: Any) -> str | None:
        if not _same_class(module, region["module_class"]):
            return f"a {_class_name(module)}, the manifest's {region['module_class']}"
        tensors = _tensors(module)
        for _, module_key, shape, _, _ in region["state"]:
            if module_key not in tensors:
                return f"no parameter or buffer {module_key!r} (the manifest has one)"
            if list(tensors[module_key].shape) != list(shape):
                return (
                    f"{module_key} has shape {list(tensors[module_key].shape)}, the manifest's "
                    f"{list(shape)}"
                )
        return None

    def _device_kind(self, model: Any) -> str:
        first = next(iter(model.parameters()), None)
        first = first if first is not None else next(iter(model.buffers()), None)
        kind = first.device.type if first is not None else "cpu"
        if kind not in self.kinds():
            backends = sorted({k["backend"] for k in self.kernels.values()})
            raise PatchError(
                f"kf_patch: the model is on {kind}; this patch's kernels run on "
                f"{', '.join(self.kinds()) or 'no device'} (backends {', '.join(backends)}): "
                f"move the model there before apply(), or export a patch from a run on {kind}"
            )
        return str(kind)

    # -- applying ------------------------------------------------------------------------

    def apply(self, model: Any, regions: Iterable[str] | None = None) -> Any:
        """Patch ``model`` in place (only the module paths in ``regions``, when given) and
        return it; :class:`PatchError` (one line), with nothing changed, when it cannot."""
        found = self.check(model)
        kind = self._device_kind(model)
        if any(isinstance(m.__dict__.get("forward"), Dispatch) for m in model.modules()):
            raise PatchError("kf_patch: the model is patched already; remove(model) first")
        wanted = None if regions is None else set(regions)
        known = {path for _, path, _ in found}
        if wanted is not None and wanted - known:
            raise PatchError(
                f"kf_patch: no region {', '.join(sorted(wanted - known))} in this patch "
                f"(regions: {', '.join(sorted(known))})"
            )
        for region, path, module in found:
            if wanted is not None and path not in wanted:
                continue
            rows = self._rows(region, path, module, kind)
            if not rows and not any(r[0] == kind for r in region["dispatch"]):
                continue  # no kernel for this device kind: the region is left as it is
            module.forward = Dispatch(self, path, module, rows, region["state"])
        return model

    def remove(self, model: Any) -> Any:
        """Take every patched ``forward`` off ``model``: it runs its own code again."""
        for m in model.modules():
            if isinstance(m.__dict__.get("forward"), Dispatch):
                del m.__dict__["forward"]
        return model

    def _rows(self, region: dict[str, Any], path: str, module: Any, kind: str) -> dict[Any, Any]:
        rows: dict[Any, Any] = {}
        built: dict[str, Any] = {}
        for row_kind, shapes, dtypes, kernel_id in region["dispatch"]:
            if row_kind != kind:
                continue
            if kernel_id not in built:
                cache = (kernel_id, path, id(module))
                if cache not in self.built:  # built once per module: apply() again is cheap
                    self.built[cache] = self._kernel(kernel_id, path, module, region["state"])
                elif self.built[cache] is not None:  # the module's tensors, as they are now
                    _bind(self.built[cache], _tensors(module), region["state"])
                built[kernel_id] = self.built[cache]
            if built[kernel_id] is not None:
                key = (row_kind, tuple(tuple(s) for s in shapes), tuple(dtypes))
                rows[key] = (kernel_id, built[kernel_id])
        return rows

    def _import(self, kernel_id: str) -> Any:
        if kernel_id not in self.modules:
            from kf.kernels.tasks import import_source

            name = f"kf_patch_kernels.{kernel_id}"
            try:
                self.modules[kernel_id] = import_source(
                    name, self.kernels[kernel_id]["source"], filename=f"<kf_patch {kernel_id}>"
                )
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                raise PatchError(
                    f"kf_patch: kernel {kernel_id} (candidate "
                    f"{self.kernels[kernel_id]['candidate']}) does not import here: "
                    f"{type(exc).__name__}: {first}"
                ) from exc
        return self.modules[kernel_id]

    def _kernel(self, kernel_id: str, path: str, module: Any, state: list[Any]) -> Any:
        """The kernel's ``ModelNew`` for ``module``, holding the module's own tensors;
        None (with a warning, listed in ``stats()``) when it cannot hold them."""
        import torch

        code = self._import(kernel_id)
        own = _tensors(module)
        device = next(iter(own.values())).device if own else None
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(0)  # the CPU's alone: no CUDA state touched
            kernel = code.ModelNew()
        if device is not None:
            kernel = kernel.to(device)
        why = _bind(kernel, own, state)
        if why is not None:
            line = f"kernel {kernel_id} left out at {path}: {why}; its calls run the original"
            warnings.warn(f"kf_patch: {line}", stacklevel=4)
            self.left_out.append(line)
            return None
        return kernel.eval()


def _bind(kernel: Any, own: dict[str, Any], state: list[Any]) -> str | None:
    """Make ``kernel`` hold the region's tensors ``own`` under the task's keys; why not."""
    import torch

    own_params = {k for k, v in own.items() if isinstance(v, torch.nn.Parameter)}
    theirs = _tensors(kernel)
    params = {name for name, _ in kernel.named_parameters()}
    mapped = {row[0] for row in state}
    extra = sorted(params - mapped)
    if extra:
        return f"its ModelNew has parameters the task's Model has not ({', '.join(extra)})"
    for task_key, module_key, _, _, _ in state:
        if task_key not in theirs:
            return f"its ModelNew has no {task_key!r} to take the model's {module_key}"
        if tuple(theirs[task_key].shape) != tuple(own[module_key].shape):
            return f"its {task_key} has shape {list(theirs[task_key].shape)}"
        if (task_key in params) != (module_key in own_params):
            return f"its {task_key} is a {'parameter' if task_key in params else 'buffer'}"
        where, _, leaf = task_key.rpartition(".")
        sub = kernel.get_submodule(where) if where else kernel
        table = sub._parameters if task_key in params else sub._buffers
        table[leaf] = own[module_key]
    return None
