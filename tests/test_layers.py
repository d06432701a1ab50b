"""The layer rules, held by a test: the event core and the evaluation library import no
agent (``agents`` or ``hardware_agents``), anywhere in a module, a function's body
included. The application layer (cli, orchestra, report, dashboard) may."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ["events", "log", "chain", "bus", "runtime", "agent", "replay", "schemas"]
LIBRARIES = [
    *sorted((ROOT / "kf" / "evaluation").glob("*.py")),
    *(ROOT / "kf" / "cuda").glob("*.py"),
]
MODULES = [ROOT / "kf" / f"{name}.py" for name in CORE] + LIBRARIES


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_core_and_library_modules_import_no_agent(path: Path) -> None:
    agents = sorted(n for n in _imports(path) if n.split(".")[0] in ("agents", "hardware_agents"))
    assert not agents, f"{path.relative_to(ROOT)} imports {agents}"


def test_the_rule_would_catch_an_import(tmp_path: Path) -> None:
    """The check reads function bodies too (kf imports lazily in many places)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from agents.archive import Archive\n    return Archive\n")
    assert "agents.archive" in _imports(probe)
