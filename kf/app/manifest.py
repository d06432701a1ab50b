"""``kf extract``'s manifest: where each task it wrote comes from in the user's model.

``kf extract my_model.py:build -o tasks/`` writes one KernelBench-format task per hot
region of the model and ``tasks/manifest.json``, a :class:`ModelManifest`. The manifest
is what a later step needs to put kernels back into the model (``kf export --model``) and
to refuse a model that is not the one extracted:

- per task (:class:`ManifestTask`): the module paths in the model it stands for (several
  when identical regions, e.g. the q/k/v/o projections, were grouped), the module's class,
  the input signatures (shapes, dtypes) each example input gave it, the task's state
  (parameters and buffers) and the name each has in the original module, its share of the
  model's time, and the task file (relative to the manifest's folder) with its sha256;
- the regions left out (:class:`SkippedRegion`), each with one line saying why;
- the device, the model's time per example input, and the coverage: the share of the
  model's time the tasks stand for together.

Times are the profiler's (:attr:`ModelManifest.timing` says which clock): per example
input, one forward of the model, averaged over the profiled repeats. A task's ``share`` is
its regions' time over all example inputs divided by the model's time over all of them;
shares are disjoint (leaf modules, or fused regions that do not nest), so they sum to at
most 1, and ``coverage`` is the sum of the tasks' shares.

Schema evolution as msgspec's rules: new fields get defaults, a field's type never
changes; :data:`MANIFEST_VERSION` is raised when a field's meaning changes.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "ExampleInput",
    "InputSignature",
    "ManifestError",
    "ManifestTask",
    "ModelManifest",
    "SkippedRegion",
    "StateEntry",
    "TensorSig",
    "read_manifest",
    "write_manifest",
]

MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"


class ManifestError(ValueError):
    """A manifest file is missing, not JSON, or not a manifest; the message is one line."""


class TensorSig(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor's shape and dtype (``"bfloat16"``, ``"float32"``, ``"int64"``…)."""

    shape: list[int]
    dtype: str


class InputSignature(msgspec.Struct, frozen=True, kw_only=True):
    """The positional tensor inputs one call of a region had, and what it returned.

    ``example`` is the index of the example input (of the entry point's list) whose
    forward made the call; ``calls`` how many calls of the region's modules, in that
    forward, had these inputs."""

    example: int
    inputs: list[TensorSig]
    outputs: list[TensorSig]
    calls: int = 1


class StateEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A parameter or buffer of a task's ``Model``: its key in the task Model's
    ``state_dict()`` and in the original module's (``module_key``), shape and dtype."""

    task_key: str
    module_key: str
    shape: list[int]
    dtype: str
    kind: str = "parameter"  # or "buffer"


class ManifestTask(msgspec.Struct, frozen=True, kw_only=True):
    """One task file and the regions of the model it stands for.

    ``how`` is how the task's ``Model`` was written: ``"nn"`` (the equivalent
    ``torch.nn`` module, for a standard leaf module) or ``"export"`` (the region's
    ``torch.export`` graph, ATen ops, for any other). ``signatures`` are the distinct
    input signatures the regions saw, the task's ``get_inputs()`` first and its
    ``get_tuning_inputs()`` after, in order."""

    name: str
    file: str
    sha256: str
    module_class: str
    module_paths: list[str]
    how: str
    signatures: list[InputSignature]
    state: list[StateEntry] = []
    share: float = 0.0
    time_ms: float = 0.0  # the regions' time over all example inputs, one forward each


class SkippedRegion(msgspec.Struct, frozen=True, kw_only=True):
    """A hot region kf wrote no task for, and why (one line)."""

    module_paths: list[str]
    module_class: str
    share: float
    reason: str


class ExampleInput(msgspec.Struct, frozen=True, kw_only=True):
    """One example input of the entry point: its tensors and the model's time on it."""

    index: int
    inputs: list[TensorSig]
    model_time_ms: float


class ModelManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What ``kf extract`` found in a model and wrote (see the module docstring)."""

    version: int = MANIFEST_VERSION
    entry: str  # "path/to/model.py:build", as given
    entry_sha256: str  # of the entry's file
    model_class: str
    device: str  # as given: "cpu", "cuda:0"
    device_name: str = ""
    torch_version: str = ""
    regions: str = "leaf"  # "leaf" or "fused"
    timing: str = ""  # which clock, how many repeats
    examples: list[ExampleInput] = []
    model_time_ms: float = 0.0  # over all example inputs, one forward each
    tasks: list[ManifestTask] = []
    skipped: list[SkippedRegion] = []
    coverage: float = 0.0  # the tasks' shares together
    unattributed: float = 0.0  # the model's time in no region (glue code between modules)


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(ModelManifest)


def write_manifest(manifest: ModelManifest, path: Path) -> None:
    """Write ``manifest`` as indented JSON at ``path``."""
    path.write_bytes(msgspec.json.format(_ENCODER.encode(manifest), indent=2) + b"\n")


def read_manifest(path: Path) -> ModelManifest:
    """The manifest at ``path``; :class:`ManifestError` (one line) when it is not one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the manifest ({exc.strerror})") from exc
    try:
        manifest = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ManifestError(
            f"{path}: not a kf extract manifest ({exc}); write one with kf extract"
        ) from exc
    if manifest.version > MANIFEST_VERSION:
        raise ManifestError(
            f"{path}: manifest version {manifest.version} is newer than this kf reads "
            f"({MANIFEST_VERSION}); upgrade kf"
        )
    return manifest
