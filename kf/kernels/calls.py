"""Whether ``ModelNew.forward`` reaches a kernel the candidate builds: a static call graph.

Used by :mod:`kf.kernels.static_checks` for ``kernel_never_called``. It follows what candidates
written by people and by LLMs actually do:

- a built library or kernel bound to a module-level name, to an attribute of the module
  (``self.op = module`` in ``__init__``, then ``self.op.fn(x)`` in ``forward``), to a class
  attribute, or to an alias of any of those (``fn = lib.kernel``; ``self.k = fn``);
- calls that go through functions and classes of the same file: a Triton launch
  ``kernel[grid](...)`` inside ``def fused(...)`` that ``forward`` calls, methods reached
  through ``self``, sub-modules (``self.block = Block()``), ``Function.apply``;
- a kernel handed to a helper as an argument, and ``torch.ops.<lib>.<op>(...)`` after a
  build registered its ops.

It never runs the source. :func:`analyse` says whether forward reaches a kernel, and
whether the answer is *certain*: a call it cannot follow (``getattr(...)(...)``, a
callable passed in, a name imported from elsewhere, an attribute set from something it
does not know) makes a negative answer uncertain, and then no warning is raised. Names in
the answer are module-level names and attributes, never a function's local variables.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field

__all__ = ["KernelCalls", "analyse"]

# Last name of a call that builds or loads native code, whatever it was imported as.
_BUILDER_LAST = frozenset(
    {
        "load_inline",
        "CDLL",
        "PyDLL",
        "LoadLibrary",
        "RawKernel",
        "RawModule",
        "SourceModule",
        "compile_kernel",
        "_create_jit_fn",
        "load_library",
    }
)
# Fully resolved names that build or load native code.
_BUILDER_FULL = frozenset(
    {
        "torch.utils.cpp_extension.load",
        "kf.native.build",
        "kf.native.load",
        "kf.cuda.compile",
    }
)
# Modules whose functions are libraries, not kernels of the candidate's own.
_LIBRARY_HEADS = frozenset(
    {
        "torch",
        "triton",
        "tl",
        "math",
        "numpy",
        "np",
        "functools",
        "itertools",
        "operator",
        "typing",
        "os",
        "sys",
        "time",
        "ctypes",
        "collections",
        "dataclasses",
        "contextlib",
        "warnings",
        "F",
        "nn",
        "kf",
    }
)
_BUILTINS = frozenset(dir(builtins)) | {"super"}
# Calls whose result kf cannot follow statically.
_DYNAMIC = frozenset({"getattr", "eval", "exec", "globals", "vars", "locals", "__import__"})
# nn.Module's own attributes: calling them never runs a kernel of the candidate's.
_MODULE_ATTRS = frozenset(
    {
        "training",
        "register_buffer",
        "register_parameter",
        "register_module",
        "add_module",
        "parameters",
        "named_parameters",
        "buffers",
        "named_buffers",
        "modules",
        "children",
        "to",
        "cuda",
        "cpu",
        "float",
        "half",
        "double",
        "eval",
        "train",
        "state_dict",
        "zero_grad",
        "weight",
        "bias",
    }
)


def dotted_name(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain, else ``""``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _root(node: ast.AST) -> ast.AST:
    """The innermost value of an attribute/subscript/call chain (``a`` of ``a.b[c](d).e``)."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


@dataclass
class _Class:
    node: ast.ClassDef
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    natives: set[str] = field(default_factory=set)  # attributes holding a built kernel
    funcs: dict[str, str] = field(default_factory=dict)  # attribute → module function
    classes: dict[str, str] = field(default_factory=dict)  # attribute → module class
    known: set[str] = field(default_factory=set)  # attributes set from something understood
    unknown: set[str] = field(default_factory=set)  # attributes set from something else
    bases: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class KernelCalls:
    """What the call graph says: whether anything is built, and whether forward reaches it."""

    built: bool
    reached: bool
    certain: bool
    names: tuple[str, ...]  # module-level names and ``self`` attributes that hold kernels


class _Module:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.imports: dict[str, str] = {}  # local name → full dotted name
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.classes: dict[str, _Class] = {}
        self.natives: set[str] = set()  # module-level names holding a kernel or library
        self.builders: set[str] = set()  # module-level functions that build (and return) one
        self.jit: set[str] = set()  # @jit-decorated functions (Triton, Numba, ...)
        self.built = False
        self._read()

    # -- what the module defines ------------------------------------------------
    def _read(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = a.name
                    else:
                        head = a.name.split(".")[0]
                        self.imports.setdefault(head, head)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    self.imports[a.asname or a.name] = f"{node.module}.{a.name}"
        for top in self.tree.body:
            if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions[top.name] = top
                if any(self._is_jit(d) for d in top.decorator_list):
                    self.jit.add(top.name)
                    self.built = True
            elif isinstance(top, ast.ClassDef):
                cls = _Class(top, bases=[dotted_name(b) for b in top.bases])
                for item in top.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        cls.methods[item.name] = item
                self.classes[top.name] = cls
        self.natives |= self.jit
        for _ in range(3):  # builders that call builders; names bound from them
            for name, fn in self.functions.items():
                if name not in self.jit and any(
                    isinstance(n, ast.Call) and self._is_build_call(n) for n in ast.walk(fn)
                ):
                    self.builders.add(name)
                    self.built = True
                for n in ast.walk(fn):  # `global _lib; _lib = load_inline(...)`
                    if isinstance(n, ast.Global):
                        for g in n.names:
                            if self._global_is_native(fn, g):
                                self.natives.add(g)
            for stmt in self._module_statements():
                if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
                    if isinstance(stmt.value, ast.Call) and self._chain_builds(stmt.value):
                        self.built = True
                    if self._native_expr(stmt.value, set()):
                        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                        for t in targets:
                            for name in _target_names(t):
                                self.natives.add(name)
                elif (
                    isinstance(stmt, ast.Expr)
                    and isinstance(stmt.value, ast.Call)
                    and self._chain_builds(stmt.value)  # torch.ops.load_library("x.so")
                ):
                    self.built = True
        for _ in range(3):
            for cls in self.classes.values():
                self._read_class(cls)
        self.built = self.built or any(
            isinstance(n, ast.Call) and self._is_build_call(n) for n in ast.walk(self.tree)
        )

    def _module_statements(self) -> list[ast.stmt]:
        """Module-level statements, including those inside module-level if/try/with blocks."""
        out: list[ast.stmt] = []
        todo: list[ast.stmt] = list(self.tree.body)
        while todo:
            stmt = todo.pop(0)
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            out.append(stmt)
            for name in ("body", "orelse", "finalbody"):
                todo.extend(getattr(stmt, name, []) or [])
            for handler in getattr(stmt, "handlers", []) or []:
                todo.extend(handler.body)
        return out

    def _global_is_native(self, fn: ast.AST, name: str) -> bool:
        for n in ast.walk(fn):
            if (
                isinstance(n, ast.Assign)
                and any(name in _target_names(t) for t in n.targets)
                and self._native_expr(n.value, set())
            ):
                return True
        return False

    def _read_class(self, cls: _Class) -> None:
        """Which attributes of ``cls`` hold kernels, module functions or module classes."""
        for item in cls.node.body:  # class attributes: `op = module`
            if isinstance(item, ast.Assign | ast.AnnAssign) and item.value is not None:
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                for t in targets:
                    for name in _target_names(t):
                        self._bind(cls, name, item.value, set())
        for method in cls.methods.values():
            local = self._locals(method, cls)
            for n in ast.walk(method):
                if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None:
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    for t in targets:
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ):
                            self._bind(cls, t.attr, n.value, local)
                elif (
                    isinstance(n, ast.Call)
                    and dotted_name(n.func) == "setattr"
                    and len(n.args) == 3
                    and isinstance(n.args[0], ast.Name)
                    and n.args[0].id == "self"
                    and isinstance(n.args[1], ast.Constant)
                    and isinstance(n.args[1].value, str)
                ):
                    self._bind(cls, n.args[1].value, n.args[2], local)

    def _bind(self, cls: _Class, attr: str, value: ast.expr, local: set[str]) -> None:
        if self._native_expr(value, local, cls):
            cls.natives.add(attr)
            cls.known.add(attr)
            return
        name = dotted_name(value)
        if isinstance(value, ast.Name) and name in self.functions:
            cls.funcs[attr] = name
            cls.known.add(attr)
            return
        if isinstance(value, ast.Call):
            callee = dotted_name(value.func)
            if callee in self.classes:
                cls.classes[attr] = callee
                cls.known.add(attr)
                return
            if callee in ("functools.partial", "partial") and value.args:
                self._bind(cls, attr, value.args[0], local)
                return
        if attr not in cls.natives and attr not in cls.funcs and attr not in cls.classes:
            if self._understood(value):
                cls.known.add(attr)
            else:
                cls.unknown.add(attr)

    def _understood(self, value: ast.expr) -> bool:
        """Whether a value is something whose calls are never the candidate's kernel:
        constants, containers of them, library calls (``nn.Linear(...)``, ``torch.randn``)."""
        if isinstance(value, ast.Constant | ast.List | ast.Tuple | ast.Dict | ast.Set):
            return True
        if isinstance(value, ast.Call):
            head = self._full(dotted_name(value.func)).split(".")[0]
            return head in _LIBRARY_HEADS or dotted_name(value.func) in _BUILTINS
        return isinstance(value, ast.BinOp | ast.UnaryOp | ast.Compare | ast.BoolOp)

    # -- expressions ------------------------------------------------------------
    def _full(self, dotted: str) -> str:
        """``dotted`` with its head resolved through the module's imports."""
        if not dotted:
            return ""
        head, _, rest = dotted.partition(".")
        full = self.imports.get(head, head)
        return f"{full}.{rest}" if rest else full

    def _is_jit(self, deco: ast.expr) -> bool:
        target = deco.func if isinstance(deco, ast.Call) else deco
        full = self._full(dotted_name(target))
        last = full.rsplit(".", 1)[-1]
        return last in ("jit", "njit", "autotune", "heuristics", "kernel") and not full.startswith(
            "torch."
        )

    def _is_build_call(self, call: ast.Call) -> bool:
        dotted = dotted_name(call.func)
        if not dotted:
            return False
        full = self._full(dotted)
        last = full.rsplit(".", 1)[-1]
        if last in _BUILDER_LAST:
            return True
        if full in _BUILDER_FULL or full.endswith(("cpp_extension.load", "native.build")):
            return True
        return full.endswith("cuda.compile") and not full.startswith("torch.")

    def _chain_builds(self, value: ast.AST) -> bool:
        """Whether an expression builds native code somewhere in its call chain."""
        return any(
            isinstance(n, ast.Call)
            and (self._is_build_call(n) or dotted_name(n.func) in self.builders)
            for n in ast.walk(value)
        )

    def _native_expr(self, value: ast.AST, local: set[str], cls: _Class | None = None) -> bool:
        """Whether ``value`` evaluates to (something reached from) a built kernel."""
        if isinstance(value, ast.Call) and self._chain_builds(value):
            return True
        if isinstance(value, ast.IfExp):
            return self._native_expr(value.body, local, cls) or self._native_expr(
                value.orelse, local, cls
            )
        if isinstance(value, ast.Call) and dotted_name(value.func) in (
            "getattr",
            "functools.partial",
        ):
            return bool(value.args) and self._native_expr(value.args[0], local, cls)
        root = _root(value)
        if isinstance(value, ast.Call | ast.Attribute | ast.Subscript | ast.Name) and isinstance(
            root, ast.Name
        ):
            if root.id in local or root.id in self.natives:
                return True
            if root.id == "self" and cls is not None:
                first = _first_attr(value)
                return first is not None and first in self._attrs(cls, "natives")
        return False

    def _locals(self, fn: ast.AST, cls: _Class | None) -> set[str]:
        """A function's local names that hold kernels (``k = self.lib.fn``)."""
        local: set[str] = set()
        for _ in range(2):
            for n in ast.walk(fn):
                if (
                    isinstance(n, ast.Assign | ast.AnnAssign)
                    and n.value is not None
                    and self._native_expr(n.value, local, cls)
                ):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    for t in targets:
                        local.update(_target_names(t))
        return local

    def _attrs(self, cls: _Class, kind: str) -> set[str] | dict[str, str]:
        """An attribute table of ``cls`` merged with its module-level bases'."""
        table = getattr(cls, kind)
        merged: set[str] | dict[str, str] = set(table) if isinstance(table, set) else dict(table)
        for base in cls.bases:
            other = self.classes.get(base)
            if other is not None and other is not cls:
                more = getattr(other, kind)
                if isinstance(merged, set):
                    merged |= set(more)
                else:
                    merged = {**more, **merged}
        return merged

    def _method(
        self, cls: _Class, name: str
    ) -> tuple[_Class, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        if name in cls.methods:
            return cls, cls.methods[name]
        for base in cls.bases:
            other = self.classes.get(base)
            if other is not None and other is not cls and name in other.methods:
                return other, other.methods[name]
        return None


def _first_attr(node: ast.AST) -> str | None:
    """``b`` of ``self.b.c[...]()``: the attribute right after the root name."""
    chain: list[ast.AST] = []
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        chain.append(node)
        node = node.func if isinstance(node, ast.Call) else node.value
    for item in reversed(chain):
        if isinstance(item, ast.Attribute):
            return item.attr
    return None


def _target_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for e in target.elts for n in _target_names(e)]
    return []


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return set(names)


def _assigned(fn: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                out.update(_target_names(t))
        elif isinstance(
            n, ast.AnnAssign | ast.AugAssign | ast.NamedExpr | ast.For | ast.comprehension
        ):
            out.update(_target_names(n.target))
        elif isinstance(n, ast.With):
            for item in n.items:
                if item.optional_vars is not None:
                    out.update(_target_names(item.optional_vars))
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n is not fn:
            out.add(n.name)
    return out


class _Walk:
    """A walk of the call graph from one method; what it reached and what it could not follow."""

    def __init__(self, module: _Module) -> None:
        self.m = module
        self.seen: set[tuple[str, str]] = set()
        self.reached = False
        self.unresolved: list[str] = []

    def function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, cls: _Class | None) -> None:
        key = (cls.node.name if cls is not None else "", fn.name)
        if key in self.seen or self.reached:
            return
        self.seen.add(key)
        m = self.m
        local = m._locals(fn, cls)
        params = _params(fn) - {"self", "cls", "ctx"}
        assigned = _assigned(fn)
        aliases: dict[str, str] = {}
        for n in ast.walk(fn):  # f = fused  (a module function under another name)
            if (
                isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Name)
                and (n.value.id in m.functions or n.value.id in m.classes)
            ):
                for t in n.targets:
                    for name in _target_names(t):
                        aliases[name] = n.value.id
        for n in ast.walk(fn):
            if not isinstance(n, ast.Call):
                continue
            self.call(n, cls, local, params, assigned, aliases)
            if self.reached:
                return

    def call(
        self,
        n: ast.Call,
        cls: _Class | None,
        local: set[str],
        params: set[str],
        assigned: set[str],
        aliases: dict[str, str],
    ) -> None:
        m = self.m
        func = n.func
        while isinstance(func, ast.Subscript):  # kernel[grid](...)
            func = func.value
        # a kernel passed to a helper (launch(kernel, ...), partial(kernel), ...)
        for arg in [*n.args, *(k.value for k in n.keywords)]:
            if not isinstance(arg, ast.Constant) and m._native_expr(arg, local, cls):
                self.reached = True
                return
        dotted = dotted_name(func)
        full = m._full(dotted)
        if full.startswith("torch.ops.") and m.built:
            self.reached = True  # ops a build registered (load_inline, load_library)
            return
        if isinstance(func, ast.Name):
            name = aliases.get(func.id, func.id)
            if name in local or name in m.natives:
                self.reached = True
            elif name in m.functions and func.id not in local:
                self.function(m.functions[name], None)
            elif name in m.classes:
                self.klass(m.classes[name])
            elif name in params or name in assigned:
                self.unresolved.append(name)  # a callable passed in or made here
            elif name in m.imports:
                head = m.imports[name].split(".")[0]
                if head not in _LIBRARY_HEADS:
                    self.unresolved.append(name)
            elif name not in _BUILTINS:
                self.unresolved.append(name)
            return
        dynamic = [
            x for x in ast.walk(func) if isinstance(x, ast.Call) and dotted_name(x.func) in _DYNAMIC
        ]
        if dynamic:
            self.unresolved.append(f"{dotted_name(dynamic[0].func)}(...)")
            return
        root = _root(func)
        if not isinstance(root, ast.Name):
            return
        if root.id == "self" and cls is not None:
            self.self_call(func, cls)
            return
        if root.id in local or root.id in m.natives or root.id in m.builders:
            self.reached = True  # lib.fn(x), kernel[grid](x), _load().fn(x)
        elif root.id in m.classes:  # _Fn.apply(x), Helper.launch(x)
            self.klass(m.classes[root.id])
        elif root.id in m.functions and isinstance(func, ast.Attribute):
            self.function(m.functions[root.id], None)

    def self_call(self, func: ast.expr, cls: _Class) -> None:
        m = self.m
        first = _first_attr(func)
        if first is None:
            return
        natives = m._attrs(cls, "natives")
        funcs = m._attrs(cls, "funcs")
        classes = m._attrs(cls, "classes")
        assert isinstance(funcs, dict)
        assert isinstance(classes, dict)
        if first in natives:
            self.reached = True
            return
        direct = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
        method = m._method(cls, first)
        if method is not None and direct:
            self.function(method[1], method[0])
        elif first in funcs:
            self.function(m.functions[funcs[first]], None)
        elif first in classes:
            self.klass(m.classes[classes[first]])
        elif first in m._attrs(cls, "unknown") and first not in m._attrs(cls, "known"):
            self.unresolved.append(f"self.{first}")
        elif method is None and first not in m._attrs(cls, "known") and first not in _MODULE_ATTRS:
            # an attribute never assigned in this file (a parent class's, or dynamic)
            self.unresolved.append(f"self.{first}")

    def klass(self, cls: _Class) -> None:
        for method in cls.methods.values():
            self.function(method, cls)
            if self.reached:
                return


def analyse(tree: ast.Module, class_name: str = "ModelNew") -> KernelCalls | None:
    """The call graph of ``class_name.forward``; None when there is no such method."""
    module = _Module(tree)
    cls = module.classes.get(class_name)
    if cls is None:
        return None
    found = module._method(cls, "forward")
    if found is None:
        return None
    walk = _Walk(module)
    walk.function(found[1], found[0])
    names = set(module.natives)
    for c in module.classes.values():
        names |= {f"self.{a}" for a in c.natives}
    return KernelCalls(
        built=module.built,
        reached=walk.reached,
        certain=not walk.unresolved,
        names=tuple(sorted(names)),
    )
