"""Static checks on a candidate's source: patterns that usually mean a kernel cheats.

They read the source (``ast``) and never run it. Each finding is a warning string
``"code: detail (line N)"`` recorded in the candidate's :class:`CompileReport`: a
signal for a reader and for the search, not the defence (the sandbox, the
out-of-process reference and the timers are). The codes:

``torch_compute``      a PyTorch compute call (``torch.*``, ``F.*``, a tensor method such as
                       ``.matmul``, the ``@`` operator, an ``nn`` layer) inside ``ModelNew.forward``
``no_custom_kernel``   the candidate builds no native kernel at all
``kernel_never_called`` it builds a kernel but ``forward`` never calls into it (followed through
                       attributes, aliases and the module's functions and classes,
                       :mod:`kf.kernels.calls`; not raised where a call cannot be followed)
``try_fallback``       ``forward`` catches exceptions (a fallback to PyTorch hides a broken kernel)
``stream``             CUDA streams or events are created (work can escape the timer)
``thread``             threads or processes are started (work can escape the timer)
``timer_patching``     timers, ``synchronize`` or modules are reassigned
``introspection``      the garbage collector, stack frames or tracers are used
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from kf.kernels.calls import analyse, dotted_name

__all__ = ["CODES", "check_source"]

CODES = (
    "torch_compute",
    "no_custom_kernel",
    "kernel_never_called",
    "try_fallback",
    "stream",
    "thread",
    "timer_patching",
    "introspection",
)

# torch / F functions that allocate or reshape rather than compute.
_DATA_FUNCS = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "zeros",
        "zeros_like",
        "tensor",
        "as_strided",
        "from_numpy",
        "no_grad",
        "is_tensor",
        "device",
        "Size",
        "float32",
        "float16",
        "bfloat16",
        "get_num_threads",
    }
)
_COMPUTE_METHODS = frozenset(
    {
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "mv",
        "dot",
        "einsum",
        "sum",
        "mean",
        "var",
        "std",
        "prod",
        "max",
        "min",
        "amax",
        "amin",
        "argmax",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "tanh",
        "sigmoid",
        "relu",
        "gelu",
        "silu",
        "softmax",
        "log_softmax",
        "erf",
        "pow",
        "add",
        "sub",
        "mul",
        "div",
        "addcmul",
        "clamp",
        "cumsum",
        "norm",
        "layer_norm",
        "conv2d",
        "linear",
    }
)
_THREAD_NAMES = frozenset(
    {"threading", "_thread", "multiprocessing", "concurrent", "ThreadPoolExecutor", "Thread"}
)
_TIMER_NAMES = frozenset(
    {
        "perf_counter",
        "perf_counter_ns",
        "time",
        "time_ns",
        "monotonic",
        "monotonic_ns",
        "process_time",
        "synchronize",
        "elapsed_time",
        "record",
    }
)
_INTROSPECTION = frozenset(
    {
        "get_objects",
        "get_referrers",
        "get_referents",
        "_getframe",
        "_current_frames",
        "settrace",
        "setprofile",
        "currentframe",
        "stack",
        "f_back",
        "f_locals",
        "f_globals",
    }
)


class _Aliases:
    """Which local names stand for torch, torch.nn.functional and torch.nn."""

    def __init__(self, tree: ast.Module) -> None:
        self.torch = {"torch"}
        self.functional = {"F"}
        self.nn = {"nn"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "torch":
                        self.torch.add(a.asname or "torch")
                    elif a.name == "torch.nn.functional" and a.asname:
                        self.functional.add(a.asname)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full == "torch.nn.functional":
                        self.functional.add(a.asname or a.name)
                    elif full == "torch.nn":
                        self.nn.add(a.asname or a.name)

    def is_compute(self, name: str) -> bool:
        head, _, rest = name.partition(".")
        last = name.rsplit(".", 1)[-1]
        if head in self.functional and rest:
            return True
        if head in self.torch and rest:
            if rest.startswith(("nn.functional.", "special.", "linalg.", "fft.")):
                return True
            return "." not in rest and rest not in _DATA_FUNCS
        return head in self.nn and rest != "" and last[:1].isupper()


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _reachable(cls: ast.ClassDef, start: str) -> list[ast.FunctionDef]:
    """``start`` and the methods of the class it calls through ``self``, transitively."""
    methods = _methods(cls)
    seen: list[str] = []
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.append(name)
        for node in ast.walk(methods[name]):
            if isinstance(node, ast.Call):
                callee = dotted_name(node.func)
                if callee.startswith("self.") and callee.count(".") == 1:
                    todo.append(callee.split(".", 1)[1])
    return [methods[n] for n in seen]


def _warn(code: str, detail: str, node: ast.AST | None) -> str:
    line = getattr(node, "lineno", None)
    return f"{code}: {detail}" + (f" (line {line})" if line else "")


def _forward_checks(tree: ast.Module, aliases: _Aliases) -> Iterator[str]:
    cls = _class(tree, "ModelNew")
    if cls is None or "forward" not in _methods(cls):
        return
    body = _reachable(cls, "forward")
    init = _methods(cls).get("__init__")
    layers: set[str] = set()
    if init is not None:  # self.x = nn.Linear(...) and friends
        for node in ast.walk(init):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and aliases.is_compute(dotted_name(node.value.func))
            ):
                layers.update(
                    dotted_name(t).removeprefix("self.") for t in node.targets if dotted_name(t)
                )
    compute: list[tuple[str, ast.AST]] = []
    calls = analyse(tree)
    kernels = set(calls.names) if calls is not None else set()
    for fn in body:
        for node in ast.walk(fn):
            if isinstance(node, ast.Try) and node.handlers:
                yield _warn("try_fallback", f"{fn.name} catches exceptions", node)
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                compute.append(("@", node))
            if not isinstance(node, ast.Call):
                continue
            func = node.func.value if isinstance(node.func, ast.Subscript) else node.func
            callee = dotted_name(func)  # kernel[grid](...) launches a Triton kernel
            parts = callee.split(".")
            if aliases.is_compute(callee):
                compute.append((callee, node))
            elif (
                isinstance(node.func, ast.Attribute)
                and node.func.attr in _COMPUTE_METHODS
                and not callee.startswith("self.")
                and parts[0] not in kernels  # lib.mm(...): the candidate's own kernel
            ):
                compute.append((f".{node.func.attr}()", node))
            elif callee.startswith("self.") and len(parts) == 2 and parts[1] in layers:
                compute.append((callee, node))
    if compute:
        names = ", ".join(dict.fromkeys(name for name, _ in compute))
        yield _warn("torch_compute", f"ModelNew.forward calls {names}", compute[0][1])
    if calls is None:
        return
    if not calls.built:
        yield _warn("no_custom_kernel", "the candidate builds or loads no native kernel", None)
    elif not calls.reached and calls.certain:
        # only when every call forward makes was followed: where kf cannot tell, no warning
        held = f" ({', '.join(calls.names)})" if calls.names else ""
        yield _warn(
            "kernel_never_called",
            f"a kernel is built{held} but forward never calls it, directly or through "
            "the module's functions, attributes and classes",
            None,
        )


def _module_checks(tree: ast.Module, aliases: _Aliases) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module:
                mods.append(node.module)
            heads = {m.split(".")[0] for m in mods} | {a.name for a in node.names}
            if heads & _THREAD_NAMES:
                yield _warn("thread", f"imports {', '.join(sorted(heads & _THREAD_NAMES))}", node)
            if heads & {"gc", "inspect"}:
                yield _warn(
                    "introspection", f"imports {', '.join(sorted(heads & {'gc', 'inspect'}))}", node
                )
        elif isinstance(node, ast.Call):
            callee = dotted_name(node.func)
            last = callee.rsplit(".", 1)[-1]
            if last in ("Stream", "stream", "Event", "ExternalStream") and "cuda" in callee:
                yield _warn("stream", f"calls {callee}", node)
            elif last == "setattr" and node.args:
                target = dotted_name(node.args[0])
                if target.split(".")[0] in ({"time", "sys", "kf"} | aliases.torch):
                    yield _warn("timer_patching", f"setattr on {target}", node)
            elif last in _INTROSPECTION and callee.split(".")[0] in ("sys", "gc", "inspect"):
                yield _warn("introspection", f"calls {callee}", node)
        elif isinstance(node, ast.Attribute) and node.attr in ("f_back", "f_locals", "f_globals"):
            yield _warn("introspection", f"reads frame attribute {node.attr}", node)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                dotted = dotted_name(t)
                head = dotted.split(".")[0]
                if (
                    isinstance(t, ast.Attribute)
                    and head != "self"
                    and (t.attr in _TIMER_NAMES or head in ({"time", "sys", "kf"} | aliases.torch))
                ):
                    yield _warn("timer_patching", f"assigns {dotted}", node)


def check_source(source: str) -> tuple[str, ...]:
    """Warnings for a candidate's source, in source order per check; ``()`` when clean.

    A source that does not parse yields no warnings (the compile stage reports it).
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    aliases = _Aliases(tree)
    found = list(_module_checks(tree, aliases)) + list(_forward_checks(tree, aliases))
    return tuple(dict.fromkeys(found))
