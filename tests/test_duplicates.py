"""Duplicate candidates (issue 48, item 5): a `kf run` on the CPU against the scripted model
server (tests/llm_server.py, labelled "scripted": no language model) whose first answer is
its parent over again with only comments and spacing changed."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.harness import SCALE_RELU, logged, replay_check, scripted_llm_run
from tests.llm_server import user_text

_PARENT = re.compile(r"# Parent kernel[^\n]*\n```python\n(.*?)\n```", re.DOTALL)
_CONFIG = re.compile(r"^CONFIG = \{.*\}$", re.MULTILINE)


class NoisyResponder:
    """First answer: the parent with a comment, a docstring and respaced C (the same code);
    every later one: the parent with another CONFIG (new code)."""

    def __init__(self) -> None:
        self.mutations = 0
        self.lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        text = user_text(body)
        parent = _PARENT.search(text)
        if parent is None:  # a prompt rewrite: any short region will do
            return {"content": "```\nKeep the inner loop vectorisable.\n```"}
        with self.lock:
            n = self.mutations
            self.mutations += 1
        src = parent.group(1)
        if n == 0:
            new = "# the same kernel, re-commented\n" + src.replace(
                "    for (int64_t r = 0; r < rows; ++r) {",
                "    for (int64_t r=0; r<rows; ++r) {   // one row at a time\n\n  /* blank */",
            )
            assert new != src and "// one row" in new
        else:
            old = _CONFIG.search(src)
            assert old is not None
            new = src.replace(old.group(0), 'CONFIG = {"UNROLL": 2, "CHUNK": 64, "SIMD": 0}')
        return {"content": "```python\n" + new + "\n```"}


@pytest.fixture(scope="module")
def dup_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A run of budget 3 (the seed and two model answers), no tuning."""
    db = tmp_path_factory.mktemp("duprun") / "run.db"
    report, _ = scripted_llm_run(
        NoisyResponder(), SCALE_RELU, db, "--budget", "3", "--seed", "3",
        "--max-in-flight", "1", "--tune-budget", "0",
    )  # fmt: skip
    return db, report


def test_duplicates_recorded_counted_and_never_timed(dup_run: tuple[Path, dict]) -> None:
    """The re-commented parent is recorded as a duplicate of the seed, counted in the
    report, and never assigned, built or profiled; the real change is profiled."""
    db, report = dup_run
    proposed = logged(db, "kernel.candidate_proposed")
    seed = next(c for c in proposed if c.operator == "seed")
    dups = logged(db, "search.candidate_duplicate")
    assert [(d.duplicate_of, d.duplicate_status) for d in dups] == [(seed.candidate_id, "profiled")]
    dup = dups[0].candidate_id
    assert any(c.candidate_id == dup and "// one row" in c.source for c in proposed)
    for tag in (
        "search.candidate_assigned",
        "kernel.candidate_compiled",
        "kernel.candidate_profiled",
    ):
        assert dup not in {e.candidate_id for e in logged(db, tag)}, tag
    profiled = {e.candidate_id for e in logged(db, "kernel.candidate_profiled")}
    assert len(profiled) == 2 and seed.candidate_id in profiled
    (task,) = report["tasks"]
    assert task["duplicates"] == 1 and task["candidates"] == 3


def test_duplicates_replay_check_passes(dup_run: tuple[Path, dict]) -> None:
    """`kf replay --check` recomputes the duplicate decision from the log alone."""
    db, _ = dup_run
    out = replay_check(db)
    assert out["check"]["decisions_checked"] >= 4
