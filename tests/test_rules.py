"""The rules that matter for kf's code, computed by the tests from its import statements and
definitions (issue 33), each shown able to fail on a small tree made to break it. They read
every module of ``kf``, ``agents`` and ``hardware_agents`` (issue 46):

- **the wall**: no module of :mod:`kf.evaluation.runner` (what runs inside a box) imports
  :mod:`kf.evaluation.grader` or the lazy :mod:`kf.evaluation` package, no module of the
  grader imports the runner, and :mod:`kf.evaluation.wire` (the protocol's structs and
  what they carry) imports neither: only the wire crosses. Nor may a runner reach the
  grader through kf's other modules: what a runner module imports, and what those import
  in turn, holds no grader module;
- **no import cycle** among their modules. An import inside a function counts (it postpones
  the cycle to the first call; the two modules still cannot be read or tested apart); an
  import under ``if TYPE_CHECKING:`` does not (it is never run). An import names the module
  it loads (``from kf.evaluation.grader import box`` is ``kf.evaluation.grader.box``), not
  its parent packages, whose ``__init__`` files hold docstrings or lazy names;
- **no import of another module's ``_private`` name** (``from m import _x``, or
  ``m._x`` of an imported module ``m``): a name that two modules share is public;
- **no function over 80 lines**.

The known exceptions of each rule are listed below with their reason; each list may only
shrink (a listed exception that no longer occurs fails, so that it is struck off), and a
listed long function that grows fails too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: cycles kf still has, as the import that closes each (importer, imported): the test
#: takes these edges out of the graph and finds no cycle in the rest
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}

#: (importer, module, name) of the ``_private`` imports kf still has, each with its reason
KNOWN_PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {}

#: the functions over 80 lines today (module:qualified name -> lines); none may grow
KNOWN_LONG_FUNCTIONS: dict[str, int] = {
    # one frame on purpose: a helper looked up by name at each request could be replaced
    # by a candidate before the guard's check runs
    "kf.evaluation.runner.loop:main": 81,
    # the agents' episode loops, found when the rules began to read agents/ (issue 46): each
    # is one turn's ask, parse, act and record in one frame, whose locals (the transcript,
    # the budget, the tool results) every step reads; not yet split by idea
    "agents.cli_mutator:run_cli_episode": 118,
    "agents.tool_mutator:run_episode": 117,
    "agents.llm_mutator:LlmMutator._episode": 101,
    # the offline mutator's child: choose a parent, a move and its parameters in one frame
    # (issue 46: to split by idea)
    "agents.mutator:OfflineMutator._child": 88,
}

#: the packages whose modules the rules read
PACKAGES = ("kf", "agents", "hardware_agents")

MAX_FUNCTION_LINES = 80

#: what each side of the evaluation wing may import of the wing
WALL = {
    "kf.evaluation.runner": ("kf.evaluation.runner", "kf.evaluation.wire"),
    "kf.evaluation.grader": ("kf.evaluation.grader", "kf.evaluation.wire"),
    "kf.evaluation.wire": ("kf.evaluation.wire",),
}


@dataclass(frozen=True)
class Import:
    """One name an import statement binds: ``module`` is the kf module it loads."""

    importer: str
    module: str
    name: str  # the name taken from ``module`` ("" for ``import module``)
    line: int
    local: bool  # inside a function
    type_only: bool  # under ``if TYPE_CHECKING:``


def module_names(root: Path, package: str = "kf") -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _under_type_checking(tree: ast.Module) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", "")
            if name == "TYPE_CHECKING":
                out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _inside_functions(tree: ast.Module) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            out |= {id(n) for n in ast.walk(node) if n is not node}
    return out


def _base(importer: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``import from`` names (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    package = importer.split(".")
    if path.name != "__init__.py":
        package.pop()
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def imports_of(importer: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    """The imports of kf modules in ``path`` (the module ``importer``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typed, local = _under_type_checking(tree), _inside_functions(tree)
    for node in ast.walk(tree):
        where = {"line": getattr(node, "lineno", 0), "local": id(node) in local}
        where["type_only"] = id(node) in typed
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield Import(importer, alias.name, "", **where)  # type: ignore[arg-type]
        elif isinstance(node, ast.ImportFrom):
            base = _base(importer, path, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    yield Import(importer, submodule, "", **where)  # type: ignore[arg-type]
                elif base in known:
                    yield Import(importer, base, alias.name, **where)  # type: ignore[arg-type]


def modules_of(root: Path) -> dict[str, Path]:
    """Every module of :data:`PACKAGES` under ``root``, by dotted name."""
    return {m: p for package in PACKAGES for m, p in module_names(root, package).items()}


def all_imports(known: dict[str, Path]) -> list[Import]:
    return [i for name, path in known.items() for i in imports_of(name, path, known)]


# -- the wall ------------------------------------------------------------------------


def _side(module: str) -> str | None:
    return next((s for s in WALL if module == s or module.startswith(s + ".")), None)


def wall_crossings(imports: list[Import]) -> list[str]:
    """Each import from one side of the wall into the wing outside what it may import."""
    out = []
    for i in imports:
        side = _side(i.importer)
        if side is None or not i.module.startswith("kf.evaluation"):
            continue
        allowed = WALL[side]
        if not any(i.module == a or i.module.startswith(a + ".") for a in allowed):
            out.append(f"{i.importer} (line {i.line}) imports {i.module}")
    return out


def loaded_by(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    """Every module that importing ``roots`` may load, ``roots`` included."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph.get(module, ())
    return seen


def grader_modules(modules: set[str]) -> list[str]:
    """The grader's modules among ``modules`` (the lazy package counts: it loads them)."""
    return sorted(m for m in modules if _side(m) == "kf.evaluation.grader" or m == "kf.evaluation")


# -- cycles --------------------------------------------------------------------------


def import_graph(imports: list[Import]) -> dict[str, set[str]]:
    """Who imports whom, at run time (``TYPE_CHECKING`` imports left out)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if not i.type_only and i.module != i.importer:
            graph.setdefault(i.importer, set()).add(i.module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted; in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    nodes = sorted(set(graph) | {m for targets in graph.values() for m in targets})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


# -- private names ---------------------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(known: dict[str, Path]) -> set[tuple[str, str, str]]:
    """(importer, module, name) of every ``_private`` name a kf module takes from
    another: imported by name, or read as an attribute of an imported module."""
    found = set()
    for importer, path in known.items():
        imports = list(imports_of(importer, path, known))
        for i in imports:
            if i.module != importer and _private(i.name):
                found.add((importer, i.module, i.name))
        found |= _private_attributes(importer, path, known)
    return found


def _private_attributes(
    importer: str, path: Path, known: dict[str, Path]
) -> set[tuple[str, str, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):  # ``import a.b`` binds ``a``; ``a.b._x`` is read
            for a in node.names:
                if a.name in known:
                    top = a.name.split(".")[0]
                    bound[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom):
            base = _base(importer, path, node)
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, dotted = node.value, []
            while isinstance(chain, ast.Attribute):
                dotted.insert(0, chain.attr)
                chain = chain.value
            if isinstance(chain, ast.Name) and chain.id in bound:
                module = ".".join([bound[chain.id], *dotted])
                if module in known and module != importer:
                    found.add((importer, module, node.attr))
    return found


# -- long functions --------------------------------------------------------------------


def function_lengths(known: dict[str, Path]) -> dict[str, int]:
    """Every function's length in lines (its ``def`` line to its last), by
    ``module:Qualified.name``; a nested function is counted on its own as well."""
    out: dict[str, int] = {}

    def visit(module: str, node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                out[f"{module}:{name}"] = (child.end_lineno or child.lineno) - child.lineno + 1
                visit(module, child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(module, child, prefix + child.name + ".")
            else:
                visit(module, child, prefix)

    for module, path in known.items():
        visit(module, ast.parse(path.read_text(), filename=str(path)), "")
    return out


def long_functions(lengths: dict[str, int], known: dict[str, int]) -> list[str]:
    """Functions over the limit that are not listed, or longer than listed."""
    out = []
    for name, lines in sorted(lengths.items()):
        if lines > MAX_FUNCTION_LINES and lines > known.get(name, MAX_FUNCTION_LINES):
            listed = f" (listed at {known[name]})" if name in known else ""
            out.append(f"{name} has {lines} lines{listed}")
    return out


# -- the tests on kf, agents and hardware_agents ---------------------------------------

KF = modules_of(ROOT)
IMPORTS = all_imports(KF)


def test_the_rules_read_every_package() -> None:
    """The rules read the modules of kf, of the agents and of the device agents, and the
    imports between them."""
    assert {m.split(".")[0] for m in KF} == set(PACKAGES)
    assert {i.importer.split(".")[0] for i in IMPORTS} == set(PACKAGES)


def test_wall_between_runner_and_grader() -> None:
    """No module of the runner imports the grader (or the lazy package), none of the grader
    imports the runner, and the wire imports neither."""
    assert any(m.startswith("kf.evaluation.runner.") for m in KF)  # the rule has a subject
    assert wall_crossings(IMPORTS) == []


def test_a_runner_reaches_no_grader_module_through_kf() -> None:
    """What a runner process may load, following every import of kf (a function's body
    included), holds no module of the grader."""
    runner = [m for m in KF if _side(m) == "kf.evaluation.runner"]
    assert grader_modules(loaded_by(import_graph(IMPORTS), runner)) == []


def test_no_import_cycle_in_kf() -> None:
    """The modules of kf, agents and hardware_agents import each other without a cycle, but
    for the listed exceptions."""
    graph = import_graph(IMPORTS)
    for importer, module in KNOWN_CYCLE_EDGES:
        graph.get(importer, set()).discard(module)
    assert cycles(graph) == []


def test_known_cycles_are_still_there() -> None:
    """Each listed cycle edge still exists and still closes a cycle: a mended one is
    struck off the list."""
    graph = import_graph(IMPORTS)
    in_cycles = {m for component in cycles(graph) for m in component}
    stale = [e for e in KNOWN_CYCLE_EDGES if e[1] not in graph.get(e[0], set())]
    stale += [e for e in KNOWN_CYCLE_EDGES if not {e[0], e[1]} <= in_cycles]
    assert stale == []


def test_no_private_name_crosses_modules() -> None:
    """No module takes another's ``_private`` name, but for the listed exceptions, each of
    which still occurs."""
    found = private_uses(KF)
    assert sorted(found - set(KNOWN_PRIVATE_IMPORTS)) == []
    assert sorted(set(KNOWN_PRIVATE_IMPORTS) - found) == []


def test_no_function_over_80_lines() -> None:
    """No function of kf, agents or hardware_agents is over 80 lines, but for the listed
    ones, none of which grew; a listed one that is gone or short now is struck off."""
    lengths = function_lengths(KF)
    assert long_functions(lengths, KNOWN_LONG_FUNCTIONS) == []
    stale = [n for n in KNOWN_LONG_FUNCTIONS if lengths.get(n, 0) <= MAX_FUNCTION_LINES]
    assert stale == []


# -- each rule can fail ----------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules_of(root)


def test_the_rules_fail_on_a_tree_that_breaks_them(tmp_path: Path) -> None:
    """On a made-up kf that breaks every rule, each check reports what breaks it: a wall
    crossed in both directions (one inside a function, one under TYPE_CHECKING, one
    through the lazy package), a cycle closed inside a function in kf and one in the
    agents, private names taken by import and by attribute, and a long function in kf and
    one in the device agents."""
    long_body = "".join(f"    x{i} = {i}\n" for i in range(81))
    known = _tree(
        tmp_path,
        {
            "kf/__init__.py": "",
            "kf/evaluation/__init__.py": "",
            "kf/evaluation/wire/__init__.py": "",
            "kf/evaluation/wire/protocol.py": "X = 1\n",
            "kf/evaluation/runner/__init__.py": "",
            "kf/evaluation/runner/loop.py": (
                "from kf.evaluation.wire.protocol import X\n"
                "def f():\n    from kf.evaluation.grader import session\n"
            ),
            "kf/evaluation/runner/lazy.py": "from kf.evaluation import evaluate\n",
            "kf/evaluation/grader/__init__.py": "",
            "kf/evaluation/grader/session.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from kf.evaluation.runner.loop import f\n"
            ),
            "kf/a.py": "from kf.b import _hidden\nimport kf.b\nY = kf.b._other\n",
            "kf/b.py": "_hidden = _other = 1\ndef g():\n    from kf import a\n",
            "kf/long.py": f"def big():\n{long_body}",
            "kf/helper.py": "def h():\n    from kf.evaluation.grader import session\n",
            "kf/evaluation/runner/indirect.py": "import kf.helper\n",
            "agents/__init__.py": "",
            "agents/x.py": "from agents import y\n",
            "agents/y.py": "def f():\n    from agents import x\n",
            "hardware_agents/__init__.py": "",
            "hardware_agents/long.py": f"def big():\n{long_body}",
        },
    )
    imports = all_imports(known)
    assert sorted(wall_crossings(imports)) == [
        "kf.evaluation.grader.session (line 3) imports kf.evaluation.runner.loop",
        "kf.evaluation.runner.lazy (line 1) imports kf.evaluation",
        "kf.evaluation.runner.loop (line 3) imports kf.evaluation.grader.session",
    ]
    graph = import_graph(imports)
    reached = loaded_by(graph, ["kf.evaluation.runner.indirect"])
    assert grader_modules(reached) == ["kf.evaluation.grader.session"]
    assert cycles(graph) == [["agents.x", "agents.y"], ["kf.a", "kf.b"]]
    assert "kf.evaluation.runner.loop" not in graph.get("kf.evaluation.grader.session", set())
    assert private_uses(known) == {("kf.a", "kf.b", "_hidden"), ("kf.a", "kf.b", "_other")}
    lengths = function_lengths(known)
    assert lengths["kf.long:big"] == 82
    assert long_functions(lengths, {}) == [
        "hardware_agents.long:big has 82 lines",
        "kf.long:big has 82 lines",
    ]
    known_long = {"kf.long:big": 81, "hardware_agents.long:big": 82}
    assert long_functions(lengths, known_long) == ["kf.long:big has 82 lines (listed at 81)"]
    assert long_functions(lengths, {**known_long, "kf.long:big": 82}) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"c"}}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_cycles_finds_every_strongly_connected_set(
    graph: dict[str, set[str]], expected: list[list[str]]
) -> None:
    """The cycle finder names each set of mutually importing modules, and nothing on a
    chain without a way back."""
    assert cycles(graph) == expected
