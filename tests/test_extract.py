"""``kf extract``, ``kf export --model`` and ``kf check-model`` on the CPU (issues 44
and 45): the example decoder block's hot regions as self-contained tasks with a manifest,
a scripted-model run on two of them to final verdicts (the scripted model server, labelled
scripted: its kernels are the tasks' own references, so their speed-ups are noise and the
export takes them with ``--min-speedup 0``), the patch exported from that run and checked
end to end on the block's inputs and on unseen ones; a wrong kernel fails the check naming
its region; bad input (an entry that raises, a region torch.export cannot export, a region
called with a non-tensor argument, a patch for another model or device) is one line each.
The extraction, the run and the export are made once for the module."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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


FAST = ("--no-compile", "--time-s", "0.01")


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny fp32 block extracted on the CPU, every region kept."""
    out = tmp_path_factory.mktemp("extract") / "tasks"
    proc = run_kf("extract", BLOCK, "-o", str(out), "--top", "10", "--min-share", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tasks cover" in proc.stdout
    return out


@pytest.fixture(scope="module")
def ran(extracted: Path) -> tuple[Path, dict[str, Any]]:
    """``kf run`` with the scripted server on an nn task and an exported one (budget 2:
    the echo's second answer repeats its first), its log beside the tasks: (log, report)."""
    db = extracted.parent / "run.db"
    mp = pytest.MonkeyPatch()
    mp.setenv("KF_COMPILE_BASELINE", "0")  # the eager baseline is what is needed
    try:
        report, _ = scripted_llm_run(
            echo_reference, extracted, db, "--budget", "2", "--tasks", "AttentionCore,Linear_attn"
        )
    finally:
        mp.undo()
    return db, report


@pytest.fixture(scope="module")
def patched(extracted: Path, ran: tuple[Path, dict[str, Any]]) -> Path:
    """The folder of the tasks and the run, with the patch exported from the run."""
    root = extracted.parent
    proc = run_kf(
        "export", str(ran[0]), "--model", str(extracted / "manifest.json"),
        "-o", str(root / "kf_patch.py"), "--min-speedup", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


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


def test_extract_tasks_run_to_final_verdicts_and_replay(ran: tuple[Path, dict[str, Any]]) -> None:
    """``kf run`` with the scripted server (labelled scripted) on an nn task and an
    exported one: every candidate gets a final verdict, and ``kf replay --check`` passes."""
    db, report = ran
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


def test_export_model_header_names_each_kernel_and_the_trust_it_asks(patched: Path) -> None:
    """The patch's header names the run, candidate and verified speed-up of each of its two
    kernels, the regions left with their own code, and that the kernels run unboxed."""
    text = (patched / "kf_patch.py").read_text()
    header = text.split('"""', 2)[2].split("from __future__")[0]
    run_id = json.loads(run_kf("report", str(patched / "run.db"), "--json").stdout)["run_id"]
    assert header.count(f"run {run_id}") == 2
    assert len(re.findall(r"candidate [0-9a-f]{32}", header)) == 2
    assert "attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj" in header
    assert re.search(r"attn\.core \(task \d_AttentionCore\S*\) at \[2, 4, 16, 16\] float32", header)
    assert re.search(r"verified: [0-9.]+x over PyTorch eager", header)
    assert re.search(r"#   mlp\.down_proj \(task \d_Linear_mlp_down_proj\)", header)  # own code
    assert "TRUST" in header and "unsandboxed" in header


def test_check_model_passes_on_seen_and_unseen_inputs_and_counts_fallbacks(
    patched: Path,
) -> None:
    """The patched block passes the numerics rule on its two example inputs and on seven
    sets it never saw; the kernels ran on the first example's shapes and fell back on the
    second's (not verified there), and ``kf report`` shows the check."""
    out = patched / "check.json"
    proc = run_kf(
        "check-model", BLOCK, "--patch", str(patched / "kf_patch.py"), "-o", str(out), *FAST
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check = json.loads(out.read_text())
    assert check["passed"] is True and check["failures"] == []
    seen = [s["seen"] for s in check["correctness"]]
    assert seen.count(True) == 2 and seen.count(False) == 7
    assert all(s["verdict"]["ok"] for s in check["correctness"])
    by_set = {s["inputs"]: s["calls"] for s in check["correctness"]}
    assert by_set["example 0"]["attn.core"] == {"kernel": 1, "fallback": 0, "why": {}}
    assert by_set["example 0 scaled by -1"]["attn.q_proj"]["kernel"] == 1
    assert by_set["example 1"]["attn.q_proj"]["fallback"] == 1
    assert "attn_norm" not in by_set["example 0"]  # no kernel: never dispatched
    gains = check["gains"][0]
    assert gains["eager_ms"] > 0 and gains["patched_ms"] > 0
    assert sorted(re.sub(r"^\d_", "", r) for r in gains["regions"]) == [
        "AttentionCore_attn_core",
        "Linear_attn_q_proj_x4",
    ]
    shown = run_kf("report", str(out))
    assert shown.returncode == 0 and "numerics: PASSED on 9 input sets" in shown.stdout


def test_check_model_wrong_kernel_fails_and_names_its_region(patched: Path, tmp_path: Path) -> None:
    """A patch whose attention kernel is made wrong (its output times 1.01) fails the check
    (exit 1), and the line says the region is attn.core."""
    text = (patched / "kf_patch.py").read_text()
    kid = re.search(r"#   (k\d): attn\.core ", text)
    assert kid is not None
    core = text.index(f"SOURCE_{kid.group(1)} = ")
    wrong = text[:core] + text[core:].replace(
        "class ModelNew(Model):\n    pass",
        "class ModelNew(Model):\n    def forward(self, *a):\n"
        "        return super().forward(*a) * 1.01",
        1,
    )
    assert wrong != text
    (tmp_path / "kf_patch.py").write_text(wrong)
    proc = run_kf("check-model", BLOCK, "--patch", str(tmp_path / "kf_patch.py"), *FAST)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kf check-model: wrong")]
    assert lines and all(": attn.core: " in ln for ln in lines), proc.stderr[-2000:]
    assert "wrong on example 0:" in proc.stderr


def _one_line(proc: object) -> str:
    err = getattr(proc, "stderr", "").strip().splitlines()
    assert getattr(proc, "returncode", None) == 2 and len(err) == 1, err
    return str(err[0])


def test_check_model_refuses_another_model_in_one_line(patched: Path, tmp_path: Path) -> None:
    """The patch applied to another model (another class) is refused with one line naming
    the model it was exported for."""
    other = tmp_path / "other_model.py"
    other.write_text(
        "import torch\n\n\nclass Other(torch.nn.Module):\n"
        "    def forward(self, x):\n        return x * 2\n\n\n"
        "def build():\n    return Other(), [(torch.randn(2, 3),)]\n"
    )
    line = _one_line(
        run_kf("check-model", f"{other}:build", "--patch", str(patched / "kf_patch.py"), *FAST)
    )
    assert "this patch is for decoder_block.DecoderBlock" in line and "other_model.Other" in line


def test_check_model_refuses_a_model_changed_since_export(patched: Path, tmp_path: Path) -> None:
    """The block with a wider attention (hidden 64 -> 96) is refused: one line naming the
    first region whose parameters no longer have the manifest's shape."""
    changed = tmp_path / "decoder_block.py"
    shutil.copy("examples/models/decoder_block.py", changed)
    changed.write_text(changed.read_text().replace('"tiny": (64, 4, 176', '"tiny": (96, 4, 176'))
    line = _one_line(
        run_kf("check-model", f"{changed}:build", "--patch", str(patched / "kf_patch.py"), *FAST)
    )
    # which region comes first follows the manifest's ranking by share of time, which is
    # noisy on a CPU: any region whose weight widened (one dimension 64 -> 96, the others
    # as they were: [96, 176] for the MLP's down projection), named with both shapes
    found = re.search(
        r"kf_patch: [\w.]+: weight has shape \[([\d, ]+)\], the manifest's \[([\d, ]+)\]; "
        r"export the patch again",
        line,
    )
    assert found, line
    now, then = (g.split(", ") for g in found.groups())
    assert len(now) == len(then) and 1 <= len(now) <= 2, line
    changed = [(a, b) for a, b in zip(now, then, strict=True) if a != b]
    assert changed and changed == [("96", "64")] * now.count("96"), line


def test_check_model_refuses_a_device_without_the_patch_backends(
    patched: Path, tmp_path: Path
) -> None:
    """A patch of CUDA kernels is refused on --device cpu (its kernels run on cuda), and on
    a machine without CUDA with --device cuda:0: one line each."""
    text = (patched / "kf_patch.py").read_text().replace("'kind': 'cpu'", "'kind': 'cuda'")
    (tmp_path / "kf_patch.py").write_text(text)
    patch = str(tmp_path / "kf_patch.py")
    line = _one_line(run_kf("check-model", BLOCK, "--patch", patch, *FAST))
    assert "the patch's kernels run on cuda" in line and "not on --device cpu" in line
    import torch

    if not torch.cuda.is_available():
        line = _one_line(
            run_kf("check-model", BLOCK, "--patch", patch, "--device", "cuda:0", *FAST)
        )
        assert "this machine has no CUDA device" in line
