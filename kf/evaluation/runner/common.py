"""What every runner role shares: the base of :class:`kf.evaluation.runner.Runner`
(set-up, payloads in and out, the task's import and inputs, timing) and the helpers the
roles use.
"""

from __future__ import annotations

import functools
import io
import os
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from kf.evaluation.runner.baselines import apply_tf32
from kf.evaluation.runner.graph_timing import time_in_graph
from kf.evaluation.runner.guard import Watch
from kf.evaluation.runner.transport import Exports, is_ipc, pack, unpack
from kf.evaluation.wire import file_maker, shared_memory
from kf.evaluation.wire import protocol as p

_MAX_ERROR = 2000
_TRIM_ABOVE_BYTES = 1 << 30  # cached-but-free GPU memory a runner gives back
TRIALS_KEPT = 4  # trials (pristine inputs, expected outputs) a reference runner holds

#: the bytes of trials a reference runner may hold whatever its cache budget
TRIALS_FLOOR = 1 << 30


_MAX_LOG = 20_000


def describe_exception(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR] + " …"


class RequestFailure(Exception):
    """A request failed in a way the grader should see with a given kind."""

    def __init__(self, kind: str, error: str, log: str = "") -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error
        self.log = log


class Compiled(NamedTuple):
    """The reference under ``torch.compile`` for one model and input signature.

    ``fn`` is None when compiling failed; ``reply`` is what the first request was told
    (compile seconds and graphs, or the error), repeated to later ones with ``cached``.
    """

    fn: Any
    reply: p.BaselineCompiled


MAX_COMPILED = 4  # compiled references a runner keeps (one per model seed and input shapes)


class Made(NamedTuple):
    """One input set a reference runner made: the reply, pristine inputs, expected outputs."""

    reply: p.InputsMade
    pristine: list[Any] | None = None
    expected: list[Any] = []
    nbytes: int = 0


#: Input tensors of at least this many bytes are checked for mutation against checksums
#: rather than a copy (:meth:`RunnerBase._seeded`).
FINGERPRINT_ABOVE = 1 << 28

#: The longest single bytes object a payload is sent as (see :meth:`Runner.dump`).
PAYLOAD_PIECE = 1 << 30


def _nothing(*_: Any) -> None:
    """What ``time`` calls with ``empty``: nothing, to measure the loop around a call."""


def dynamo_graphs(torch: Any) -> int:
    """Graphs dynamo has compiled in this process so far (0 where torch does not say)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except (ImportError, AttributeError, KeyError, TypeError):
        return 0


def traceback_tail() -> str:
    text = traceback.format_exc()
    return text[-_MAX_LOG:]


def _listed(value: Any, call: str) -> list[Any]:
    """What a task's ``call`` returned, as a list: a task error unless a list or tuple."""
    if not isinstance(value, list | tuple):
        raise RequestFailure("task_error", f"{call} returned {type(value).__name__}, not a list")
    return list(value)


def flatten_outputs(torch: Any, out: Any, what: str, kind: str) -> list[Any]:
    items = [out] if isinstance(out, torch.Tensor) else out
    if not isinstance(items, list | tuple):
        raise RequestFailure(
            kind, f"{what} returned {type(out).__name__}, not a tensor or a tuple of tensors"
        )
    for item in items:
        if type(item) not in (torch.Tensor, torch.nn.Parameter):
            raise RequestFailure(
                kind, f"{what} returned a {type(item).__name__}, not a plain torch.Tensor"
            )
    return list(items)


class RunnerBase:
    """Set-up, payloads, the task's import and inputs, and timing: what every role needs."""

    def __init__(self, clock_ns: Callable[[], int], watch: Watch | None = None) -> None:
        import torch

        from kf.evaluation.runner.device import Backend, make_backend

        self.torch = torch
        self.clock_ns = clock_ns
        self.backend: Backend = make_backend("cpu", clock_ns)
        #: the device its last set-up was for (None: not set up yet)
        self.set_up_for: str | None = None
        self.model: Any = None
        self.task_module: Any = None
        # a candidate runner's candidate module, constructor inputs and task text (for a
        # package's user tests: kf.evaluation.runner.user_tests)
        self.candidate_module: Any = None
        self.init_inputs: list[Any] = []
        self.task_text: tuple[str, str] = ("", "")
        self._inputs: list[Any] | None = []
        self._inputs_from: list[Any] = []
        self.trials: dict[int, tuple[list[Any], list[Any]]] = {}
        self.trial_variant: dict[int, int | None] = {}
        self.watch = watch or Watch()
        self.cold = False  # cached blocks given back since the last call (op_settle)
        # CUDA runners hand tensors over as IPC handles (kf.evaluation.runner.transport)
        self.ipc = False
        #: payloads of at least this many bytes of tensors go as sealed memory files
        #: (kf.evaluation.wire.shared_memory); None: never
        self.shm: int | None = None
        self.exports = Exports()
        # a candidate runner that makes its trial inputs from the seed itself (the grader
        # then moves only outputs: kf.evaluation.grader.grading.makes_own_inputs)
        self.own_inputs = False
        #: the task's get_inputs() makes its tensors on the (CUDA) device
        self.device_inputs = False
        # a reused reference runner keeps the inputs and outputs it made, per seed
        self.made: OrderedDict[tuple[int, int, int | None, float | None], Made] = OrderedDict()
        self.trial_scale: dict[int, float | None] = {}  # hidden distributions' factors
        self.made_budget = 0
        self.model_seed = 0
        # a reused reference runner keeps its torch.compile'd reference, per model seed
        # and input signature, so later candidates of the task do not pay the compile
        self.compiled: OrderedDict[tuple[Any, ...], Compiled] = OrderedDict()

    @property
    def inputs(self) -> list[Any]:
        """The inputs the next timed call gets; after ``make_inputs`` a private copy of
        the made set, cloned on first use (a verification never uses it, and at
        KernelBench's sizes each copy is gigabytes of device memory)."""
        if self._inputs is None:
            self._inputs, self._inputs_from = self._private(self._inputs_from), []
        return self._inputs

    @inputs.setter
    def inputs(self, values: list[Any]) -> None:
        self._inputs, self._inputs_from = values, []

    def _private(self, values: list[Any]) -> list[Any]:
        """The timed calls' own copy of a made set (:attr:`inputs`)."""
        return self.clone(values)

    # -- serialisation -------------------------------------------------------------
    def dump(self, value: Any) -> p.Blob:
        """``value`` (a runner's tensors, wherever they live) as a payload: IPC handles;
        a sealed memory file (:mod:`kf.evaluation.wire.shared_memory`) when large enough; or
        ``torch.save`` bytes of host copies, split into pieces of at most
        :data:`PAYLOAD_PIECE` bytes when longer (msgpack, which carries every message,
        cannot hold one bytes object over 4 GiB, and one output of KernelBench's level-1
        tasks is 6.4 GB)."""
        if self.ipc and isinstance(value, list):
            return pack(self.torch, self.host(value), self.exports)
        if self.shm is not None and isinstance(value, list):
            shared = shared_memory.pack(self.torch, value, self.shm)
            if shared is not None:
                return shared
        if isinstance(value, list):
            value = self.host(value)
        buf = io.BytesIO()
        self.torch.save(value, buf)
        if buf.tell() <= PAYLOAD_PIECE:
            return buf.getvalue()
        view = buf.getbuffer()
        # memoryviews, encoded as bytes: no copy of gigabytes into bytes objects first
        step = PAYLOAD_PIECE
        pieces: list[Any] = [view[i : i + step] for i in range(0, len(view), step)]
        return pieces

    def _dump_inputs(self, pristine: list[Any]) -> p.Blob:
        """The reference's inputs for another runner, which cannot reach ``pristine``
        itself: a clone goes over IPC (the receiver maps the allocation writable); the
        other payloads are copies already."""
        return self.dump(self.clone(pristine) if self.ipc else pristine)

    def load(self, data: p.Blob) -> Any:
        if isinstance(data, shared_memory.Payload):
            try:
                return shared_memory.unpack(self.torch, data)
            finally:
                data.close()  # mapped: the descriptor is no longer needed
        if isinstance(data, list):  # a payload in pieces (dump)
            data = b"".join(data)
        if is_ipc(data):
            return unpack(self.torch, data)
        return self.torch.load(io.BytesIO(data), weights_only=True)

    def host(self, values: list[Any]) -> list[Any]:
        """What a reply carries of ``values``: as they are over IPC, else host copies."""
        if self.ipc:
            return [v.detach() if isinstance(v, self.torch.Tensor) else v for v in values]
        return [v.detach().cpu().clone() if isinstance(v, self.torch.Tensor) else v for v in values]

    def clone(self, values: list[Any]) -> list[Any]:
        return [v.detach().clone() if isinstance(v, self.torch.Tensor) else v for v in values]

    # -- handlers ------------------------------------------------------------------
    def op_ping(self, msg: p.Ping) -> p.Pong:
        return p.Pong()

    def op_setup(self, msg: p.Setup) -> p.SetUp:
        import resource

        from kf.evaluation.runner.device import make_backend

        if msg.nice > 0:
            os.nice(msg.nice)  # a build: its compilers yield to grading and timing
        first = self.set_up_for is None
        if self.set_up_for != msg.device:
            # set up again for the same device (a runner kept for its candidate's next
            # stage), it keeps its backend: the guard checks that one is still in place
            self.backend = make_backend(msg.device, self.clock_ns)
            self.set_up_for = msg.device
        self.ipc = msg.ipc and self.backend.name == "cuda"
        self.shm = msg.shm if msg.shm is not None and not self.ipc else None
        self.own_inputs = msg.own_inputs
        self.device_inputs = msg.device_inputs and self.backend.name == "cuda"
        self.made_budget = self._cache_budget(msg)
        self.torch.set_num_threads(msg.threads)
        if msg.file_bytes and self.shm is not None:
            # before any limit: large payloads stay memory files under the file limit
            file_maker.start_file_maker()
        if msg.memory_bytes:
            # on top of what the runner maps already: a CUDA build of PyTorch maps
            # gigabytes of address space when imported, and an absolute limit left a CPU
            # runner on a GPU host no room to import anything (on the H200 a candidate's
            # `import sqlite3` failed to map its library)
            limit = _mapped_bytes() + msg.memory_bytes
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            if hard != resource.RLIM_INFINITY:  # set up before (a reused runner): lower only
                limit = min(limit, hard)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        if msg.cpu_s:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            used = int(usage.ru_utime + usage.ru_stime) + 1
            soft = used + msg.cpu_s
            _, before = resource.getrlimit(resource.RLIMIT_CPU)
            # the first set-up sets the hard limit (with the later stages' seconds); a
            # runner kept for its candidate's next stage keeps it and sets its soft one
            hard = soft + msg.cpu_later_s + 5 if first else before
            if before != resource.RLIM_INFINITY:  # lower only
                hard = min(hard, before)
            resource.setrlimit(resource.RLIMIT_CPU, (min(soft, hard), hard))
        if msg.file_bytes:
            size = msg.file_bytes
            _, before = resource.getrlimit(resource.RLIMIT_FSIZE)
            if before != resource.RLIM_INFINITY:  # set up before (a kept runner): lower only
                size = min(size, before)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        # TF32 set explicitly before any task or candidate code runs (the grader's choice)
        precision = apply_tf32(self.torch, msg.tf32)
        return p.SetUp(threads=self.torch.get_num_threads(), precision=precision)

    def _cache_budget(self, msg: p.Setup) -> int:
        """Bytes of made inputs and outputs a reference runner keeps (0: none).

        ``reference_cache_bytes`` < 0 asks for the default: a tenth of the GPU's memory
        up to 8 GiB on a GPU, an eighth of the memory limit up to 1 GiB on a CPU.
        """
        asked = msg.reference_cache_bytes
        if asked >= 0:
            return asked
        if self.backend.name == "cuda":
            props = self.torch.cuda.get_device_properties(self.torch.cuda.current_device())
            return int(min(8 << 30, props.total_memory // 10))
        limit = msg.memory_bytes
        return min(1 << 30, limit // 8) if limit else 1 << 30

    def _import_task(self, source: str, name: str) -> Any:
        from kf.kernels.tasks import REQUIRED_NAMES, import_source

        try:
            module = import_source(f"kf_task_{name}", source, filename=f"<task {name}>")
        except BaseException as exc:
            raise RequestFailure(
                "task_error", f"import raised {describe_exception(exc)}", traceback_tail()
            ) from exc
        for attr in REQUIRED_NAMES:
            kind = "class" if attr == "Model" else "function"
            if not hasattr(module, attr):
                raise RequestFailure("task_error", f"defines no {kind} {attr}")
            if not callable(getattr(module, attr)):
                raise RequestFailure("task_error", f"{attr} is not callable")
        self.task_module = module
        return module

    def _init_inputs(self, module: Any, seed: int) -> list[Any]:
        self.torch.manual_seed(seed)
        try:
            init = module.get_init_inputs()
        except BaseException as exc:
            raise RequestFailure(
                "task_error",
                f"get_init_inputs() raised {describe_exception(exc)}",
                traceback_tail(),
            ) from exc
        return _listed(init, "get_init_inputs()")

    def _get_inputs(self, seed: int) -> list[Any]:
        """The task's ``get_inputs()`` after seeding with ``seed``: on a GPU (with
        ``device_inputs``) its tensors are made on the device, where making a 6.4 GB
        input takes milliseconds instead of seconds on the host. The values are the
        device's random stream's, the same in every runner on that device (the candidate
        runner that makes its own inputs included), not the host's that KernelBench's
        harness draws; a task whose ``get_inputs()`` cannot run so is a task error that
        says how to make inputs on the host."""
        self.torch.manual_seed(seed)
        on_device = self.device_inputs
        try:
            if on_device:
                with self.torch.device(self.backend.device):
                    raw = self.task_module.get_inputs()
            else:
                raw = self.task_module.get_inputs()
        except BaseException as exc:
            where = (
                f" with its tensors made on {self.backend.device} ($KF_DEVICE_INPUTS=0 "
                "makes them on the host)"
                if on_device
                else ""
            )
            raise RequestFailure(
                "task_error",
                f"get_inputs(){where} raised {describe_exception(exc)}",
                traceback_tail(),
            ) from exc
        return _listed(raw, "get_inputs()")

    def _seeded(
        self, seed: int, scale: float | None = None, *, check: bool = True
    ) -> tuple[list[Any], list[Any]]:
        """The trial inputs for ``seed`` (scaled by ``scale``, a hidden distribution) made
        here, as the reference makes them, and what to check them against after the call:
        a pristine copy beside them, or, for a tensor of at least
        :data:`FINGERPRINT_ABOVE` bytes, its checksums (:func:`kf.evaluation.runner.compare.
        fingerprint`): at KernelBench's sizes a copy is 6.4 GB more device memory, or two
        6.4 GB transfers and a host-side comparison a trial when kept on the host."""
        raw = self._get_inputs(seed)
        if scale is not None:
            from kf.evaluation.runner.variants import scale_inputs

            raw = scale_inputs(self.torch, raw, scale) or raw
        inputs = [self.backend.to_device(v) for v in raw]
        if not check:
            return inputs, []
        from kf.evaluation.runner.compare import checkable

        return inputs, checkable(self.torch, inputs, FINGERPRINT_ABOVE)

    def _trim_device_cache(self) -> None:
        """Give cached GPU blocks back once they are large: a runner's peak at
        KernelBench's sizes is several 6 GB tensors, and blocks its caching allocator keeps
        are memory the other runners on the same GPU cannot have."""
        if self.backend.name != "cuda":
            return
        cuda = self.torch.cuda
        if cuda.memory_reserved() - cuda.memory_allocated() > _TRIM_ABOVE_BYTES:
            cuda.empty_cache()
            self.cold = True

    def _signature(self, values: list[Any]) -> tuple[Any, ...]:
        """What a compiled graph is specialised on: each input's shape, dtype and device
        (tensors) or value (anything else), with the model's seed."""
        torch = self.torch
        parts = [
            (tuple(v.shape), str(v.dtype), str(v.device), v.requires_grad)
            if isinstance(v, torch.Tensor)
            else (type(v).__name__, repr(v)[:200])
            for v in values
        ]
        return (self.model_seed, *parts)

    def _timed_model(self, compiled: bool = False, empty: bool = False) -> Any:
        """What a timed call calls: the model, the reference under ``torch.compile``, or
        a function that does nothing (the timing loop's own cost)."""
        if compiled:
            known = self.compiled.get(self._signature(self.inputs))
            if known is None or known.fn is None:
                raise RequestFailure("protocol", "no compiled reference for these inputs")
            return known.fn
        return _nothing if empty else self.model

    def op_settle(self, msg: p.Settle) -> p.Pong:
        """The runners on one GPU time in turn: after its turn a runner gives back what
        its calls' temporaries took (8 GB for KernelBench's HuberLoss), and before its
        next one makes the untimed call that allocates them again. A request of its own,
        outside the wall clock the grader keeps around each timed request."""
        if msg.warm and self.cold:  # blocks given back (_trim_device_cache) since a call
            model, inputs = self._timed_model(msg.compiled), self.inputs
            try:
                with self.torch.no_grad():
                    model(*inputs)
                self.backend.synchronize()
            except BaseException as exc:
                raise RequestFailure(
                    "exception", f"forward raised {describe_exception(exc)}", traceback_tail()
                ) from exc
            self.cold = False
        elif not msg.warm:
            self._trim_device_cache()
        return p.Pong()

    def op_time(self, msg: p.Time) -> p.Timed:
        torch = self.torch
        inputs, backend = self.inputs, self.backend
        model = self._timed_model(msg.compiled, msg.empty)
        if msg.graph > 0 and backend.name == "cuda":
            return time_in_graph(torch, backend, model, inputs, msg)
        samples: list[int] = []
        try:
            with torch.no_grad():
                for _ in range(msg.n):
                    backend.flush_cache()  # resets the device state a call left first
                    samples.append(backend.time_call_ns(lambda: model(*inputs)))
        except BaseException as exc:
            raise RequestFailure(
                "exception",
                f"forward raised {describe_exception(exc)} while timing",
                traceback_tail(),
            ) from exc
        found, backend.found = backend.found, ""
        return p.Timed(samples_ns=samples, state_found=found)

    def op_time_inputs(self, msg: p.TimeInputs) -> p.InputsTimed:
        """One timed call on each of several fresh input sets (a cache would miss here)."""
        torch = self.torch
        model, backend = self.model, self.backend
        # one set made (or loaded) at a time, the last one let go first: at KernelBench's
        # sizes each set is gigabytes of device memory
        sets: Iterator[list[Any]]
        if msg.seeds is not None and self.own_inputs:
            sets = (self._seeded(s, check=False)[0] for s in msg.seeds)
        else:
            sets = ([backend.to_device(v) for v in self.load(d)] for d in msg.inputs or [])
        samples: list[int] = []
        repeated: list[int] = []  # with "paired": the last inputs, timed the same way after each
        for inputs in sets:  # a set that cannot be made fails as its maker says (task_error)
            try:
                with torch.no_grad():
                    for which, into in ((inputs, samples), (self.inputs, repeated)):
                        if into is repeated and not msg.paired:
                            continue
                        # Read every input once so fresh data is as warm as repeated data.
                        for v in which:
                            if isinstance(v, torch.Tensor) and v.is_floating_point():
                                float(v.sum())
                        backend.flush_cache()
                        into.append(backend.time_call_ns(functools.partial(model, *which)))
            except (
                BaseException
            ) as exc:  # whatever the candidate's call raised, a RequestFailure too
                raise RequestFailure(
                    "exception",
                    f"forward raised {describe_exception(exc)} on fresh inputs",
                    traceback_tail(),
                ) from exc
            del inputs, which
        self._trim_device_cache()
        return p.InputsTimed(samples_ns=samples, repeated_ns=repeated)


def _mapped_bytes() -> int:
    """The address space this process maps now (0 where /proc says nothing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
