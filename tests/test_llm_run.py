"""`kf run` against the scripted OpenAI-compatible server, end to end, then replay offline."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.harness import SCALE_RELU, logged, replay_check, scripted_llm_run
from tests.llm_server import user_text

_CONFIG = re.compile(r"^CONFIG = \{.*\}$", re.MULTILINE)
_PARENT = re.compile(r"# Parent kernel[^\n]*\n```python\n(.*?)\n```", re.DOTALL)


class KernelResponder:
    """Answers mutation requests with a new CONFIG (rewrite, then diff, alternating) and
    prompt-rewrite requests with a short region; the third mutation answer is garbage."""

    def __init__(self) -> None:
        self.mutations = 0
        self.lock = threading.Lock()
        self.options = [
            '{"UNROLL": 4, "CHUNK": 256, "SIMD": 1}',
            '{"UNROLL": 2, "CHUNK": 64, "SIMD": 1}',
            '{"UNROLL": 4, "CHUNK": 64, "SIMD": 0}',
            '{"UNROLL": 1, "CHUNK": 256, "SIMD": 1}',
        ]

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        text = user_text(body)
        if "Rewrite ONE region" in text:
            return {"content": "```\nVectorise the inner loop; keep chunks cache-sized.\n```"}
        parent = _PARENT.search(text)
        with self.lock:
            n = self.mutations
            self.mutations += 1
        if parent is None or n == 2:
            return {"content": "I would rather talk about the weather."}
        src = parent.group(1)
        old = _CONFIG.search(src)
        assert old is not None
        new_line = f"CONFIG = {self.options[n % len(self.options)]}"
        if new_line == old.group(0):
            new_line = f"CONFIG = {self.options[(n + 1) % len(self.options)]}"
        if n % 2 == 0:
            return {"content": "```python\n" + src.replace(old.group(0), new_line) + "\n```"}
        return {
            "content": f"<<<<<<< SEARCH\n{old.group(0)}\n=======\n{new_line}\n>>>>>>> REPLACE\n"
        }


@pytest.fixture(scope="module")
def llm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    """One run of budget 4 with the scripted server; the server is stopped afterwards."""
    db = tmp_path_factory.mktemp("llmrun") / "run.db"
    report, url = scripted_llm_run(
        KernelResponder(), SCALE_RELU, db, "--budget", "4", "--seed", "5",
        "--max-in-flight", "1",
        "--tune-budget", "4",  # tuned (4: the least that tunes a shape), not the default 12
    )  # fmt: skip
    return db, report, url


def test_llm_run_labels_candidates_with_model_and_url(llm_run: tuple[Path, dict, str]) -> None:
    """Every model-written candidate says which model and endpoint produced it."""
    db, report, url = llm_run
    assert report["finished"] is True
    proposed = [
        c for c in logged(db, "kernel.candidate_proposed") if c.operator not in ("seed", "tune")
    ]
    assert proposed, "no model-written candidate"
    assert {c.mutator for c in proposed} == {f"llm: scripted via {url}"}
    assert {c.operator for c in proposed} <= {"rewrite", "diff"}
    assert all("prompt p" in c.note for c in proposed)


def test_llm_run_records_every_call_verbatim(llm_run: tuple[Path, dict, str]) -> None:
    """Each call's messages, response, usage and model are in the log."""
    db, _, url = llm_run
    calls = logged(db, "llm.called")
    mutate = [c for c in calls if c.purpose == "mutate"]
    assert len(mutate) == 3
    for c in mutate:
        assert c.model == "scripted" and c.base_url == url
        assert c.messages[0].role == "system" and "Parent kernel" in c.messages[1].content
        assert "Target device" in c.messages[1].content and c.prompt_hash
        assert c.response is not None and c.prompt_tokens > 0
    garbage = logged(db, "kernel.mutation_failed")
    assert any("unusable LLM response" in g.reason for g in garbage)


def test_llm_run_chooses_prompts_and_evolves_one(llm_run: tuple[Path, dict, str]) -> None:
    """Prompt choices are recorded decisions and a rewrite request produced a new prompt."""
    db, _, _ = llm_run
    assert [p.prompt_id for p in logged(db, "prompt.seeded")] == ["p0"]
    chosen = logged(db, "prompt.chosen")
    assert len(chosen) == 3 and {c.model for c in chosen} == {"scripted"}
    requested = logged(db, "prompt.rewrite_requested")
    rewritten = logged(db, "prompt.rewritten")
    assert requested and rewritten
    assert rewritten[0].regions[rewritten[0].region].startswith("Vectorise")


def test_llm_run_tunes_the_seed_template(llm_run: tuple[Path, dict, str]) -> None:
    """The tuner timed the elite seed's configuration and neighbours for the task's shape."""
    db, _, _ = llm_run
    tuned = logged(db, "tuning.config_tuned")
    assert tuned, "no tuning recorded"
    t = tuned[0]
    assert t.shape == "[[64, 256]]" and len(t.trials) >= 2
    assert t.best_config is not None and t.best_ms is not None and t.best_ms > 0


def test_llm_run_replay_check_passes_with_server_gone(llm_run: tuple[Path, dict, str]) -> None:
    """`kf replay --check` recomputes archive and prompt decisions without any LLM."""
    db, _, _ = llm_run
    out = replay_check(db)
    assert "prompt_evolver" in out["state"]
    assert out["check"]["decisions_checked"] >= 6
