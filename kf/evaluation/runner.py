"""The sandboxed runner process: ``python -m kf.evaluation.runner FD PARENT_PID``.

It binds its clock, imports torch, says it is ready and then serves requests from the
grader on the socket ``FD``. One runner serves one candidate (or one task reference)
and is then discarded. Candidate code runs here, so the clock is bound in :func:`main`
before anything else is imported, and is never stored where the candidate can reach
it by name.
"""

from __future__ import annotations

import functools
import io
import os
import socket
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from kf.evaluation import shared_memory
from kf.evaluation.baseline_settings import apply_tf32, compile_kwargs, describe_compile
from kf.evaluation.transport import Exports, is_ipc, pack, unpack

__all__ = ["main"]

_MAX_ERROR = 2000
_TRIM_ABOVE_BYTES = 1 << 30  # cached-but-free GPU memory a reference runner gives back
_TRIALS_KEPT = 4  # trials (pristine inputs, expected outputs) a reference runner holds
_MAX_LOG = 20_000


def _watch_parent(parent_pid: int) -> None:
    """Exit when the grader goes away, so a runner is never left behind.

    The runner's parent is the grader, or a wrapper the grader started (ncu): either
    way, being re-parented means that parent died, and the grader's pid vanishing
    means the grader did. In the box (``parent_pid`` 0) the parent is bwrap's init,
    which dies with the grader (``--die-with-parent``) and takes the box with it.
    """
    first = os.getppid()
    while True:
        if os.getppid() != first:
            os._exit(70)
        if parent_pid and first != parent_pid:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(70)
            except OSError:
                pass  # exists, just not ours to signal
        time.sleep(0.5)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR] + " …"


_NETWORK_EVENTS = frozenset(
    {
        "socket.bind",
        "socket.connect",
        "socket.getaddrinfo",
        "socket.gethostbyaddr",
        "socket.gethostbyname",
        "socket.sendmsg",
        "socket.sendto",
    }
)
_INTROSPECTION_EVENTS = frozenset(
    {
        "gc.get_objects",
        "gc.get_referents",
        "gc.get_referrers",
        "sys._current_frames",
        "sys._getframe",
        "sys.setprofile",
        "sys.settrace",
    }
)
# aten ops that move, view or allocate data; anything else in forward is PyTorch compute.
_DATA_OPS = frozenset(
    {
        "_local_scalar_dense",
        "_to_copy",
        "_unsafe_view",
        "alias",
        "as_strided",
        "clone",
        "contiguous",
        "copy_",
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "expand",
        "fill_",
        "lift_fresh",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "permute",
        "reshape",
        "resize_",
        "select",
        "slice",
        "split",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unsqueeze",
        "view",
        "zero_",
        "zeros",
        "zeros_like",
    }
)


class _Watch:
    """An audit hook: once a candidate is loaded it blocks network calls and notes
    introspection (garbage collector, frames, tracers) and runner classes being patched.

    Findings travel back with the next reply; a signal, since code that reaches native
    memory can get around any in-process check.
    """

    def __init__(self) -> None:
        self.active = False
        self._busy = False
        self._found: dict[str, str] = {}
        #: the runner's own socket to the grader, whose ``sendmsg`` carries descriptors
        #: of shared-memory payloads (not the network; the grader checks what comes)
        self.grading: Any = None

    def drain(self) -> list[str]:
        found = [f"{code}: {detail}" for code, detail in self._found.items()]
        self._found.clear()
        return found

    def _note(self, code: str, detail: str) -> None:
        if code not in self._found:
            self._found[code] = detail
        elif detail not in self._found[code] and len(self._found[code]) < 300:
            self._found[code] += f", {detail}"

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active or self._busy:
            return
        if event in _NETWORK_EVENTS:
            if args and self.grading is not None and args[0] is self.grading:
                return
            self._note("network", f"{event} blocked")
            raise PermissionError(f"kf sandbox: network access is blocked ({event})")
        if event != "object.__setattr__" and event not in _INTROSPECTION_EVENTS:
            return
        self._busy = True
        try:
            if event == "object.__setattr__":
                obj = args[0]
                module = str(getattr(obj, "__module__", "")) if isinstance(obj, type) else ""
                if module == "__main__" or module.startswith(("kf.evaluation", "kf.native")):
                    self._note("tampering", f"set {obj.__name__}.{args[1]}")
            elif _called_from_candidate():
                self._note("introspection", event)
        finally:
            self._busy = False


def _called_from_candidate() -> bool:
    """Whether the Python code behind the current audited call is the candidate's."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        name = frame.f_code.co_filename
        if name == "<candidate>":
            return True
        if not name.endswith(("inspect.py", "traceback.py")):
            return False
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _functions(owner: Any) -> dict[str, tuple[Any, Any]]:
    out: dict[str, tuple[Any, Any]] = {}
    for name, value in list(vars(owner).items()):
        code = getattr(value, "__code__", None)
        if code is not None:
            out[f"{getattr(owner, '__name__', '?')}.{name}"] = (value, code)
    return out


class _Integrity:
    """What the runner's grading code looked like before the candidate was imported."""

    def __init__(self, runner: Runner, clock_ns: Callable[[], int], *bound: Any) -> None:
        self.snapshot = self._take(runner)
        self.attrs = set(vars(runner))
        self.backend = runner.backend
        self.backend_attrs = self._callables(runner.backend)
        self.clock_ns = clock_ns
        self.bound = bound

    @staticmethod
    def _callables(obj: Any) -> dict[str, int]:
        return {k: id(v) for k, v in vars(obj).items() if callable(v)}

    @staticmethod
    def _take(runner: Runner) -> dict[str, tuple[Any, Any]]:
        from kf.evaluation import compare, device, protocol, transport

        snap: dict[str, tuple[Any, Any]] = {}
        owners: list[Any] = [sys.modules[__name__], compare, device, protocol, transport]
        owners.append(shared_memory)
        owners += [c for c in type(runner).__mro__ if c is not object]
        owners += [c for c in type(runner.backend).__mro__ if c is not object]
        for owner in owners:
            snap.update(_functions(owner))
        torch = runner.torch
        for name in ("save", "load"):
            fn = getattr(torch, name)
            snap[f"torch.{name}"] = (fn, getattr(fn, "__code__", None))
        return snap

    def check(self, runner: Runner, clock_ns: Callable[[], int]) -> str | None:
        """None when nothing changed, else what did."""
        if set(vars(runner)) != self.attrs:
            return f"attributes {sorted(set(vars(runner)) ^ self.attrs)} of the runner"
        if (
            runner.backend is not self.backend
            or self._callables(runner.backend) != self.backend_attrs
        ):
            return "the timing backend"
        if runner.clock_ns is not self.clock_ns or clock_ns is not self.clock_ns:
            return "the runner's clock"
        now = self._take(runner)
        changed = [
            name
            for name, (fn, code) in self.snapshot.items()
            if name not in now or now[name][0] is not fn or now[name][1] is not code
        ]
        return ", ".join(sorted(changed)[:5]) if changed else None


class _OpRecorder:
    """Records the aten ops a call dispatches (a TorchDispatchMode built lazily)."""

    def __new__(cls, torch: Any) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
            def __init__(self) -> None:
                super().__init__()  # type: ignore[no-untyped-call]
                self.ops: dict[str, None] = {}

            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                self.ops[str(func.overloadpacket.__name__)] = None
                return func(*args, **(kwargs or {}))

        return Recorder()


class _Failure(Exception):
    """A request failed in a way the grader should see with a given kind."""

    def __init__(self, kind: str, error: str, log: str = "") -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error
        self.log = log


def _aliases(torch: Any, a: Any, b: Any) -> bool:
    """Whether two tensors share storage."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return True


class _Compiled(NamedTuple):
    """The reference under ``torch.compile`` for one model and input signature.

    ``fn`` is None when compiling failed; ``reply`` is what the first request was told
    (compile seconds and graphs, or the error), repeated to later ones with ``cached``.
    """

    fn: Any
    reply: dict[str, Any]


_MAX_COMPILED = 4  # compiled references a runner keeps (one per model seed and input shapes)


class _Made(NamedTuple):
    """One input set a reference runner made: the reply, pristine inputs, expected outputs."""

    reply: dict[str, Any]
    pristine: list[Any] | None = None
    expected: list[Any] = []
    nbytes: int = 0


#: The longest single bytes object a payload is sent as (see :meth:`Runner.dump`).
PAYLOAD_PIECE = 1 << 30


class Runner:
    """Request handlers; ``self.model`` is either the task's Model or the candidate's ModelNew."""

    def __init__(self, clock_ns: Callable[[], int], watch: _Watch | None = None) -> None:
        import torch

        from kf.evaluation.device import Backend, make_backend

        self.torch = torch
        self.clock_ns = clock_ns
        self.backend: Backend = make_backend("cpu", clock_ns)
        self.model: Any = None
        self.task_module: Any = None
        self._inputs: list[Any] | None = []
        self._inputs_from: list[Any] = []
        self.trials: dict[int, tuple[list[Any], list[Any]]] = {}
        self.trial_variant: dict[int, int | None] = {}
        self.watch = watch or _Watch()
        # CUDA runners hand tensors over as IPC handles (kf.evaluation.transport)
        self.ipc = False
        #: payloads of at least this many bytes of tensors go as sealed memory files
        #: (kf.evaluation.shared_memory); None: never
        self.shm: int | None = None
        self.exports = Exports()
        # a candidate runner that makes its trial inputs from the seed itself (the grader
        # then moves only outputs: kf.evaluation.stages._seeded_inputs)
        self.own_inputs = False
        # a reused reference runner keeps the inputs and outputs it made, per seed
        self.made: OrderedDict[tuple[int, int, int | None, float | None], _Made] = OrderedDict()
        self.trial_scale: dict[int, float | None] = {}  # hidden distributions (variants.SCALES)
        self.made_budget = 0
        self.model_seed = 0
        # a reused reference runner keeps its torch.compile'd reference, per model seed
        # and input signature, so later candidates of the task do not pay the compile
        self.compiled: OrderedDict[tuple[Any, ...], _Compiled] = OrderedDict()

    @property
    def inputs(self) -> list[Any]:
        """The inputs the next timed call gets; after ``make_inputs`` a private copy of
        the made set, cloned on first use (a verification never uses it, and at
        KernelBench's sizes each copy is gigabytes of device memory)."""
        if self._inputs is None:
            self._inputs, self._inputs_from = self.clone(self._inputs_from), []
        return self._inputs

    @inputs.setter
    def inputs(self, values: list[Any]) -> None:
        self._inputs, self._inputs_from = values, []

    # -- serialisation -------------------------------------------------------------
    def dump(self, value: Any) -> bytes | list[memoryview] | shared_memory.Payload:
        """``value`` (a runner's tensors, wherever they live) as a payload: IPC handles;
        a sealed memory file (:mod:`kf.evaluation.shared_memory`) when large enough; or
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
        return [view[i : i + PAYLOAD_PIECE] for i in range(0, len(view), PAYLOAD_PIECE)]

    def _dump_inputs(self, pristine: list[Any]) -> Any:
        """The reference's inputs for another runner, which cannot reach ``pristine``
        itself: a clone goes over IPC (the receiver maps the allocation writable); the
        other payloads are copies already."""
        return self.dump(self.clone(pristine) if self.ipc else pristine)

    def load(self, data: bytes | list[bytes] | shared_memory.Payload) -> Any:
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
    def op_ping(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {}

    def op_setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        import resource

        from kf.evaluation.device import make_backend

        if int(msg.get("nice") or 0) > 0:
            os.nice(int(msg["nice"]))  # a build: its compilers yield to grading and timing
        self.backend = make_backend(msg["device"], self.clock_ns)
        self.ipc = bool(msg.get("ipc")) and self.backend.name == "cuda"
        shm = msg.get("shm")
        self.shm = int(shm) if shm is not None and not self.ipc else None
        self.own_inputs = bool(msg.get("own_inputs"))
        self.made_budget = self._cache_budget(msg)
        self.torch.set_num_threads(int(msg["threads"]))
        if msg.get("memory_bytes"):
            mem = int(msg["memory_bytes"])
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        if msg.get("cpu_s"):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            used = int(usage.ru_utime + usage.ru_stime) + 1
            soft = used + int(msg["cpu_s"])
            resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 5))
        if msg.get("file_bytes"):
            size = int(msg["file_bytes"])
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        # TF32 set explicitly before any task or candidate code runs (the grader's choice)
        precision = apply_tf32(self.torch, msg.get("tf32"))
        return {"threads": self.torch.get_num_threads(), "precision": precision}

    def _cache_budget(self, msg: dict[str, Any]) -> int:
        """Bytes of made inputs and outputs a reference runner keeps (0: none).

        ``reference_cache_bytes`` < 0 asks for the default: a tenth of the GPU's memory
        up to 8 GiB on a GPU, an eighth of the memory limit up to 1 GiB on a CPU.
        """
        asked = int(msg.get("reference_cache_bytes") or 0)
        if asked >= 0:
            return asked
        if self.backend.name == "cuda":
            props = self.torch.cuda.get_device_properties(self.torch.cuda.current_device())
            return int(min(8 << 30, props.total_memory // 10))
        limit = int(msg.get("memory_bytes") or 0)
        return min(1 << 30, limit // 8) if limit else 1 << 30

    def _import_task(self, source: str, name: str) -> Any:
        from kf.tasks import REQUIRED_NAMES, import_source

        try:
            module = import_source(f"kf_task_{name}", source, filename=f"<task {name}>")
        except BaseException as exc:
            raise _Failure("task_error", f"import raised {_describe(exc)}", _tb()) from exc
        for attr in REQUIRED_NAMES:
            kind = "class" if attr == "Model" else "function"
            if not hasattr(module, attr):
                raise _Failure("task_error", f"defines no {kind} {attr}")
            if not callable(getattr(module, attr)):
                raise _Failure("task_error", f"{attr} is not callable")
        self.task_module = module
        return module

    def _init_inputs(self, module: Any, seed: int) -> list[Any]:
        self.torch.manual_seed(seed)
        try:
            init = module.get_init_inputs()
        except BaseException as exc:
            raise _Failure(
                "task_error", f"get_init_inputs() raised {_describe(exc)}", _tb()
            ) from exc
        if not isinstance(init, list | tuple):
            raise _Failure(
                "task_error", f"get_init_inputs() returned {type(init).__name__}, not a list"
            )
        return list(init)

    def op_load_task(self, msg: dict[str, Any]) -> dict[str, Any]:
        module = self._import_task(msg["source"], msg["name"])
        seed = int(msg["seed"])
        self.model_seed = seed  # the model's parameters: part of what made inputs are keyed by
        init = self._init_inputs(module, seed)
        self.torch.manual_seed(seed)
        try:
            model = module.Model(*init)
        except BaseException as exc:
            raise _Failure(
                "task_error", f"Model(*get_init_inputs()) raised {_describe(exc)}", _tb()
            ) from exc
        self.model = self.backend.to_device(model)
        return {"init": self.dump(init)}

    def _get_inputs(self, seed: int) -> list[Any]:
        self.torch.manual_seed(seed)
        try:
            raw = self.task_module.get_inputs()
        except BaseException as exc:
            raise _Failure("task_error", f"get_inputs() raised {_describe(exc)}", _tb()) from exc
        if not isinstance(raw, list | tuple):
            raise _Failure("task_error", f"get_inputs() returned {type(raw).__name__}, not a list")
        return list(raw)

    def _variant_candidates(self, seed: int, variant: int) -> list[tuple[str, list[Any]]]:
        """Input sets for generalisation variant ``variant``, most preferred first.

        The task's own ``get_extra_inputs()`` when it defines one; otherwise shapes the
        task can make itself (:func:`kf.evaluation.variants.derived_shapes`).
        """
        torch = self.torch
        extra = getattr(self.task_module, "get_extra_inputs", None)
        if callable(extra):
            torch.manual_seed(seed)
            try:
                sets = list(extra())
            except BaseException as exc:
                raise _Failure(
                    "task_error", f"get_extra_inputs() raised {_describe(exc)}", _tb()
                ) from exc
            return [("get_extra_inputs()", list(sets[variant]))] if variant < len(sets) else []
        from kf.evaluation.variants import derived_shapes

        return derived_shapes(torch, self.task_module, self._get_inputs, seed, variant)

    def op_make_inputs(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._op_make_inputs(msg)
        finally:
            self._trim_device_cache()

    def _device_memory(self) -> dict[str, int]:
        """The device's free and total bytes now (CUDA), for the grader's admission."""
        if self.backend.name != "cuda":
            return {}
        free, total = self.torch.cuda.mem_get_info()
        return {"device_free_bytes": int(free), "device_total_bytes": int(total)}

    def _op_make_inputs(self, msg: dict[str, Any]) -> dict[str, Any]:
        seed = int(msg["seed"])
        variant = msg.get("variant")
        scale = None if msg.get("scale") is None else float(msg["scale"])
        key = (self.model_seed, seed, None if variant is None else int(variant), scale)
        made = self.made.get(key)
        reused = made is not None
        if made is None:
            made = self._make_inputs(seed, variant, scale)
            self._remember(key, made)
        else:
            self.made.move_to_end(key)
        if made.pristine is None:
            return {**made.reply, "reused": reused}
        made.reply.update(self._device_memory())
        self._inputs, self._inputs_from = None, made.pristine
        # a check follows its own trial's inputs; keeping every trial's inputs and outputs
        # would hold tens of GB at KernelBench's sizes
        self.trials.pop(seed, None)
        self.trials[seed] = (made.pristine, made.expected)
        self.trial_variant[seed] = None if variant is None else int(variant)
        self.trial_scale[seed] = scale
        while len(self.trials) > 1 and (
            len(self.trials) > _TRIALS_KEPT
            or sum(map(self._nbytes, self.trials.values())) > max(self.made_budget, 1 << 30)
        ):
            del self.trials[next(iter(self.trials))]
        if msg.get("send") is False:  # the candidate runner makes its own (own_inputs)
            return {**made.reply, "reused": reused, "inputs": None}
        return {**made.reply, "reused": reused, "inputs": self._dump_inputs(made.pristine)}

    def _nbytes(self, trial: tuple[list[Any], list[Any]]) -> int:
        torch = self.torch
        return sum(
            v.numel() * v.element_size()
            for v in (*trial[0], *trial[1])
            if isinstance(v, torch.Tensor)
        )

    def _remember(self, key: tuple[int, int, int | None, float | None], made: _Made) -> None:
        """Keep what was made for later candidates, within ``made_budget`` bytes."""
        if made.nbytes > self.made_budget:
            return
        self.made[key] = made
        while sum(m.nbytes for m in self.made.values()) > self.made_budget:
            self.made.popitem(last=False)

    def _make_inputs(
        self,
        seed: int,
        variant: Any,
        scale: float | None = None,
        options: list[tuple[str, list[Any]]] | None = None,
    ) -> _Made:
        torch = self.torch
        if scale is not None:  # a hidden input distribution (kf.evaluation.variants)
            return self._scaled_inputs(seed, scale)
        if options is not None:
            pass
        elif variant is None:
            options = [("", self._get_inputs(seed))]
        else:
            options = self._variant_candidates(seed, int(variant))
        out: Any = None
        raw: list[Any] = []
        how = ""
        for label, option in options:
            how, raw = label, option
            if variant is None:
                out = True  # the one option: the timed call below says whether it works
                break
            try:
                with torch.no_grad():
                    out = self.model(*self.clone([self.backend.to_device(v) for v in raw]))
                break
            except BaseException:
                out = None
        out = out is not None
        if variant is not None and not out:
            return _Made(
                {"inputs": None, "variant": "the task has no other input shapes kf could derive"}
            )
        # the inputs as made, kept; the reference's forward gets a copy it may write to (one
        # copy, not two: at KernelBench's sizes each is a 6.4 GB tensor on the device)
        inputs = pristine = [self.backend.to_device(v) for v in raw]
        given = self.clone(pristine)
        start = self.clock_ns()
        try:
            with torch.no_grad():
                out = self.model(*given)
        except BaseException as exc:
            raise _Failure("task_error", f"Model.forward raised {_describe(exc)}", _tb()) from exc
        self.backend.synchronize()
        eager_ms = (self.clock_ns() - start) / 1e6
        outs = _flatten(torch, out, "Model.forward", "task_error")
        del out
        # the reference's own outputs; one that shares storage with what it was given (a
        # view or an in-place op) keeps that copy alive, and none can alias the kept inputs
        expected = [
            o.detach().clone() if any(_aliases(torch, o, v) for v in pristine) else o.detach()
            for o in outs
        ]
        del given
        reply = {
            "input_shapes": [list(v.shape) if isinstance(v, torch.Tensor) else [] for v in inputs],
            "input_dtypes": [
                str(v.dtype).removeprefix("torch.")
                if isinstance(v, torch.Tensor)
                else type(v).__name__
                for v in inputs
            ],
            "output_shapes": [list(o.shape) for o in outs],
            "output_dtypes": [str(o.dtype).removeprefix("torch.") for o in outs],
            "eager_ms": eager_ms,
            "variant": (
                f"{how}: input shapes "
                f"{[list(v.shape) for v in inputs if isinstance(v, torch.Tensor)]}"
                if variant is not None
                else ""
            ),
        }
        nbytes = sum(
            v.numel() * v.element_size()
            for v in (*pristine, *expected)
            if isinstance(v, torch.Tensor)
        )
        return _Made(reply, pristine, expected, nbytes)

    def _scaled_inputs(self, seed: int, scale: float) -> _Made:
        """The task's inputs for ``seed`` with floating-point tensors scaled: none when
        there are none, or when the reference rejects them."""
        from kf.evaluation.variants import scale_inputs

        raw = scale_inputs(self.torch, self._get_inputs(seed), scale)
        if raw is None:
            return _Made({"inputs": None, "variant": "the task has no floating-point inputs"})
        made = self._make_inputs(seed, 0, options=[(f"inputs ×{scale:g}", raw)])
        if made.pristine is None:
            return _Made({"inputs": None, "variant": f"the reference rejects inputs ×{scale:g}"})
        return made

    def op_load_candidate(self, msg: dict[str, Any]) -> dict[str, Any]:
        from kf.native import NativeCompileError
        from kf.tasks import import_source

        seed = int(msg["seed"])
        if msg.get("init") is not None:
            init = list(self.load(msg["init"]))
            if self.own_inputs:  # the task's get_inputs, imported before any candidate code
                self._import_task(msg["task_source"], msg["task_name"])
        else:
            init = self._init_inputs(self._import_task(msg["task_source"], msg["task_name"]), seed)
        self.watch.active = True  # from here on, this process runs candidate code
        try:
            module = import_source("kf_candidate", msg["source"], filename="<candidate>")
        except NativeCompileError as exc:
            raise _Failure("compile_error", _compile_failure(exc), exc.log) from exc
        except BaseException as exc:
            raise _Failure(
                "exception", f"importing the candidate raised {_describe(exc)}", _tb()
            ) from exc
        cls = getattr(module, "ModelNew", None)
        if cls is None:
            raise _Failure("exception", "the candidate defines no class ModelNew")
        if not callable(cls):
            raise _Failure("exception", "ModelNew is not callable")
        self.torch.manual_seed(seed)
        try:
            model = cls(*init)
        except NativeCompileError as exc:
            raise _Failure("compile_error", _compile_failure(exc), exc.log) from exc
        except BaseException as exc:
            raise _Failure(
                "exception", f"ModelNew(*get_init_inputs()) raised {_describe(exc)}", _tb()
            ) from exc
        self.model = self.backend.to_device(model)
        return {}

    def _seeded(
        self, seed: int, scale: float | None = None, *, check: bool = True
    ) -> tuple[list[Any], list[Any]]:
        """The trial inputs for ``seed`` (scaled by ``scale``, a hidden distribution) made
        here, as the reference makes them: on the device, and a host copy to check them
        against after the call."""
        raw = self._get_inputs(seed)
        if scale is not None:
            from kf.evaluation.variants import scale_inputs

            raw = scale_inputs(self.torch, raw, scale) or raw
        tensor = self.torch.Tensor
        pristine = (
            [v.detach().cpu().clone() if isinstance(v, tensor) else v for v in raw] if check else []
        )
        return [self.backend.to_device(v) for v in raw], pristine

    def op_run(self, msg: dict[str, Any]) -> dict[str, Any]:
        from kf.evaluation.compare import compare_inputs

        torch = self.torch
        t0 = self.clock_ns()
        pristine: list[Any] | None = None
        if msg.get("inputs") is None and msg.get("seed") is not None and self.own_inputs:
            scale = None if msg.get("scale") is None else float(msg["scale"])
            self.inputs, pristine = self._seeded(int(msg["seed"]), scale)
        else:
            self.inputs = [self.backend.to_device(v) for v in self.load(msg["inputs"])]
        t1 = self.clock_ns()
        recorder = _OpRecorder(torch) if msg.get("trace") else None
        try:
            with torch.no_grad():
                if recorder is not None:
                    with recorder:
                        out = self.model(*self.inputs)
                else:
                    out = self.model(*self.inputs)
            self.backend.synchronize()
        except BaseException as exc:
            raise _Failure("exception", f"ModelNew.forward raised {_describe(exc)}", _tb()) from exc
        t2 = self.clock_ns()
        outs = _flatten(torch, out, "ModelNew.forward", "exception")
        ops = [] if recorder is None else [op for op in recorder.ops if op not in _DATA_OPS]
        outputs = self.dump(outs)
        if pristine is None:
            inputs_after: Any = self.dump(self.inputs)
            problem = None
        else:  # checked here; this process's word, as inputs_after bytes would be
            inputs_after = None
            problem = compare_inputs(torch, pristine, self.inputs)
        return {
            "torch_ops": ops,
            "outputs": outputs,
            "inputs_after": inputs_after,
            "inputs_problem": problem,
            # where the request's time went, for the grader's request log
            "phases_ns": {"inputs": t1 - t0, "forward": t2 - t1, "outputs": self.clock_ns() - t2},
        }

    def op_trim(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Between stages: drop the trials' tensors and the last inputs when they are
        large (a reference runner stays alive for the task's next candidate, and idle
        runners holding 25 GB each ran a GPU out of memory), then return cached blocks."""
        limit = int(msg.get("keep_bytes", _TRIM_ABOVE_BYTES))
        held = sum(map(self._nbytes, self.trials.values())) + self._nbytes((self._inputs or [], []))
        dropped = 0
        if held > limit:
            self.trials.clear()
            self.inputs = []
            dropped = held
        self._trim_device_cache()
        return {"dropped_bytes": dropped}

    def op_audit(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Whether the reference's outputs depend on its inputs (kf.evaluation.audit)."""
        from kf.evaluation.audit import audit_reference

        return audit_reference(self, msg)

    def op_check(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"verdict": self._check(msg)}
        finally:
            self._trim_device_cache()

    def _trim_device_cache(self) -> None:
        """Give cached GPU blocks back once they are large: a reference runner's peak at
        KernelBench's sizes is several 6 GB tensors, and blocks its caching allocator keeps
        are memory the candidates' processes on the same GPU cannot have."""
        if self.backend.name != "cuda":
            return
        cuda = self.torch.cuda
        if cuda.memory_reserved() - cuda.memory_allocated() > _TRIM_ABOVE_BYTES:
            cuda.empty_cache()

    def _check(self, msg: dict[str, Any]) -> dict[str, Any]:
        from kf.evaluation.compare import compare_inputs, compare_outputs

        seed = int(msg["seed"])
        if seed not in self.trials:
            # evicted to bound memory: the inputs and outputs are a pure function of the seed
            made = self._make_inputs(seed, self.trial_variant.get(seed), self.trial_scale.get(seed))
            self.trials[seed] = (made.pristine or [], made.expected or [])
        pristine, expected = self.trials[seed]
        try:
            got = self.load(msg["outputs"])
            after = None if msg.get("inputs_after") is None else self.load(msg["inputs_after"])
        except Exception as exc:
            return {
                "ok": False,
                "kind": "exception",
                "reason": f"unreadable output: {_describe(exc)}",
            }
        verdict = compare_outputs(self.torch, expected, got, msg.get("tol"))
        if verdict["ok"]:
            if after is None:  # the candidate runner made and checked its own inputs
                problem = msg.get("inputs_problem")
            else:
                problem = compare_inputs(self.torch, pristine, after)
            if problem is not None:
                return {**verdict, "ok": False, "kind": "input_mutated", "reason": problem}
        return verdict

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

    def op_compile_baseline(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Compile the reference with ``torch.compile`` for the current inputs, once.

        Default mode, inductor, static shapes (what a first compile gives; no
        recompilation for other shapes turns them dynamic). The first call, which
        compiles, is timed; its output must pass the same check as a candidate's, or
        the compiled reference is not a baseline. A failure is an answer (``error``),
        not a failed request: the task is fine, only the baseline is missing.
        """
        mode = str(msg.get("mode") or "default")
        key = self._signature(self.inputs)
        known = self.compiled.get(key)
        if known is not None and known.reply.get("mode") == mode:
            self.compiled.move_to_end(key)
            return {**known.reply, "cached": True}
        if msg.get("cache_dir"):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(msg["cache_dir"])
        fn, reply = self._compile_reference(mode)
        self.compiled[key] = _Compiled(fn, reply)
        while len(self.compiled) > _MAX_COMPILED:
            self.compiled.popitem(last=False)
        return {**reply, "cached": False}

    def _compile_reference(self, mode: str = "default") -> tuple[Any, dict[str, Any]]:
        from kf.evaluation.compare import compare_outputs

        torch = self.torch
        described = describe_compile(mode, torch.__version__)
        fn: Any = None
        start = self.clock_ns()
        try:
            import torch._dynamo
            import torch._inductor.config

            if "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS" not in os.environ:
                # inductor keeps precompiled headers under the runner's scratch directory
                # whatever its cache directory is, so each fresh runner would rebuild them
                # (about 15 s on 2 cores) even when every kernel is in the cache
                torch._inductor.config.cpp_cache_precompile_headers = False
            graphs_before = _dynamo_graphs(torch)
            fn = torch.compile(self.model, **compile_kwargs(mode))
            with torch.no_grad():
                got = fn(*self.clone(self.inputs))
            self.backend.synchronize()
            compile_s = (self.clock_ns() - start) / 1e9
            with torch.no_grad():
                want = self.model(*self.clone(self.inputs))
            got_list = [got] if isinstance(got, torch.Tensor) else list(got)
            want_list = [want] if isinstance(want, torch.Tensor) else list(want)
            verdict = compare_outputs(torch, [w.detach() for w in want_list], got_list)
        except Exception as exc:  # any failure of torch.compile is the answer
            return None, {
                "baseline": described,
                "mode": mode,
                "compile_s": (self.clock_ns() - start) / 1e9,
                "error": f"torch.compile failed: {_describe(exc)}",
            }
        if not verdict["ok"]:
            return None, {
                "baseline": described,
                "mode": mode,
                "compile_s": compile_s,
                "error": f"torch.compile's output fails kf's check against eager: "
                f"{verdict['kind']}: {verdict['reason']}",
            }
        graphs = _dynamo_graphs(torch) - graphs_before
        return fn, {"baseline": described, "mode": mode, "compile_s": compile_s, "graphs": graphs}

    def op_time(self, msg: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        model, inputs, backend = self.model, self.inputs, self.backend
        if msg.get("compiled"):
            known = self.compiled.get(self._signature(inputs))
            if known is None or known.fn is None:
                raise _Failure("protocol", "no compiled reference for these inputs")
            model = known.fn
        elif msg.get("empty"):  # the timing loop's own cost: a call that does nothing
            model = _nothing
        samples: list[int] = []
        try:
            with torch.no_grad():
                for _ in range(int(msg["n"])):
                    backend.flush_cache()
                    samples.append(backend.time_call_ns(lambda: model(*inputs)))
        except BaseException as exc:
            raise _Failure(
                "exception", f"forward raised {_describe(exc)} while timing", _tb()
            ) from exc
        return {"samples_ns": samples}

    def op_time_inputs(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One timed call on each of several fresh input sets (a cache would miss here)."""
        torch = self.torch
        model, backend = self.model, self.backend
        if msg.get("seeds") is not None and self.own_inputs:
            sets = [self._seeded(int(s), check=False)[0] for s in msg["seeds"]]
        else:
            sets = [[backend.to_device(v) for v in self.load(data)] for data in msg["inputs"]]
        samples: list[int] = []
        repeated: list[int] = []  # with "paired": the last inputs, timed the same way after each
        try:
            with torch.no_grad():
                for inputs in sets:
                    for which, into in ((inputs, samples), (self.inputs, repeated)):
                        if into is repeated and not msg.get("paired"):
                            continue
                        # Read every input once so fresh data is as warm as repeated data.
                        for v in which:
                            if isinstance(v, torch.Tensor) and v.is_floating_point():
                                float(v.sum())
                        backend.flush_cache()
                        into.append(backend.time_call_ns(functools.partial(model, *which)))
        except BaseException as exc:
            raise _Failure(
                "exception", f"forward raised {_describe(exc)} on fresh inputs", _tb()
            ) from exc
        return {"samples_ns": samples, "repeated_ns": repeated}

    def op_counters(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One warm-up call, then one call between cudaProfilerStart and Stop (for ncu)."""
        torch = self.torch
        model, inputs, backend = self.model, self.inputs, self.backend
        try:
            with torch.no_grad():
                model(*inputs)
                backend.synchronize()
                torch.cuda.profiler.start()
                try:
                    model(*inputs)
                    backend.synchronize()
                finally:
                    torch.cuda.profiler.stop()
        except BaseException as exc:
            raise _Failure(
                "exception", f"forward raised {_describe(exc)} under the profiler", _tb()
            ) from exc
        return {}

    def op_batch(self, msg: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        model, inputs, backend = self.model, self.inputs, self.backend
        start = self.clock_ns()
        with torch.no_grad():
            for _ in range(int(msg["n"])):
                model(*inputs)
        backend.synchronize()
        return {"total_ns": self.clock_ns() - start}


def _remote_build(
    send: Callable[[bytes], None],
    recv: Callable[[], bytes],
    encode: Callable[[Any], bytes],
    decode: Callable[[bytes], Any],
    source: str,
    flags: list[str],
    defines: dict[str, str],
    timeout_s: float,
) -> str:
    """:data:`kf.native.remote_builder` in the box: ask the grader, which builds the
    library in a box of its own and answers with its path in the read-only shared cache
    (kf.evaluation.builds)."""
    from kf.native import NativeCompileError

    send(encode({"op": "build", "source": source, "flags": flags, "defines": defines,
                 "timeout_s": timeout_s}))  # fmt: skip
    reply = decode(recv())
    if not isinstance(reply, dict) or reply.get("op") != "built":
        raise RuntimeError("the grader did not answer the build request")
    if not reply.get("ok"):
        raise NativeCompileError(str(reply.get("error")), str(reply.get("log") or ""))
    return str(reply["path"])


def _compile_failure(exc: BaseException) -> str:
    """``C++ compilation failed``, with the first line of what said so (the compiler's
    summary, or the grader's reason for refusing a build)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"C++ compilation failed: {first}" if first else "C++ compilation failed"


def _remote_inline_build(
    send: Callable[[bytes], None],
    recv: Callable[[], bytes],
    encode: Callable[[Any], bytes],
    decode: Callable[[bytes], Any],
    arguments: dict[str, Any],
    environment: dict[str, Any],
) -> str:
    """:data:`kf.cuda.inline.remote_builder` in the box: the grader builds the
    ``load_inline`` extension in a build box and answers with its folder in the
    read-only shared cache (kf.evaluation.builds.build_inline)."""
    from kf.native import NativeCompileError

    send(encode({"op": "build", "kind": "cuda_inline", "arguments": arguments,
                 "environment": environment}))  # fmt: skip
    reply = decode(recv())
    if not isinstance(reply, dict) or reply.get("op") != "built":
        raise RuntimeError("the grader did not answer the build request")
    log = str(reply.get("log") or "")
    if log:  # the build's own report (kf.cuda.objcache verdicts) for the compile log
        sys.stderr.write(log if log.endswith("\n") else log + "\n")
        sys.stderr.flush()
    if not reply.get("ok"):
        raise NativeCompileError(str(reply.get("error")), log)
    return str(reply["path"])


def _warm(torch: Any, device: str) -> None:
    """Start-up work that a GPU stage would otherwise wait for (``$KF_RUNNER_WARM``).

    A pooled runner starts while earlier candidates are graded, so what it does before
    it says it is ready costs no stage any time: the CUDA context on ``device`` (about
    0.6 s on an H200), and the op tracer's first entry into a dispatch mode, which
    imports ``torch._dynamo`` (1.5 to 2 s). Nothing of a candidate exists yet. A failure
    is only logged: set-up reports it properly.
    """
    start = time.perf_counter()
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
            torch.empty(1, device=device)
        with _OpRecorder(torch):
            torch.zeros(1).add_(1)
    except Exception as exc:  # set-up raises the real error with its context
        print(f"kf runner: warm-up for {device} failed: {_describe(exc)}", flush=True)
    else:
        print(
            f"kf runner: warmed up for {device} in {time.perf_counter() - start:.2f}s", flush=True
        )


def _nothing(*_: Any) -> None:
    """What ``time`` calls with ``empty``: nothing, to measure the loop around a call."""


def _dynamo_graphs(torch: Any) -> int:
    """Graphs dynamo has compiled in this process so far (0 where torch does not say)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except (ImportError, AttributeError, KeyError, TypeError):
        return 0


def _tb() -> str:
    text = traceback.format_exc()
    return text[-_MAX_LOG:]


def _flatten(torch: Any, out: Any, what: str, kind: str) -> list[Any]:
    items = [out] if isinstance(out, torch.Tensor) else out
    if not isinstance(items, list | tuple):
        raise _Failure(
            kind, f"{what} returned {type(out).__name__}, not a tensor or a tuple of tensors"
        )
    for item in items:
        if type(item) not in (torch.Tensor, torch.nn.Parameter):
            raise _Failure(
                kind, f"{what} returned a {type(item).__name__}, not a plain torch.Tensor"
            )
    return list(items)


def main(argv: list[str]) -> int:
    clock_ns = time.perf_counter_ns  # bound before any candidate code is imported
    watch = _Watch()
    sys.addaudithook(watch.hook)  # cannot be removed; inert until a candidate is loaded
    import faulthandler
    from multiprocessing.connection import Connection

    from kf.evaluation.protocol import decode, encode

    faulthandler.enable()  # a crashing candidate leaves a Python traceback in the log
    fd, parent_pid = int(argv[0]), int(argv[1])
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    conn = Connection(fd)
    # bound before any candidate code runs: the socket's bytes, and the descriptors of
    # shared-memory payloads beside them (kf.evaluation.shared_memory)
    send, recv, poll = conn.send_bytes, conn.recv_bytes, conn.poll
    fd_sock = socket.socket(fileno=os.dup(fd))
    watch.grading = fd_sock
    send_fds = functools.partial(shared_memory.send_fds, fd_sock)
    receive_fds = functools.partial(shared_memory.receive_fds, fd_sock)
    detach, attach = shared_memory.detach, shared_memory.attach
    if os.environ.get("KF_BUILD_SERVICE") == "1":  # in the box: the grader builds
        import kf.native

        kf.native.remote_builder = functools.partial(_remote_build, send, recv, encode, decode)
        import kf.cuda.inline

        kf.cuda.inline.remote_builder = functools.partial(
            _remote_inline_build, send, recv, encode, decode
        )
    runner = Runner(clock_ns, watch)
    if os.environ.get("KF_RUNNER_WARM"):
        _warm(runner.torch, os.environ["KF_RUNNER_WARM"])
    send(encode({"op": "ready", "pid": os.getpid(), "torch": str(runner.torch.__version__)}))
    guard: _Integrity | None = None
    while True:
        try:
            msg = decode(recv())
        except EOFError:
            return 0
        if "_fds" in msg:  # payloads in memory files: their descriptors follow
            msg = attach(msg, receive_fds(msg["_fds"], poll, 60.0))
        op = msg.get("op")
        if op == "exit":
            return 0
        if op == "load_candidate" and guard is None:
            # before any candidate code runs
            bound = (send, recv, poll, send_fds, receive_fds, detach, attach)
            guard = _Integrity(runner, clock_ns, *bound)
        handler = getattr(runner, f"op_{op}", None)
        began = clock_ns()
        try:
            if handler is None:
                raise _Failure("protocol", f"unknown op {op!r}")
            reply = {"ok": True, **handler(msg)}
        except _Failure as failure:
            reply = {"ok": False, "kind": failure.kind, "error": failure.error, "log": failure.log}
        except BaseException as exc:
            reply = {"ok": False, "kind": "exception", "error": _describe(exc), "log": _tb()}
        if guard is not None:
            tampered = guard.check(runner, clock_ns)
            if tampered:
                reply = {
                    "ok": False,
                    "kind": "tampering",
                    "error": f"the candidate altered the runner that grades it: {tampered}",
                    "log": "",
                }
        reply["id"] = msg.get("id")
        reply["took_ns"] = clock_ns() - began  # the handler's time, for the grader's request log
        reply["findings"] = watch.drain()
        sys.stdout.flush()
        wire, fds = detach(reply)
        send(encode(wire))
        send_fds(fds)
        del wire, reply


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
