"""The layer rules, held by a test, reading every import of a module (a function's body
included):

- **the layers by package** (:data:`LAYERS`, issue 46): each package of kf, ``agents`` and
  ``hardware_agents`` imports only itself and the packages listed for it, and the layers
  form a stack (no two may import each other, however indirectly). ``kf.kernels`` (what kf
  reads from a source) imports nothing else of kf; kf's own modules (the runtime, the event
  vocabulary, the build API) only ``kf.kernels``; the application, ``kf.app``, alone
  imports the agents;
- the runtime (every module of ``kf`` but the application layer, ``kf/app/``) imports no
  agent (``agents`` or ``hardware_agents``);
- device agents (``hardware_agents``) only describe devices: they import nothing of
  ``agents``;
- ``KF_*`` environment variables are read in one place, :mod:`kf.settings`, and no module
  of kf, ``agents`` or ``hardware_agents`` writes one into its own environment (a runner
  gets its settings in the environment its pool starts it with)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_rules import Import, all_imports, cycles, modules_of

ROOT = Path(__file__).resolve().parent.parent

_WING = {"kf", "kf.kernels", "kf.devices", "kf.cuda", "kf.evaluation.wire"}
#: each layer and the layers it may import besides itself; a module belongs to the longest
#: name here that is its own or a package above it (``kf`` holds kf's own modules: the
#: runtime, the event vocabulary and the build API ``kf.native``)
LAYERS: dict[str, set[str]] = {
    "kf.kernels": set(),
    "kf": {"kf.kernels"},
    "kf.devices": {"kf", "kf.kernels"},
    "kf.cuda": {"kf", "kf.kernels"},
    "kf.evaluation.wire": {"kf", "kf.kernels"},
    "kf.evaluation.runner": _WING,
    "kf.evaluation.grader": _WING,
    "kf.evaluation": {*_WING, "kf.evaluation.grader"},  # the package's lazy names
    "kf.llm": {*_WING, "kf.evaluation", "kf.evaluation.grader"},
    "hardware_agents": {*_WING, "kf.evaluation", "kf.evaluation.grader"},
    "agents": {*_WING, "kf.evaluation", "kf.evaluation.grader", "kf.llm", "hardware_agents"},
    # the application may also run the runner's comparisons in its own process, on code
    # it trusts (a model check)
    "kf.app": {
        *_WING, "kf.evaluation", "kf.evaluation.grader", "kf.evaluation.runner", "kf.llm",
        "hardware_agents", "agents",
    },
}  # fmt: skip

RUNTIME = sorted(p for p in (ROOT / "kf").rglob("*.py") if "app" not in p.parts)
HARDWARE = sorted((ROOT / "hardware_agents").glob("*.py"))
EVERY = sorted([*(ROOT / "kf").rglob("*.py"), *(ROOT / "agents").glob("*.py"), *HARDWARE])
SETTINGS = ROOT / "kf" / "settings.py"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _package(name: str) -> str:
    return name.split(".", maxsplit=1)[0]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def layer_of(module: str) -> str | None:
    """The layer a module belongs to (None: none of :data:`LAYERS`)."""
    owners = [n for n in LAYERS if module == n or module.startswith(n + ".")]
    return max(owners, key=len, default=None)


def uphill(imports: list[Import], layers: dict[str, set[str]]) -> list[str]:
    """Each import (``TYPE_CHECKING`` and function bodies included) from a layer into one
    it may not import."""
    out = []
    for i in imports:
        a, b = layer_of(i.importer), layer_of(i.module)
        if a != b and (a is None or b not in layers[a]):
            out.append(f"{i.importer} ({a}, line {i.line}) imports {i.module} ({b})")
    return sorted(out)


MODULES = modules_of(ROOT)
IMPORTS = all_imports(MODULES)


def test_every_module_has_a_layer() -> None:
    """Each module of kf, agents and hardware_agents belongs to a layer of the stack."""
    assert [m for m in MODULES if layer_of(m) is None] == []
    assert {layer_of(m) for m in MODULES} == set(LAYERS)  # and no layer is empty


def test_no_import_runs_uphill() -> None:
    """Each layer imports only itself and the layers below it."""
    assert uphill(IMPORTS, LAYERS) == []


def test_the_layers_form_a_stack() -> None:
    """No two layers may import each other, directly or through others."""
    assert cycles({layer: set(below) for layer, below in LAYERS.items()}) == []
    assert all(below <= set(LAYERS) for below in LAYERS.values())


def test_an_uphill_import_fails_the_layer_check(tmp_path: Path) -> None:
    """On a made-up tree, the check names each import into a layer above: source know-how
    reading kf's settings, the runtime reaching the application inside a function, devices
    reaching the grader's pools under TYPE_CHECKING, an agent importing the application;
    and a stack whose two layers import each other is caught."""
    files = {
        "kf/__init__.py": "",
        "kf/settings.py": "",
        "kf/kernels/__init__.py": "",
        "kf/kernels/tasks.py": "from kf.settings import current\n",
        "kf/shutdown.py": "def f():\n    from kf.app import cli\n",
        "kf/app/__init__.py": "",
        "kf/app/cli.py": "import agents.archive\nfrom kf.kernels import tasks\n",
        "kf/devices/__init__.py": "",
        "kf/devices/slots.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from kf.evaluation.grader.pools import runner_pool\n"
        ),
        "kf/evaluation/__init__.py": "",
        "kf/evaluation/grader/__init__.py": "",
        "kf/evaluation/grader/pools.py": "from kf.devices import slots\n",
        "agents/__init__.py": "",
        "agents/archive.py": "from kf.app.cli import main\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    imports = all_imports(modules_of(tmp_path))
    assert uphill(imports, LAYERS) == [
        "agents.archive (agents, line 1) imports kf.app.cli (kf.app)",
        "kf.devices.slots (kf.devices, line 3) imports kf.evaluation.grader.pools "
        "(kf.evaluation.grader)",
        "kf.kernels.tasks (kf.kernels, line 1) imports kf.settings (kf)",
        "kf.shutdown (kf, line 2) imports kf.app.cli (kf.app)",
    ]
    assert cycles({**LAYERS, "kf": {"kf.kernels", "kf.app"}}) != []


@pytest.mark.parametrize("path", RUNTIME, ids=_rel)
def test_runtime_modules_import_no_agent(path: Path) -> None:
    """No module of kf below the application layer imports ``agents`` or ``hardware_agents``."""
    agents = sorted(n for n in _imports(path) if _package(n) in ("agents", "hardware_agents"))
    assert not agents, f"{_rel(path)} imports {agents}"


@pytest.mark.parametrize("path", HARDWARE, ids=_rel)
def test_hardware_agents_import_no_agent(path: Path) -> None:
    """A device agent describes its device; the agents beside it live in ``agents``."""
    agents = sorted(n for n in _imports(path) if _package(n) == "agents")
    assert not agents, f"{_rel(path)} imports {agents}"


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _names_kf(node: ast.expr | None) -> bool:
    """A key that names a ``KF_*`` variable: a literal or an f-string starting so."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith("KF_")
    if isinstance(node, ast.JoinedStr) and node.values:
        return _names_kf(node.values[0])
    return False


def _environment_uses(path: Path) -> list[int]:
    """The lines where ``path`` reads or writes a ``KF_*`` variable of its process's
    environment."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        key: ast.expr | None = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if func.attr == "getenv" or (
                _is_environ(func.value) and func.attr in ("get", "setdefault", "pop")
            ):
                key = node.args[0]
        if _names_kf(key):
            found.append(node.lineno)
    return found


@pytest.mark.parametrize("path", [p for p in EVERY if p != SETTINGS], ids=_rel)
def test_kf_variables_are_read_only_by_the_settings(path: Path) -> None:
    """``KF_*`` variables are read through :class:`kf.settings.Settings`, never from
    ``os.environ`` by name, and never written into the process's environment."""
    lines = _environment_uses(path)
    assert not lines, f"{_rel(path)} uses KF_* variables of os.environ on lines {lines}"


def test_the_rules_would_catch_an_import_or_a_read(tmp_path: Path) -> None:
    """The checks read function bodies too (kf imports lazily in many places), and see
    a read, a write and an f-string name alike."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\n"
        "def f(role):\n"
        "    from agents.archive import Archive\n"
        "    os.environ['KF_TF32'] = 'on'\n"
        "    os.environ.setdefault('KF_EVAL_POOL', '3')\n"
        "    return Archive, os.environ.get(f'KF_NATS_{role}_USER'), os.getenv('KF_NCU')\n"
    )
    assert "agents.archive" in _imports(probe)
    assert sorted(_environment_uses(probe)) == [4, 5, 6, 6]
