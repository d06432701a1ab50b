"""What importing a light part of kf drags in: an event type must not load the evaluation
wing (issue 33: importing ``kf.search_facts`` loaded 24 of its 36 modules), and the command
line must not load the composition of a run (issue 46). Every module named here exists
(:func:`test_the_modules_named_here_exist`), and the check is shown to fail on an import
that does load them, so that a rename cannot turn these tests into ones that always pass."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

#: the grader's stages, its runner pool and its sessions: what an event type must not load
GRADER = [
    "kf.evaluation.grader.sandbox",
    "kf.evaluation.grader.verifying",
    "kf.evaluation.grader.profiling",
    "kf.evaluation.grader.pipeline",
    "kf.evaluation.grader.session",
    "kf.evaluation.grader.compiling",
]
#: the composition of a run: what ``kf --help`` must not load
RUN = ["kf.app.run", "kf.app.orchestra", "kf.app.opening", "kf.evaluation.grader.session"]


def _loaded_after(statement: str) -> list[str]:
    """The kf modules (and torch, if any) a fresh interpreter has loaded after
    ``statement``."""
    code = (
        f"{statement}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith('kf.') or m == 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def test_the_modules_named_here_exist() -> None:
    """Each module these tests expect to stay unloaded is a real module of kf."""
    assert [m for m in {*GRADER, *RUN} if importlib.util.find_spec(m) is None] == []


def test_importing_an_event_type_leaves_the_grading_wing_unloaded() -> None:
    """``kf.search_facts`` needs the reports its events embed (:mod:`kf.reports`), not the
    grader's stages, its runner pool, any module of the wing, or torch."""
    loaded = _loaded_after("import kf.search_facts")
    assert "kf.reports" in loaded
    assert "torch" not in loaded
    assert [m for m in loaded if m.startswith("kf.evaluation")] == []


def test_the_command_line_loads_no_run_until_asked() -> None:
    """``import kf.app.cli`` (what ``kf --help`` does) loads none of a run's composition."""
    loaded = _loaded_after("import kf.app.cli")
    assert "kf.app.cli" in loaded
    assert [m for m in RUN if m in loaded] == []


def test_the_check_fails_on_an_import_that_loads_the_wing() -> None:
    """The same check sees the grader and a run's composition when they are loaded."""
    loaded = _loaded_after("import kf.evaluation.grader.pipeline, kf.app.run")
    assert [m for m in GRADER if m in loaded] != []
    assert [m for m in RUN if m in loaded] != []


def test_the_package_still_offers_its_names_on_first_use() -> None:
    """``from kf.evaluation import evaluate`` loads the stage it names, and unknown names
    are an AttributeError as for any module."""
    loaded = _loaded_after("from kf.evaluation import evaluate, VerifyReport")
    assert "kf.evaluation.grader.pipeline" in loaded
    import kf.evaluation

    with pytest.raises(AttributeError, match="no_such_name"):
        kf.evaluation.no_such_name  # noqa: B018


def test_the_application_offers_its_names_on_first_use() -> None:
    """``kf.app.run`` is the function even once the module of that name is loaded, and an
    unknown name is an AttributeError."""
    code = (
        "import kf.app.run, kf.app\nfrom kf.app import run, RunRequest\n"
        "print(callable(run) and not hasattr(run, '__path__'), run.__module__, "
        "RunRequest.__name__, kf.app.run is run)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "kf.app.run", "RunRequest", "True"]
    import kf.app

    with pytest.raises(AttributeError, match="no_such_name"):
        kf.app.no_such_name  # noqa: B018
