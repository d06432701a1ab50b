"""Developer-written seeds for the tasks ``kf extract`` writes (``--seeds DIR`` of
bench/model_gpu.py and bench/extract_gpu.py).

A seed folder (e.g. bench/seeds/decoder_block/) holds, per region class, ``<Class>.py``
and any variants ``<Class>.<name>.py``: the end of a candidate module, written by kf's
developers (not by a model), whose ``ModelNew`` subclasses the task's ``Model``. For each
task of an extract's manifest whose module class (``decoder_block.RMSNorm`` → ``RMSNorm``)
has seed files, :func:`install_seeds` writes ``<tasks>/seeds/<task>.py`` (and
``<task>.<name>.py``): the task's own text, then the seed file. So ``ModelNew`` inherits
the reference's constructor (its parameters have the real module's shapes and are drawn
exactly as the reference draws them, as kf's check of a candidate requires) and the seed
names no size of the model. kf reads them as it reads any task's seeds
(:mod:`kf.kernels.tasks`); the offline mutator proposes them first and tunes the
parameters they declare.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "SEED_NOTE",
    "Installed",
    "check_seed_dir",
    "compose",
    "install_seeds",
    "seed_files",
    "summary_lines",
]

SEED_NOTE = "written by kf's developers, not by a model"


@dataclass(frozen=True)
class Installed:
    """One task of the manifest and the developer seeds it was given (none: empty)."""

    task: str
    module_class: str
    seeds: list[str] = field(default_factory=list)  # the seed files' names in the seed folder


def seed_files(seeds_dir: Path, module_class: str) -> list[Path]:
    """``<Class>.py`` then ``<Class>.*.py`` (sorted) for a manifest's module class."""
    cls = module_class.rsplit(".", 1)[-1]
    main = [seeds_dir / f"{cls}.py"] if (seeds_dir / f"{cls}.py").is_file() else []
    return main + sorted(p for p in seeds_dir.glob(f"{cls}.*.py") if p.is_file())


def compose(task_text: str, seed_text: str, seed_name: str) -> str:
    """A candidate module: the task's text, then the developer-written seed."""
    bar = "# " + "=" * 86
    return (
        f"{task_text.rstrip()}\n\n\n{bar}\n# developer seed {seed_name} ({SEED_NOTE}); "
        f"above it, the task's own text\n{bar}\n\n{seed_text.lstrip()}"
    )


def check_seed_dir(seeds_dir: Path) -> None:
    """Raise ``ValueError`` (one line) unless ``seeds_dir`` is a folder holding a seed."""
    if not seeds_dir.is_dir():
        raise ValueError(f"--seeds {seeds_dir}: no such folder (a folder of <Class>.py seeds)")
    if not any(seeds_dir.glob("*.py")):
        raise ValueError(f"--seeds {seeds_dir}: no seed file (<Class>.py) in it")


def install_seeds(tasks_dir: Path, seeds_dir: Path) -> list[Installed]:
    """Write ``tasks_dir/seeds/`` afresh from ``seeds_dir``: per task of the manifest, its
    class's seed files composed with the task's text. Raises ``ValueError`` (one line)
    for a seed folder that does not exist or holds no seed file."""
    check_seed_dir(seeds_dir)
    manifest = json.loads((tasks_dir / "manifest.json").read_text())
    out = tasks_dir / "seeds"
    if out.exists():
        shutil.rmtree(out)  # seeds of an earlier extract would be another task's
    out.mkdir()
    installed = []
    for task in manifest["tasks"]:
        stem = Path(task["file"]).stem
        text = (tasks_dir / task["file"]).read_text()
        files = seed_files(seeds_dir, task["module_class"])
        for i, path in enumerate(files):
            variant = "" if i == 0 and path.stem.count(".") == 0 else path.stem.split(".", 1)[1]
            name = f"{stem}.{variant}.py" if variant else f"{stem}.py"
            (out / name).write_text(compose(text, path.read_text(), path.name))
        installed.append(Installed(stem, task["module_class"], [p.name for p in files]))
    return installed


def summary_lines(installed: list[Installed], seeds_dir: Path, *, llm: bool) -> list[str]:
    """What each region runs from, one line each: developer seeds or what kf does without."""
    without = (
        "no developer seed: the model writes its kernels from scratch"
        if llm
        else "no developer seed and no LLM: kf's offline mutator skips it, and the patched "
        "model keeps its own code there"
    )
    lines = [f"developer seeds from {seeds_dir} ({SEED_NOTE}):"]
    for t in installed:
        what = f"developer seed {', '.join(t.seeds)}" if t.seeds else without
        lines.append(f"  {t.task} ({t.module_class}): {what}")
    return lines
