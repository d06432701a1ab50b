"""Task packages: a folder with a task, its settings and the user's own tests.

A package is a folder holding ``task.py`` (a KernelBench-format task) and/or ``kf.toml``;
optionally ``tests/test_*.py`` and ``seeds/task.py`` (seed candidates, as beside any
task file)::

    my_rmsnorm/
      task.py
      kf.toml          # optional
      tests/test_edge_cases.py   # optional

``kf.toml`` (read with :mod:`tomllib`; every key optional, an unknown key refused with the
known ones named):

``name``        the task's name (default: the folder's name)
``task``        the task file in the folder (default ``task.py``)
``atol``, ``rtol``, ``tolerance``
                the task's tolerance (written into its text as ``KF_ATOL``, ``KF_RTOL``,
                ``KF_TOLERANCE``, :mod:`kf.evaluation.wire.tolerance`)
``dtypes``      floating-point dtypes to sweep (``float32``, ``bfloat16``, ``float16``):
                one task per dtype (``<name>_<dtype>`` when more than one), its floating
                inputs and its Model's parameters cast to it
``shapes``      input shapes to sweep: a list of shape sets, each one shape per tensor
                input of ``get_inputs()``; they become the task's ``get_tuning_inputs()``
                and ``get_extra_inputs()`` (tuned for, and verified on, by every candidate)
``budget``      candidates the search spends on this task (instead of ``--budget``)
``languages``   the languages an LLM writes this task's kernels in (of those the device runs)

User tests are pytest-style: each ``test_*`` function of a ``tests/test_*.py`` file is
called with the fixtures its parameters name (:data:`FIXTURES`): ``candidate`` (the
candidate's ``ModelNew``, built as for verification), ``reference`` (the task's ``Model``,
built from the same seed), ``inputs`` (a fresh ``get_inputs()`` set), ``module`` (the
candidate's module), ``task`` (the task's module), ``device`` and ``torch``. They run in
the candidate's box like the rest of verification; a candidate that fails one is rejected
with the test's name and message. Their text travels with the task in the run's log.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import Any

from kf.kernels.tasks import Task, TaskError, UserTest, load_task

__all__ = ["FIXTURES", "KNOWN_KEYS", "is_package", "load_package", "user_test_functions"]

#: what a user test's parameters may name
FIXTURES = ("candidate", "reference", "inputs", "module", "task", "device", "torch")
KNOWN_KEYS = (
    "name",
    "task",
    "atol",
    "rtol",
    "tolerance",
    "dtypes",
    "shapes",
    "budget",
    "languages",
)
_DTYPES = ("float32", "bfloat16", "float16")
_PRESETS = ("kf", "kernelbench", "kernelbench-verified")


def is_package(folder: Path) -> bool:
    """Whether ``folder`` is a task package (it holds ``kf.toml`` or ``task.py``)."""
    return (folder / "kf.toml").is_file() or (folder / "task.py").is_file()


def load_package(folder: Path) -> list[Task]:
    """The package's task (one per swept dtype); raises :class:`TaskError` with one line
    naming the file and what is wrong."""
    settings = read_settings(folder / "kf.toml")
    task_file = folder / str(settings.get("task", "task.py"))
    if not task_file.is_file():
        raise TaskError(f"{task_file}: missing (a task package holds its task in task.py)")
    base = load_task(task_file)
    tests = _tests(folder)
    name = str(settings.get("name", folder.name))
    source = base.source + _tolerance_lines(settings) + _shape_lines(settings, base.source)
    dtypes = list(settings.get("dtypes", []))
    origin = {"format": "package", "folder": str(folder), "task": task_file.name}
    if not dtypes:
        return [_make(name, source, base, tests, settings, origin)]
    out = []
    for dtype in dtypes:
        tname = f"{name}_{dtype}" if len(dtypes) > 1 else name
        text = source + _dtype_lines(dtype)
        out.append(_make(tname, text, base, tests, settings, {**origin, "dtype": dtype}))
    return out


def _make(
    name: str, source: str, base: Task, tests: tuple[UserTest, ...], settings: dict[str, Any],
    origin: dict[str, Any],
) -> Task:  # fmt: skip
    return Task.from_source(
        name, source, path=base.path, seeds=base.seeds, tests=tests, settings=settings,
        origin=origin,
    )  # fmt: skip


def read_settings(path: Path) -> dict[str, Any]:
    """``kf.toml`` checked (an absent file: no settings)."""
    if not path.is_file():
        return {}
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"{path}: cannot read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{path}: not valid TOML: {exc}") from exc
    for key in raw:
        if key not in KNOWN_KEYS:
            raise TaskError(f"{path}: unknown key {key!r} (known: {', '.join(KNOWN_KEYS)})")
    for key, value in raw.items():
        why = _bad_value(key, value)
        if why:
            raise TaskError(f"{path}: {key} {why}")
    return raw


def _bad_value(key: str, value: Any) -> str | None:
    """Why ``value`` is not a valid ``key`` (None: it is)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if key in ("name", "task"):
        ok = isinstance(value, str) and bool(value.strip()) and "/" not in value
        return None if ok else "must be a file or task name (a string, no '/')"
    if key in ("atol", "rtol"):
        return None if number and value > 0 else "must be a positive number"
    if key == "tolerance":
        return None if value in _PRESETS else f"must be one of {', '.join(_PRESETS)}"
    if key == "budget":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return None if ok else "must be a whole number, at least 1"
    if key == "dtypes":
        ok = isinstance(value, list) and bool(value) and all(v in _DTYPES for v in value)
        return None if ok else f"must be a list of {', '.join(_DTYPES)}"
    if key == "languages":
        from kf.kernels.backends import LANGUAGES

        ok = isinstance(value, list) and bool(value) and all(v in LANGUAGES for v in value)
        return None if ok else f"must be a list of languages ({', '.join(LANGUAGES)})"
    ok = isinstance(value, list) and bool(value) and all(_is_shape_set(s) for s in value)
    return None if ok else "must be a list of shape sets, each a list of shapes ([[8, 64]])"


def _is_shape_set(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in value
    )


def _tests(folder: Path) -> tuple[UserTest, ...]:
    """``tests/test_*.py``, sorted; each must parse and define a ``test_*`` function whose
    parameters are all fixtures (:data:`FIXTURES`)."""
    found = sorted((folder / "tests").glob("test_*.py")) if (folder / "tests").is_dir() else []
    out = []
    for path in found:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TaskError(f"{path}: cannot read: {exc}") from exc
        user_test_functions(source, str(path))
        out.append(UserTest(name=f"tests/{path.name}", source=source))
    return tuple(out)


def user_test_functions(source: str, label: str) -> list[tuple[str, list[str]]]:
    """The ``test_*`` functions of a test file and their parameters, read with ``ast``;
    raises :class:`TaskError` when the file does not parse, has none, or one asks for a
    fixture kf does not give."""
    try:
        tree = ast.parse(source, filename=label)
    except SyntaxError as exc:
        raise TaskError(
            f"{label}: the user test does not import: syntax error at line {exc.lineno}: {exc.msg}"
        ) from exc
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            params = [a.arg for a in node.args.args]
            unknown = [p for p in params if p not in FIXTURES]
            if unknown:
                raise TaskError(
                    f"{label}: {node.name} asks for {', '.join(unknown)}, which kf does not "
                    f"give (a user test may take: {', '.join(FIXTURES)})"
                )
            found.append((node.name, params))
    if not found:
        raise TaskError(f"{label}: defines no test_* function")
    return found


def _tolerance_lines(settings: dict[str, Any]) -> str:
    pairs = [("atol", "KF_ATOL"), ("rtol", "KF_RTOL"), ("tolerance", "KF_TOLERANCE")]
    lines = [f"{var} = {settings[key]!r}" for key, var in pairs if key in settings]
    return (
        "\n\n# kf: the package's tolerance (kf.toml)\n" + "\n".join(lines) + "\n" if lines else ""
    )


_SHAPES = '''

# kf: the package's shapes to sweep (kf.toml)
KF_SWEEP_SHAPES = {shapes!r}


def _kf_swept(index):
    """get_inputs() remade at KF_SWEEP_SHAPES[index]: a floating tensor as randn, an
    integer one drawn from its own range, anything else as it is."""
    made, shapes = get_inputs(), iter(KF_SWEEP_SHAPES[index])
    out = []
    for v in made:
        if not isinstance(v, torch.Tensor):
            out.append(v)
            continue
        shape = next(shapes)
        if v.is_floating_point():
            out.append(torch.randn(shape, dtype=v.dtype, device=v.device))
        else:
            low, high = (int(v.min()), int(v.max()) + 1) if v.numel() else (0, 1)
            out.append(torch.randint(low, high, shape, dtype=v.dtype, device=v.device))
    return out


def get_tuning_inputs():
    return [_kf_swept(i) for i in range(len(KF_SWEEP_SHAPES))]


def get_extra_inputs():
    return get_tuning_inputs()
'''


def _shape_lines(settings: dict[str, Any], source: str) -> str:
    if "shapes" not in settings:
        return ""
    for fn in ("get_tuning_inputs", "get_extra_inputs"):
        if f"def {fn}" in source:
            raise TaskError(
                f"kf.toml: shapes would replace the task's own {fn}(): keep one of the two"
            )
    return _SHAPES.format(shapes=settings["shapes"])


_DTYPE = """

# kf: the package's dtype sweep (kf.toml): floating inputs and the Model's parameters in {dtype}
_kf_get_inputs, _kf_model_init = get_inputs, Model.__init__


def get_inputs():
    return [
        v.to(torch.{dtype}) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for v in _kf_get_inputs()
    ]


def _kf_init_in_dtype(self, *args, **kwargs):
    _kf_model_init(self, *args, **kwargs)
    self.to(torch.{dtype})


Model.__init__ = _kf_init_in_dtype
"""


def _dtype_lines(dtype: str) -> str:
    return "" if dtype == "float32" else _DTYPE.format(dtype=dtype)
