"""`kf run` against the scripted OpenAI-compatible server, end to end, then replay offline."""

from __future__ import annotations

import json
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from kf.events import decode_event
from kf.log import EventLog
from tests.harness import run_kf
from tests.llm_server import ScriptedServer, user_text

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "tests/fixtures/search/scale_relu.py"
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


def kf(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_kf(*args, timeout=timeout)


@pytest.fixture(scope="module")
def llm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    """One run of budget 4 with the scripted server; the server is stopped afterwards."""
    db = tmp_path_factory.mktemp("llmrun") / "run.db"
    with ScriptedServer(responder=KernelResponder()) as server:
        proc = kf(
            "run", str(TASK), "--llm-url", server.url, "--model", "scripted", "--budget", "4",
            "--seed", "5", "--db", str(db), "--json", "--max-in-flight", "1",
            "--tune-budget", "4",  # tuned (4: the least that tunes a shape), not the default 12
        )  # fmt: skip
        url = server.url
    assert proc.returncode == 0, proc.stderr[-4000:]
    return db, json.loads(proc.stdout), url


def _events(db: Path, tag: str) -> list[Any]:
    with EventLog(db, readonly=True) as elog:
        return [decode_event(e) for e in elog.read(types=[tag])]


def test_llm_run_labels_candidates_with_model_and_url(llm_run: tuple[Path, dict, str]) -> None:
    """Every model-written candidate says which model and endpoint produced it."""
    db, report, url = llm_run
    assert report["finished"] is True
    proposed = [
        c for c in _events(db, "kernel.candidate_proposed") if c.operator not in ("seed", "tune")
    ]
    assert proposed, "no model-written candidate"
    assert {c.mutator for c in proposed} == {f"llm: scripted via {url}"}
    assert {c.operator for c in proposed} <= {"rewrite", "diff"}
    assert all("prompt p" in c.note for c in proposed)


def test_llm_run_records_every_call_verbatim(llm_run: tuple[Path, dict, str]) -> None:
    """Each call's messages, response, usage and model are in the log."""
    db, _, url = llm_run
    calls = _events(db, "llm.called")
    mutate = [c for c in calls if c.purpose == "mutate"]
    assert len(mutate) == 3
    for c in mutate:
        assert c.model == "scripted" and c.base_url == url
        assert c.messages[0].role == "system" and "Parent kernel" in c.messages[1].content
        assert "Target device" in c.messages[1].content and c.prompt_hash
        assert c.response is not None and c.prompt_tokens > 0
    garbage = _events(db, "kernel.mutation_failed")
    assert any("unusable LLM response" in g.reason for g in garbage)


def test_llm_run_chooses_prompts_and_evolves_one(llm_run: tuple[Path, dict, str]) -> None:
    """Prompt choices are recorded decisions and a rewrite request produced a new prompt."""
    db, _, _ = llm_run
    assert [p.prompt_id for p in _events(db, "prompt.seeded")] == ["p0"]
    chosen = _events(db, "prompt.chosen")
    assert len(chosen) == 3 and {c.model for c in chosen} == {"scripted"}
    requested = _events(db, "prompt.rewrite_requested")
    rewritten = _events(db, "prompt.rewritten")
    assert requested and rewritten
    assert rewritten[0].regions[rewritten[0].region].startswith("Vectorise")


def test_llm_run_tunes_the_seed_template(llm_run: tuple[Path, dict, str]) -> None:
    """The tuner timed the elite seed's configuration and neighbours for the task's shape."""
    db, _, _ = llm_run
    tuned = _events(db, "tuning.config_tuned")
    assert tuned, "no tuning recorded"
    t = tuned[0]
    assert t.shape == "[[64, 256]]" and len(t.trials) >= 2
    assert t.best_config is not None and t.best_ms is not None and t.best_ms > 0


def test_llm_run_replay_check_passes_with_server_gone(llm_run: tuple[Path, dict, str]) -> None:
    """`kf replay --check` recomputes archive and prompt decisions without any LLM."""
    db, _, _ = llm_run
    proc = kf("replay", str(db), "--check", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["check"]["ok"] is True
    assert "prompt_evolver" in out["state"]
    assert out["check"]["decisions_checked"] >= 6
