"""What importing a light part of kf drags in: an event type must not load the evaluation
wing (issue 33: importing ``kf.search_facts`` loaded 24 of its 36 modules)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _loaded_after(statement: str) -> list[str]:
    """The ``kf.evaluation`` modules (and torch, if any) a fresh interpreter has loaded
    after ``statement``."""
    code = (
        f"{statement}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith('kf.evaluation') or m == 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def test_importing_an_event_type_leaves_the_grading_wing_unloaded() -> None:
    """``kf.search_facts`` needs the reports its events embed, not the stages, the runner
    pool or torch."""
    loaded = _loaded_after("import kf.search_facts")
    assert "torch" not in loaded
    for heavy in ("sandbox", "verifying", "profiling", "pipeline", "session", "compiling"):
        assert f"kf.evaluation.{heavy}" not in loaded, loaded


def test_the_package_still_offers_its_names_on_first_use() -> None:
    """``from kf.evaluation import evaluate`` loads the stage it names, and unknown names
    are an AttributeError as for any module."""
    loaded = _loaded_after("from kf.evaluation import evaluate, VerifyReport")
    assert "kf.evaluation.grader.pipeline" in loaded
    import kf.evaluation

    with pytest.raises(AttributeError, match="no_such_name"):
        kf.evaluation.no_such_name  # noqa: B018
