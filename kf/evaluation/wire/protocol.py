"""The grader ↔ runner protocol: one frozen struct per request and per reply, MessagePack
on the runner's socket, decoded by one typed decoder per direction.

Every message is a tagged struct (its tag, ``op``, names it: ``run``, ``ran``…). The
grader sends a :class:`Request` and gets its reply (:func:`reply_type`) or :class:`Failed`;
during ``load_candidate`` a boxed runner may ask for a build (:class:`BuildNative`,
:class:`BuildInline`, answered with :class:`Built`); a runner's first message is
:class:`Ready`. Bytes that do not decode to a message of their direction raise
:class:`ForeignMessage` (not MessagePack: :class:`ProtocolError`) saying what was wrong
and where, never a ``KeyError`` later; the grader takes a foreign message from a runner
for tampering, garbled bytes for a crash. Tensors travel in :data:`Blob` fields:
``torch.save`` bytes (in pieces over 1 GiB), CUDA IPC handles
(:mod:`kf.evaluation.runner.transport`) or sealed memory files
(:class:`kf.evaluation.wire.shared_memory.Payload`). Nothing a runner sends is unpickled by the
grader: payloads are opened only with ``torch.load(weights_only=True)``, in a
candidate-free reference runner.
"""

from __future__ import annotations

import typing
from typing import Any, Generic, TypeVar

import msgspec

from kf.evaluation.wire.shared_memory import Payload
from kf.evaluation.wire.tolerance import Tolerance
from kf.evaluation.wire.verdict import Verdict

__all__ = [
    "COMPILE_MODES", "TF32_SETTINGS", "Audit", "Audited", "BaselineCompiled",
    "BaselineSettingError", "Batch", "BatchRan", "Blob", "BuildInline", "BuildNative", "Built",
    "CandidateLoaded", "Check", "Checked", "CompileBaseline", "Counters", "CountersRan",
    "Exit", "Failed", "ForeignMessage", "InputsMade", "InputsTimed", "LoadCandidate",
    "LoadTask", "MakeInputs", "Message", "Ping", "Pong", "ProtocolError", "Ran", "Ready",
    "Reply", "Request", "Run", "SetUp", "Settle", "Setup", "TaskLoaded", "Time", "TimeInputs",
    "Timed", "ToGrader", "ToRunner", "Trim", "Trimmed", "UserTests", "UserTestsRan",
    "Verdict", "decode_from_grader",
    "decode_from_runner", "encode", "nesting_problem", "reply_type",
]  # fmt: skip

#: A payload of tensors: ``torch.save`` bytes or a CUDA IPC handle (bytes), ``torch.save``
#: bytes in pieces, or a sealed memory file.
Blob = bytes | list[bytes] | Payload


COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead")
TF32_SETTINGS = ("off", "on")  #: Setup.tf32's values (or None); above: CompileBaseline.mode's


class BaselineSettingError(ValueError):
    """A compile mode or TF32 setting kf does not know (a setting's or a request's)."""


class ProtocolError(ValueError):
    """Bytes on a runner socket that are not a message of this protocol (here: not
    MessagePack at all, garbled)."""


class ForeignMessage(ProtocolError):
    """Well-formed MessagePack that is no message of this protocol in the direction it
    came (an unknown ``op``, a missing or mistyped field): from a runner, a message
    forged or injected on the grading socket, since the runner's own code sends none."""


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    """Any message on a runner socket; ``fds`` descriptors of its payloads follow it."""

    fds: int = 0

    @property
    def op(self) -> str:
        """The message's tag: a request's name (``run``), a reply's (``ran``)."""
        return str(self.__struct_config__.tag)


class Reply(Message, frozen=True, kw_only=True):
    """A runner's answer to request ``id``: ``took_ns`` in its handler, its audit hook's
    findings so far, and (CUDA) its allocator's bytes reserved (``peak``, ``held``) and in
    live tensors (``allocated``), most and last, as it says: diagnostics, never a verdict."""

    id: int = 0
    took_ns: int = 0
    findings: tuple[str, ...] = ()
    peak_bytes: int = 0
    held_bytes: int = 0
    peak_allocated_bytes: int = 0
    allocated_bytes: int = 0


_R = TypeVar("_R", bound=Reply)
_M = TypeVar("_M", bound=Message)


class Request(Message, Generic[_R], frozen=True, kw_only=True):
    """A request from the grader; its type parameter is the reply it gets."""

    id: int = 0


# -- replies -----------------------------------------------------------------------


class Failed(Reply, frozen=True, kw_only=True, tag="failed"):
    """A request failed; ``kind`` says how (``exception``, ``compile_error``, ``task_error``,
    ``tampering``, ``protocol``…)."""

    kind: str
    error: str
    log: str = ""


class Pong(Reply, frozen=True, kw_only=True, tag="pong"):
    """The runner is there (a round trip, for the timing's overhead)."""


class SetUp(Reply, frozen=True, kw_only=True, tag="set_up"):
    """The runner is set up: its threads, and the TF32 settings it read back."""

    threads: int
    precision: dict[str, str | bool | None] = {}


class TaskLoaded(Reply, frozen=True, kw_only=True, tag="task_loaded"):
    """The task's Model is built; ``init`` holds the constructor's arguments."""

    init: Blob


class CandidateLoaded(Reply, frozen=True, kw_only=True, tag="candidate_loaded"):
    """The candidate is imported and its ModelNew built."""


class InputsMade(Reply, frozen=True, kw_only=True, tag="inputs_made"):
    """One input set made by the reference, with its outputs' shapes; ``missing`` says why
    there is none (a variant the task cannot make, a distribution the reference rejects)."""

    input_shapes: list[list[int]] = []
    input_dtypes: list[str] = []
    output_shapes: list[list[int]] = []
    output_dtypes: list[str] = []
    eager_ms: float = 0.0
    variant: str = ""  #: which variant (its shapes), when one was asked for
    missing: str = ""
    #: the inputs for the candidate runner; None where it makes its own
    inputs: Blob | None = None
    reused: bool = False
    device_free_bytes: int = 0
    device_total_bytes: int = 0


class Ran(Reply, frozen=True, kw_only=True, tag="ran"):
    """The candidate's outputs for one input set, and its inputs after the call (or,
    where it made them itself or they are large, what it found changed in them)."""

    outputs: Blob
    inputs_after: Blob | None = None
    inputs_problem: str | None = None
    torch_ops: list[str] = []
    #: where the request's time went (inputs, forward, outputs), for the request log
    phases_ns: dict[str, int] = {}


class Checked(Reply, frozen=True, kw_only=True, tag="checked"):
    """The reference's verdict on a candidate's outputs."""

    verdict: Verdict


class Timed(Reply, frozen=True, kw_only=True, tag="timed"):
    """One sample per call, in nanoseconds of the runner's clock; with ``graph`` asked,
    one per replay of the graph, per call. ``method``: ``events`` or ``graph-N``;
    ``state_found``: device state a call had left and the reset before a sample undid
    (kf.evaluation.runner.device_state; "": none); ``graph_error``: why no graph was
    timed (the samples are then empty)."""

    samples_ns: list[int]
    method: str = "events"
    state_found: str = ""
    graph_error: str = ""


class InputsTimed(Reply, frozen=True, kw_only=True, tag="inputs_timed"):
    """One sample per fresh input set, and (paired) one on the timed inputs after each."""

    samples_ns: list[int]
    repeated_ns: list[int] = []


class BatchRan(Reply, frozen=True, kw_only=True, tag="batch_ran"):
    """Back-to-back calls, in nanoseconds of the runner's clock."""

    total_ns: int


class CountersRan(Reply, frozen=True, kw_only=True, tag="counters_ran"):
    """One call ran between cudaProfilerStart and Stop."""


class Trimmed(Reply, frozen=True, kw_only=True, tag="trimmed"):
    """A reference runner dropped its per-stage tensors (``dropped_bytes``, 0: none)."""

    dropped_bytes: int = 0


class UserTestsRan(Reply, frozen=True, kw_only=True, tag="user_tests_ran"):
    """The user tests that ran (``file::function``) and the first that failed, with its
    message (``failed`` empty: all passed)."""

    passed: list[str] = []
    failed: str = ""
    message: str = ""


class Audited(Reply, frozen=True, kw_only=True, tag="audited"):
    """Whether the task's outputs depend on its inputs (:mod:`kf.evaluation.grader.audit`)."""

    degenerate: bool
    reason: str = ""
    input_sets: int = 0
    spread: float = 0.0
    constant_passes: int = 0


class BaselineCompiled(Reply, frozen=True, kw_only=True, tag="baseline_compiled"):
    """The reference under ``torch.compile``, or ``error``: why there is none."""

    baseline: str = ""
    mode: str = "default"
    compile_s: float = 0.0
    graphs: int = 0
    error: str | None = None
    cached: bool = False


# -- requests ----------------------------------------------------------------------


class Ping(Request[Pong], frozen=True, kw_only=True, tag="ping"):
    """Answer at once."""


class Setup(Request[SetUp], frozen=True, kw_only=True, tag="setup"):
    """Set the runner up for its one job: device, threads, limits, tensor transport."""

    device: str
    threads: int
    memory_bytes: int = 0
    cpu_s: int = 0
    #: CPU seconds the hard limit holds beyond ``cpu_s`` at a runner's first set-up, for
    #: its later stages (a runner kept from a candidate's build to its profile); a runner
    #: set up again keeps its hard limit and sets only its soft one, within it
    cpu_later_s: int = 0
    file_bytes: int = 0
    ipc: bool = False  #: tensors as CUDA IPC handles (a CUDA device only)
    shm: int | None = None  #: payloads of this many bytes or more as memory files (None: never)
    own_inputs: bool = False  #: a candidate runner makes each trial's inputs from its seed
    reference_cache_bytes: int = 0  #: made inputs a reference runner keeps (-1: default)
    tf32: str | None = None  #: ``on``, ``off``, or None: as PyTorch starts
    nice: int = 0  #: how much lower than grading the runner (a build) runs
    device_inputs: bool = False  #: ``get_inputs()`` makes its tensors on the (CUDA) device


class LoadTask(Request[TaskLoaded], frozen=True, kw_only=True, tag="load_task"):
    """Import the task and build its Model from seeded constructor inputs."""

    source: str
    name: str
    seed: int
    #: a package's user tests, imported after the task to check that they import
    tests: list[tuple[str, str]] = []


class LoadCandidate(Request[CandidateLoaded], frozen=True, kw_only=True, tag="load_candidate"):
    """Import the candidate and build its ModelNew from ``init`` (the reference's
    constructor arguments) or, with none, from the task's own seeded ones."""

    source: str
    seed: int
    task_source: str
    task_name: str
    init: Blob | None = None


class MakeInputs(Request[InputsMade], frozen=True, kw_only=True, tag="make_inputs"):
    """Make a trial's inputs and expected outputs: the task's shapes, generalisation
    ``variant`` N, or the task's inputs times ``scale``; ``send`` them or not."""

    seed: int
    variant: int | None = None
    scale: float | None = None
    send: bool = True


class Run(Request[Ran], frozen=True, kw_only=True, tag="run"):
    """Run ModelNew once on ``inputs``, or on the inputs of ``seed`` (times ``scale``)
    made in the runner; ``trace`` records the PyTorch ops it dispatches."""

    inputs: Blob | None = None
    seed: int | None = None
    scale: float | None = None
    trace: bool = False


class Check(Request[Checked], frozen=True, kw_only=True, tag="check"):
    """Judge a candidate's outputs for ``seed``'s inputs at ``tol`` (None: KernelBench's)."""

    seed: int
    outputs: Blob
    inputs_after: Blob | None = None
    inputs_problem: str | None = None
    tol: Tolerance | None = None

    @classmethod
    def of(cls, ran: Ran, seed: int, tol: Tolerance | None = None) -> Check:
        """The check of what the candidate runner answered to a :class:`Run`."""
        return cls(
            seed=seed,
            outputs=ran.outputs,
            inputs_after=ran.inputs_after,
            inputs_problem=ran.inputs_problem,
            tol=tol,
        )


class Time(Request[Timed], frozen=True, kw_only=True, tag="time"):
    """Time ``n`` calls on the current inputs: of the model, of the reference under
    ``torch.compile`` (``compiled``), or of a function that does nothing (``empty``)."""

    n: int
    compiled: bool = False
    empty: bool = False
    #: > 0: ``graph`` calls captured in one CUDA graph, replayed ``n`` times (a GPU's)
    graph: int = 0


class TimeInputs(Request[InputsTimed], frozen=True, kw_only=True, tag="time_inputs"):
    """One timed call on each fresh input set (``inputs``, or made from ``seeds``);
    ``paired``: each followed by one on the timed inputs."""

    seeds: list[int] | None = None
    inputs: list[Blob] | None = None
    paired: bool = False


class Batch(Request[BatchRan], frozen=True, kw_only=True, tag="batch"):
    """``n`` back-to-back calls, timed as one."""

    n: int


class Settle(Request[Pong], frozen=True, kw_only=True, tag="settle"):
    """Outside the grader's clock: trim the GPU cache, or (``warm``) make the call due after."""

    warm: bool = False
    compiled: bool = False


class Counters(Request[CountersRan], frozen=True, kw_only=True, tag="counters"):
    """A warm-up call, then one between cudaProfilerStart and Stop (for ncu)."""


class Trim(Request[Trimmed], frozen=True, kw_only=True, tag="trim"):
    """Drop the trials' tensors when they hold more than ``keep_bytes``."""

    keep_bytes: int = 1 << 30  # as runner_common._TRIM_ABOVE_BYTES


class Audit(Request[Audited], frozen=True, kw_only=True, tag="audit"):
    """Run the reference on each seed's inputs and the first's scaled by ``scales``."""

    seeds: list[int]
    scales: list[float] = []
    tol: Tolerance | None = None


class CompileBaseline(Request[BaselineCompiled], frozen=True, kw_only=True, tag="compile_baseline"):
    """Compile the reference with ``torch.compile`` (``mode``) for the current inputs, once."""

    cache_dir: str | None = None
    mode: str = "default"


class UserTests(Request[UserTestsRan], frozen=True, kw_only=True, tag="user_tests"):
    """Run a task package's user tests (``(path in the package, text)`` each) against the
    loaded candidate: each ``test_*`` function with the fixtures it names
    (:data:`kf.kernels.task_packages.FIXTURES`), built from ``seed``."""

    tests: list[tuple[str, str]]
    seed: int = 0


class Exit(Request[Reply], frozen=True, kw_only=True, tag="exit"):
    """Exit now (no reply)."""


# -- start-up and builds -------------------------------------------------------------


class Ready(Message, frozen=True, kw_only=True, tag="ready"):
    """A runner's first message: it has imported torch and serves requests."""

    pid: int
    torch: str


class BuildNative(Message, frozen=True, kw_only=True, tag="build"):
    """A boxed runner asks the grader to build a ``kf.native`` library
    (kf.evaluation.grader.builds)."""

    source: str
    flags: list[str] = []
    defines: dict[str, str] = {}
    timeout_s: float = 120.0


class BuildInline(Message, frozen=True, kw_only=True, tag="build_inline"):
    """A boxed runner asks the grader to build a ``load_inline`` extension."""

    arguments: dict[str, Any]
    environment: dict[str, Any]


class Built(Message, frozen=True, kw_only=True, tag="built"):
    """The grader's answer to a build: the path in the read-only shared cache, or why not."""

    ok: bool
    path: str = ""
    error: str = ""
    log: str = ""
    cached: bool = False


#: what the grader sends a runner: requests, and answers to its builds
ToRunner = (
    Ping | Setup | LoadTask | LoadCandidate | MakeInputs | Run | Check | Time | TimeInputs
    | Batch | Settle | Counters | Trim | Audit | CompileBaseline | UserTests | Exit | Built
)  # fmt: skip
#: what a runner sends the grader: replies, its start-up, and builds it asks for
ToGrader = (
    Failed | Pong | SetUp | TaskLoaded | CandidateLoaded | InputsMade | Ran | Checked | Timed
    | InputsTimed | BatchRan | CountersRan | Trimmed | Audited | BaselineCompiled
    | UserTestsRan | Ready
    | BuildNative | BuildInline
)  # fmt: skip

#: each request's reply type, from its type parameter
_REPLY_OF: dict[type[Any], type[Reply]] = {
    cls: typing.get_args(cls.__orig_bases__[0])[0]
    for cls in typing.get_args(ToRunner)
    if issubclass(cls, Request)
}
_encoder = msgspec.msgpack.Encoder()
_to_runner = msgspec.msgpack.Decoder(ToRunner)
_to_grader = msgspec.msgpack.Decoder(ToGrader)


def reply_type(request: Request[_R]) -> type[_R]:
    """The reply ``request`` is answered with (besides :class:`Failed`)."""
    return typing.cast(type[_R], _REPLY_OF[type(request)])


def encode(message: Message) -> bytes:
    """``message`` as MessagePack (its payloads' descriptors are sent beside it:
    :func:`kf.evaluation.wire.shared_memory.send_message`)."""
    return _encoder.encode(message)


#: how deep lists and maps may nest in a message's free-form fields (a build's
#: ``load_inline`` arguments: strings, lists of strings, a map of them); deeper is refused
#: where it is decoded, before any code walks it with Python's recursion
MAX_NESTING = 32
_FREE_FORM: dict[type[Message], tuple[str, ...]] = {BuildInline: ("arguments", "environment")}


def _nested_deeper(value: object, limit: int) -> bool:
    """Whether lists, tuples and maps nest more than ``limit`` levels in ``value``
    (level by level, without recursion)."""
    level, depth = [value], 0
    while level:
        containers = [v for v in level if isinstance(v, list | tuple | dict)]
        if not containers:
            return False
        depth += 1
        if depth > limit:
            return True
        level = [x for c in containers for x in ([*c, *c.values()] if isinstance(c, dict) else c)]
    return False


def nesting_problem(message: Message) -> str | None:
    """Which of ``message``'s free-form fields nests more than :data:`MAX_NESTING` levels
    deep, said in a phrase (None: none does); such a message is refused where it is
    decoded, so a runner refuses to send it."""
    for name in _FREE_FORM.get(type(message), ()):
        if _nested_deeper(getattr(message, name), MAX_NESTING):
            return f"`$.{name}` nested more than {MAX_NESTING} levels deep"
    return None


def _bounded(message: _M, direction: str) -> _M:
    problem = nesting_problem(message)
    if problem:
        raise ForeignMessage(f"not a message {direction}: {problem}")
    return message


def _decode(decoder: msgspec.msgpack.Decoder[_M], data: bytes, direction: str) -> _M:
    try:
        return _bounded(decoder.decode(data), direction)
    except msgspec.ValidationError as exc:
        raise ForeignMessage(f"not a message {direction}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not MessagePack: {exc}") from exc
    except RecursionError:  # deeper than the decoder goes: far past the bound
        raise ForeignMessage(
            f"not a message {direction}: nested more than {MAX_NESTING} levels deep"
        ) from None


def decode_from_grader(data: bytes) -> ToRunner:
    """A message the grader sent a runner; :class:`ProtocolError` if it is not one."""
    return _decode(_to_runner, data, "from kf's grader to a runner")


def decode_from_runner(data: bytes) -> ToGrader:
    """A message a runner sent the grader; :class:`ProtocolError` if it is not one (a
    build's arguments nested more than :data:`MAX_NESTING` levels deep included)."""
    return _decode(_to_grader, data, "from a kf runner to its grader")
