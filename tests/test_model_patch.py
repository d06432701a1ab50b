"""``kf export --model`` and ``kf check-model`` on the CPU (issue 45): the example decoder
block extracted, two of its tasks run with the scripted model server (labelled scripted:
its kernels are the tasks' own references, so their speed-ups are noise and the export
takes them with ``--min-speedup 0``), patched, and checked end to end on its inputs and on
unseen ones; a wrong kernel fails the check naming its region; bad input is one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.harness import run_kf, scripted_llm_run
from tests.llm_server import echo_reference
from tests.test_extract import BLOCK

FAST = ("--no-compile", "--time-s", "0.01")


@pytest.fixture(scope="module")
def patched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny block's tasks, a scripted run on two of them, and the
    patch exported from it."""
    root = tmp_path_factory.mktemp("patch")
    tasks = root / "tasks"
    proc = run_kf("extract", BLOCK, "-o", str(tasks), "--top", "10", "--min-share", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    mp = pytest.MonkeyPatch()
    mp.setenv("KF_COMPILE_BASELINE", "0")
    try:
        report, _ = scripted_llm_run(
            echo_reference, tasks, root / "run.db", "--budget", "1",
            "--tasks", "AttentionCore,Linear_attn",
        )  # fmt: skip
    finally:
        mp.undo()
    assert all(t["correct"] >= 1 for t in report["tasks"]), report["tasks"]
    proc = run_kf(
        "export", str(root / "run.db"), "--model", str(tasks / "manifest.json"),
        "-o", str(root / "kf_patch.py"), "--min-speedup", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


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
    # noisy on a CPU: any region whose weight widened, named with both shapes
    assert re.search(
        r"kf_patch: [\w.]+: weight has shape \[96(, 96)?\], the manifest's \[64(, 64)?\]; "
        r"export the patch again",
        line,
    ), line


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
