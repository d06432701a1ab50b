"""The layer rules, held by a test, reading every import of a module (a function's body
included):

- the runtime (every module of ``kf`` but the application layer: cli, app, orchestra,
  report, dashboard) imports no agent (``agents`` or ``hardware_agents``);
- device agents (``hardware_agents``) only describe devices: they import nothing of
  ``agents``;
- ``KF_*`` environment variables are read in one place, :mod:`kf.settings`, and no module
  of kf, ``agents`` or ``hardware_agents`` writes one into its own environment (a runner
  gets its settings in the environment its pool starts it with)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the application layer: the commands and the composition of processes, which may
#: import agents
APPLICATION = {"kf/app/cli.py", "kf/app/orchestra.py", "kf/app/report.py"}
RUNTIME = sorted(
    p
    for p in (ROOT / "kf").rglob("*.py")
    if str(p.relative_to(ROOT)) not in APPLICATION and not {"dashboard", "app"} & set(p.parts)
)
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
