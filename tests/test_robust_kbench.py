"""robust-kbench task folders run as they are (kf.kernels.robust_kbench): converted at load
time, forward and backward, verified across all their configurations, end to end with
`kf run` against the scripted model server (tests/llm_server.py, labelled ``scripted``:
its answers are kf's developers', not a model's)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kf.kernels.robust_kbench import load_folder
from kf.kernels.task_folders import load_tasks_skipping
from kf.kernels.tasks import TaskError
from tests.harness import ROOT, logged, replay_check, run_kf, scripted_llm_run
from tests.llm_server import user_text

RK = ROOT.parent / "shared" / "robust-kbench" / "tasks"
#: three folders: layernorm's forward and backward, the other two's backward (--tasks
#: picks by name substring); their configs capped for 2 CPU cores
SELECTION = ("layernorm", "mnist_linear_relu_backward", "mnist_cross_entropy_backward")
NAMES = {"layernorm", *(f"{s.removesuffix('_backward')}_backward" for s in SELECTION)}
CAP = 16

pytestmark = pytest.mark.skipif(not RK.is_dir(), reason=f"no robust-kbench copy at {RK}")


def _reference_copy(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted model's answer: the task's own reference as ModelNew (correct, no
    kernel: what it checks is the plumbing, not a speed-up). A prompt rewrite (asked as
    the run ends) gets a short region, not an error the client retries for seconds."""
    if "Rewrite ONE region" in user_text(body):
        return {"content": "```\nKeep the reference's ops.\n```"}
    name = re.search(r"# Task `([^`]+)`", user_text(body))
    assert name is not None, user_text(body)[:500]
    folder = name.group(1).removesuffix("_backward")
    (task,) = [t for t in load_folder(RK / folder, shape_cap=CAP) if t.name == name.group(1)]
    module = task.source + "\n\nclass ModelNew(Model):\n    pass\n"
    return {"content": f"```python\n{module}```"}


@pytest.fixture(scope="module")
def rk_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One run of three robust-kbench folders (four tasks), one candidate each."""
    db = tmp_path_factory.mktemp("rk") / "run.db"
    report, _ = scripted_llm_run(
        _reference_copy, RK, db, "--tasks", ",".join(SELECTION), "--shape-cap", str(CAP),
        "--budget", "1", "--init", "1", "--tune-budget", "0", "--max-in-flight", "2",
        timeout=500,
    )  # fmt: skip
    return db, report


def test_robust_kbench_folders_reach_final_verdicts(rk_run: Any) -> None:
    """Each folder's forward and backward task is checked and its candidate verified on
    every configuration and profiled; replay --check passes with the server gone."""
    db, report = rk_run
    names = NAMES
    assert {t["task"] for t in report["tasks"]} == names
    assert all(t["best_speedup"] is not None for t in report["tasks"]), report["tasks"]
    verified = logged(db, "kernel.candidate_verified")
    assert {v.task for v in verified} == names
    (started,) = logged(db, "run.started")
    configs = {t.name: t.origin["configs"] for t in started.tasks}
    for v in verified:  # the first config is the trials', every other one a gate set
        assert len(v.report.variant_evidence) == configs[v.task] - 1
    assert started.config["shape_cap"] == CAP
    assert {t.origin["pass"] for t in started.tasks} == {"forward", "backward"}
    replay_check(db)


def test_robust_kbench_backward_task_asks_for_gradients() -> None:
    """The backward task's reference returns one gradient per floating tensor argument
    (layernorm: x, weight, bias), computed against the grad_output input."""
    import torch

    from kf.kernels.tasks import import_source

    (_, task) = load_folder(RK / "layernorm", shape_cap=8)
    assert task.origin["pass"] == "backward"
    module = import_source("rk_layernorm_backward", task.source)
    torch.manual_seed(0)
    x, weight, bias, eps, grad = module.get_inputs()
    grads = module.Model()(x, weight, bias, eps, grad)
    assert [g.shape for g in grads] == [x.shape, weight.shape, bias.shape]
    leaf = x.clone().requires_grad_(True)
    torch.nn.functional.layer_norm(leaf, weight.shape, weight, bias, eps).backward(grad)
    torch.testing.assert_close(grads[0], leaf.grad)


def test_robust_kbench_folder_without_config_is_one_line(tmp_path: Path) -> None:
    """A folder with func_forward.py but no config_forward.json is refused in one line
    naming the missing file; in a folder of tasks the others still load."""
    broken = tmp_path / "tasks" / "broken"
    broken.mkdir(parents=True)
    shutil.copy(RK / "mnist_linear" / "func_forward.py", broken / "func_forward.py")
    with pytest.raises(TaskError, match=r"config_forward.json: missing") as exc:
        load_folder(broken)
    assert "\n" not in str(exc.value)
    (tmp_path / "tasks" / "ok.py").write_text((ROOT / "examples/tasks/gelu_bias.py").read_text())
    tasks, skipped = load_tasks_skipping(tmp_path / "tasks")
    assert [t.name for t in tasks] == ["ok"]
    assert skipped[0][0].endswith("broken") and "config_forward.json" in skipped[0][1]
    proc = run_kf("run", str(broken), "--budget", "1", timeout=60)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "config_forward.json" in ln]
    assert len(lines) == 1 and "missing" in lines[0], proc.stderr[-2000:]
