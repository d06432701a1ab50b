"""The example tasks and their seed kernels: tasks run, seeds match eager at several points
of their declared parameter spaces (5 seeded trials, atol = rtol = 1e-4)."""

from __future__ import annotations

import itertools
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from kf.kernels import params

TASKS_DIR = Path(__file__).resolve().parent.parent / "examples" / "tasks"
SEEDS_DIR = TASKS_DIR / "seeds"
TASKS = sorted(p.stem for p in TASKS_DIR.glob("*.py"))
FUSION_TASKS = {"gelu_bias", "linear_bias_relu", "rmsnorm_silu"}


def _load(path: Path, source: str | None = None) -> types.ModuleType:
    module = types.ModuleType(f"kf_test_{path.stem.replace('.', '_')}")
    module.__file__ = str(path)
    exec(compile(source or path.read_text(), str(path), "exec"), module.__dict__)
    return module


def _params(source: str) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """The seed's SPACE and CONFIG as kf reads them (kf.kernels.params)."""
    parsed = params.parse(source)
    assert parsed is not None, "the seed has no kf:params block"
    return parsed[0].as_dict(), dict(parsed[1])


def _points(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(space, vals, strict=True)) for vals in itertools.product(*space.values())]


def _assert_matches(stem: str, config: dict[str, Any] | None) -> None:
    task = _load(TASKS_DIR / f"{stem}.py")
    seed_path = SEEDS_DIR / f"{stem}.py"
    source = seed_path.read_text()
    seed = _load(seed_path, params.apply(source, config) if config is not None else None)
    init = task.get_init_inputs()
    for trial in range(5):
        torch.manual_seed(trial)
        ref = task.Model(*init)
        torch.manual_seed(trial)
        new = seed.ModelNew(*init)
        torch.manual_seed(100 + trial)
        inputs = task.get_inputs()
        with torch.no_grad():
            expected = ref(*[t.clone() for t in inputs])
            got = new(*[t.clone() for t in inputs])
        assert got.shape == expected.shape, (stem, config)
        assert torch.isfinite(got).all(), (stem, config)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=f"{stem} {config}")


def test_examples_cover_required_tasks() -> None:
    """The example set holds gelu_bias, softmax, layernorm, a reduction and 3 fusion tasks."""
    assert {"gelu_bias", "softmax", "layernorm", "sum_rows"} <= set(TASKS)
    assert set(TASKS) >= FUSION_TASKS
    assert len(TASKS) >= 6


@pytest.mark.parametrize("stem", TASKS)
def test_task_runs_eagerly(stem: str) -> None:
    """Each task file builds its Model from get_init_inputs and runs on fresh get_inputs."""
    task = _load(TASKS_DIR / f"{stem}.py")
    model = task.Model(*task.get_init_inputs())
    inputs = task.get_inputs()
    assert inputs and all(t.dtype == torch.float32 for t in inputs)
    with torch.no_grad():
        out = model(*inputs)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("stem", TASKS)
def test_seed_declares_valid_params(stem: str) -> None:
    """Each task has a seed whose kf:params CONFIG is a point of its SPACE."""
    space, config = _params((SEEDS_DIR / f"{stem}.py").read_text())
    assert set(config) == set(space)
    assert all(config[k] in space[k] for k in space)
    assert all(isinstance(v, int | str | bool) for vals in space.values() for v in vals)


@pytest.mark.parametrize("stem", TASKS)
def test_seed_default_config_matches_reference(stem: str) -> None:
    """The seed at its default CONFIG matches eager on 5 seeded trials."""
    _assert_matches(stem, None)


@pytest.mark.parametrize("stem", TASKS)
def test_seed_space_extremes_match_reference(stem: str) -> None:
    """The first and last points of the seed's enumerated SPACE also match eager."""
    space, _ = _params((SEEDS_DIR / f"{stem}.py").read_text())
    points = _points(space)
    for config in (points[0], points[-1]):
        _assert_matches(stem, config)
