"""docs/map.md, the one-page map of kf, kept true by reading the tree: every path it names
exists, every package of ``kf``, ``agents`` and ``hardware_agents`` is named in it, and
every agent kind registered in ``pyproject.toml`` is named with its file. Each check is
shown able to fail on a map made to break it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "map.md"
#: where the code's packages live
CODE = ("kf", "agents", "hardware_agents")
_PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")


def _named(text: str) -> set[str]:
    """What the map writes in backticks."""
    return set(re.findall(r"`([^`\n]+)`", text))


def _paths(text: str) -> set[str]:
    """The repository paths the map names: in backticks, with a slash or a file suffix."""
    return {
        name
        for name in _named(text)
        if _PATH.match(name) and ("/" in name or name.endswith((".py", ".toml", ".md")))
    }


def _links(text: str) -> set[str]:
    """The relative targets of the map's links, anchors dropped."""
    return {t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if "://" not in t}


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Paths and links the map names that the tree does not have."""
    gone = [p for p in _paths(text) if not (root / p).exists()]
    gone += [t for t in _links(text) if t and not (root / "docs" / t).exists()]
    return sorted(gone)


def packages(root: Path = ROOT) -> list[str]:
    """Every package of the code, as ``kf/app/``."""
    found = []
    for top in CODE:
        for init in (root / top).rglob("__init__.py"):
            found.append(str(init.parent.relative_to(root)) + "/")
    return sorted(found)


def agents(root: Path = ROOT) -> dict[str, str]:
    """Each registered agent kind and the file that defines it."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    points = project["project"]["entry-points"]["kf.agents"]
    return {kind: target.split(":")[0].replace(".", "/") + ".py" for kind, target in points.items()}


def unnamed(text: str, root: Path = ROOT) -> list[str]:
    """Packages, agent kinds and agent files of the code that the map does not name."""
    named = _named(text)
    missing = [p for p in packages(root) if p not in named]
    for kind, path in agents(root).items():
        missing += [n for n in (kind, path) if n not in named]
    return sorted(missing)


def test_docs_map_names_only_paths_that_exist() -> None:
    """Every path and link in docs/map.md is in the tree."""
    assert missing_paths(MAP.read_text()) == []


def test_docs_map_names_every_package_and_agent() -> None:
    """Every package of kf, agents and hardware_agents, and every registered agent kind with
    its file, is named in docs/map.md."""
    assert unnamed(MAP.read_text()) == []


def test_docs_map_check_finds_a_vanished_path_and_a_new_package(tmp_path: Path) -> None:
    """A map naming a path that is not there, or missing a package or an agent the code
    has, is caught: the checks above can fail."""
    (tmp_path / "kf" / "extra").mkdir(parents=True)
    (tmp_path / "kf" / "__init__.py").write_text("")
    (tmp_path / "kf" / "extra" / "__init__.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "pyproject.toml").write_text(
        '[project.entry-points."kf.agents"]\nechoer = "agents.echoer:Echo"\n'
    )
    text = "`kf/` `kf/gone.py` [x](nowhere.md)"
    assert missing_paths(text, tmp_path) == ["kf/gone.py", "nowhere.md"]
    assert unnamed(text, tmp_path) == ["agents/echoer.py", "echoer", "kf/extra/"]
