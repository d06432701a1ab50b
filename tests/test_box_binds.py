"""What a box binds of a ``PYTHONPATH`` folder: a package pip installed there (its own
folder or module and its exact metadata folder), never what merely starts with its name
beside it (issue 43, NX10: ``history_of_secrets/keys.txt`` beside a package ``h``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kf.evaluation.grader import box
from kf.evaluation.grader.box_binds import installed_entries

needs_box = pytest.mark.skipif(box.probe() is not None, reason=f"no runner box here: {box.probe()}")

#: what a runner in the box reports of the paths it is given: readable or not
_LOOK = "import json, os, sys; print(json.dumps({p: os.path.exists(p) for p in sys.argv[1:]}))"


def _site(tmp_path: Path) -> Path:
    """A ``pip --target``-like folder holding a package ``h`` installed as an egg (its
    ``top_level.txt`` says ``h``), a module ``h2`` of another egg, and beside them
    ``h_secrets/keys.txt``, ``history_of_secrets/keys.txt`` and ``h.db``."""
    site = tmp_path / "site"
    (site / "h").mkdir(parents=True)
    (site / "h" / "__init__.py").write_text("")
    (site / "h-1.0.egg-info").mkdir()
    (site / "h-1.0.egg-info" / "top_level.txt").write_text("h\n")
    (site / "h2.py").write_text("")
    (site / "h2-1.0.egg-info").mkdir()
    (site / "h2-1.0.egg-info" / "top_level.txt").write_text("h2\n../escape\n")
    for secret in ("h_secrets/keys.txt", "history_of_secrets/keys.txt", "h.db", "h2_notes.txt"):
        (site / secret).parent.mkdir(parents=True, exist_ok=True)
        (site / secret).write_text("kf-secret-value\n")
    return site


def test_box_binds_egg_package_is_bound_exactly(tmp_path: Path) -> None:
    """An egg's top-level names bind the package's folder, the module's file and the
    metadata folders, and nothing else that starts with those names (nor a name that
    climbs out of the folder)."""
    site = _site(tmp_path)
    names = sorted(p.name for p in installed_entries(site))
    assert names == ["h", "h-1.0.egg-info", "h2-1.0.egg-info", "h2.py"], names


@needs_box
def test_box_binds_sibling_of_a_package_is_not_visible_in_the_box(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a real box with that folder on ``PYTHONPATH``: ``h/__init__.py`` is there,
    ``h_secrets/keys.txt``, ``history_of_secrets/keys.txt`` and ``h.db`` are not."""
    site = _site(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    wanted = [site / "h" / "__init__.py", site / "h_secrets" / "keys.txt"]
    wanted += [site / "history_of_secrets" / "keys.txt", site / "h.db"]
    argv = box.command(
        python=sys.executable,
        scratch=scratch,
        log_path=None,
        env=box.environment(os.environ, scratch, {}),
        run=[sys.executable, "-P", "-c", _LOOK, *map(str, wanted)],
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {str(wanted[0]): True, **{str(p): False for p in wanted[1:]}}, seen
