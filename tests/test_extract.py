"""``kf extract`` on the CPU: the example decoder block's hot regions as self-contained
tasks with a manifest, a scripted-model run on them to final verdicts, and bad input
(an entry that raises, a region torch.export cannot export, a region called with a
non-tensor argument) as one line each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kf.app.manifest import read_manifest
from tests.harness import replay_check, run_kf, scripted_llm_run
from tests.llm_server import echo_reference

BLOCK = "examples/models/decoder_block.py:build"

LOAD_EACH = r"""
import importlib.util, sys
from pathlib import Path
import torch
for path in sorted(Path(".").glob("*.py")):
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs())
    sets = [mod.get_inputs(), *getattr(mod, "get_tuning_inputs", lambda: [])()]
    with torch.no_grad():
        for inputs in sets:
            model(*inputs)
    print(path.name, len(sets))
assert "decoder_block" not in sys.modules
assert not any("examples" in p for p in sys.path), sys.path
"""


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny fp32 block extracted on the CPU, every region kept."""
    out = tmp_path_factory.mktemp("extract") / "tasks"
    proc = run_kf("extract", BLOCK, "-o", str(out), "--top", "10", "--min-share", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tasks cover" in proc.stdout
    return out


def test_extract_tasks_load_without_the_model_code(extracted: Path) -> None:
    """Each task runs in a fresh process whose path holds no folder of the model's code,
    at its own shapes and at its tuning shapes (the other sequence length)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_EACH],
        cwd=extracted,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = dict(line.split() for line in proc.stdout.splitlines())
    assert len(loaded) == 6 and set(loaded.values()) == {"2"}, loaded
    for path in extracted.glob("*.py"):
        assert "decoder_block" not in re.sub(r'""".*?"""', "", path.read_text(), flags=re.S)


def test_extract_manifest_groups_identical_regions_and_states_coverage(extracted: Path) -> None:
    """The manifest groups q/k/v/o into one task, its shares sum to at most 1, coverage is
    their sum, and each task's hash and signatures (both sequence lengths) are stated."""
    import hashlib

    m = read_manifest(extracted / "manifest.json")
    assert m.device == "cpu" and len(m.examples) == 2 and m.model_time_ms > 0
    shares = [t.share for t in m.tasks]
    assert 0 < sum(shares) <= 1.0 + 1e-9
    assert m.coverage == pytest.approx(sum(shares))
    by_paths = {tuple(t.module_paths): t for t in m.tasks}
    qkvo = by_paths[("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj")]
    assert qkvo.how == "nn" and qkvo.module_class == "torch.nn.modules.linear.Linear"
    assert [s.inputs[0].shape for s in qkvo.signatures] == [[2, 16, 64], [2, 8, 64]]
    assert [e.example for e in qkvo.signatures] == [0, 1]
    core = by_paths[("attn.core",)]
    assert core.how == "export" and core.module_class == "decoder_block.AttentionCore"
    assert by_paths[("attn_norm", "mlp_norm")].state[0].module_key == "weight"
    for t in m.tasks:
        text = (extracted / t.file).read_text()
        assert hashlib.sha256(text.encode()).hexdigest() == t.sha256
    assert m.skipped == []


def test_extract_tasks_run_to_final_verdicts_and_replay(
    extracted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kf run`` with the scripted server (labelled scripted) on an nn task and an
    exported one: every candidate gets a final verdict, and ``kf replay --check`` passes."""
    monkeypatch.setenv("KF_COMPILE_BASELINE", "0")  # the eager baseline is what is needed
    db = tmp_path / "run.db"
    report, _ = scripted_llm_run(
        echo_reference, extracted, db, "--budget", "2", "--tasks", "AttentionCore,Linear_attn"
    )
    assert report["finished"] and len(report["tasks"]) == 2
    for t in report["tasks"]:
        # the echo answers the same code each time: a repeat is recorded as a duplicate
        # (search.candidate_duplicate) and never run again, a final verdict of its own
        assert t["correct"] >= 1 and t["correct"] + t["duplicates"] == t["candidates"], t
        assert t["ref_ms"] > 0 and t["best_ms"] > 0
    replay_check(db)


def _entry(tmp_path: Path, body: str) -> str:
    path = tmp_path / "user_model.py"
    path.write_text("import torch\nfrom torch import nn\n\n" + body)
    return f"{path}:build"


def test_extract_entry_that_raises_is_one_line(tmp_path: Path) -> None:
    """An entry point that raises gets one line naming it and the error; nothing is written."""
    entry = _entry(tmp_path, "def build():\n    raise RuntimeError('no weights here')\n")
    out = tmp_path / "tasks"
    proc = run_kf("extract", entry, "-o", str(out))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"kf extract: {entry}: build() raised RuntimeError: no weights here"
    ]
    assert not out.exists()


BAD_REGIONS = """
class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


class Scaled(nn.Module):
    def forward(self, x, factor):
        return x * factor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.branchy = Branchy()
        self.scaled = Scaled()

    def forward(self, x):
        return self.scaled(self.branchy(self.lin(x)), 3)


def build():
    return {"model": Net(), "inputs": [torch.randn(8, 32)]}
"""


def test_extract_unexportable_and_uncapturable_regions_are_skipped(tmp_path: Path) -> None:
    """A region with data-dependent control flow and one called with an int are left out
    with one line each, listed in the manifest; the Linear still gets its task."""
    out = tmp_path / "tasks"
    proc = run_kf("extract", _entry(tmp_path, BAD_REGIONS), "-o", str(out), "--min-share", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kf extract: skipped")]
    assert len(lines) == 2, proc.stderr[-3000:]
    m = read_manifest(out / "manifest.json")
    reasons = {s.module_paths[0]: s.reason for s in m.skipped}
    assert "torch.export cannot export it" in reasons["branchy"]
    assert "data-dependent control flow" in reasons["branchy"]
    assert reasons["scaled"] == "its argument 1 is not a tensor (int); a task's inputs are tensors"
    assert [t.module_paths for t in m.tasks] == [["lin"]]
    assert json.loads((out / "manifest.json").read_text())["version"] == 1
