"""The runner's guard: the audit hook that blocks the network and notes introspection
once a candidate is loaded, the integrity snapshot of the grading code, and the op
recorder for the call-graph check.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kf.evaluation.wire import shared_memory

if TYPE_CHECKING:
    from kf.evaluation.runner.common import RunnerBase

#: the modules holding the runner's grading code (the request loop and its roles;
#: ``__main__`` is ``python -m kf.evaluation.runner``'s, which names ``Runner`` too)
RUNNER_MODULES = (
    "kf.evaluation.runner.loop",
    "__main__",
    "kf.evaluation.runner.common",
    "kf.evaluation.runner.guard",
    "kf.evaluation.runner.reference",
    "kf.evaluation.runner.candidate",
    "kf.evaluation.runner.device_state",
    "kf.evaluation.runner.graph_timing",
)

#: the timing backend's helper objects whose callables the guard checks with its own
#: (kf.evaluation.runner.device: the persisting-L2 reset, the CUDA-graph tools)
HELPERS = ("state", "_graphs")

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
DATA_OPS = frozenset(
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


class Watch:
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


class Integrity:
    """What the runner's grading code looked like before the candidate was imported."""

    def __init__(self, runner: RunnerBase, clock_ns: Callable[[], int], *bound: Any) -> None:
        self.snapshot = self._take(runner)
        self.attrs = set(vars(runner))
        self.backend = runner.backend
        self.backend_attrs = self._callables(runner.backend)
        self.clock_ns = clock_ns
        self.bound = bound

    @staticmethod
    def _callables(obj: Any) -> dict[str, int]:
        """The backend's bound callables, and its helpers' (the device-state reset and
        the graph tools: ``HELPERS``), by name."""
        out = {k: id(v) for k, v in vars(obj).items() if callable(v)}
        for name in HELPERS:
            helper = vars(obj).get(name)
            if helper is not None:
                out[f"{name}:"] = id(helper)
                out.update({f"{name}.{k}": id(v) for k, v in vars(helper).items() if callable(v)})
        return out

    @staticmethod
    def _take(runner: RunnerBase) -> dict[str, tuple[Any, Any]]:
        from kf.evaluation.runner import compare, device, transport
        from kf.evaluation.wire import protocol

        snap: dict[str, tuple[Any, Any]] = {}
        # every module of the runner's grading code, whichever of its files a name is in
        owners: list[Any] = [compare, device, protocol, transport, shared_memory]
        owners += [sys.modules[m] for m in RUNNER_MODULES if m in sys.modules]
        owners += [c for c in type(runner).__mro__ if c is not object]
        owners += [c for c in type(runner.backend).__mro__ if c is not object]
        helpers = [vars(runner.backend).get(name) for name in HELPERS]
        owners += [type(h) for h in helpers if h is not None]
        for owner in owners:
            snap.update(_functions(owner))
        # and each method as the runner resolves it: a method set on the runner's class
        # (``Runner.op_run = ...``) shadows its role's without changing that role's class
        cls = type(runner)
        for name in dir(cls):
            value = inspect.getattr_static(cls, name)
            code = getattr(value, "__code__", None)
            if code is not None:
                snap[f"{cls.__name__}.{name}"] = (value, code)
        torch = runner.torch
        for name in ("save", "load"):
            fn = getattr(torch, name)
            snap[f"torch.{name}"] = (fn, getattr(fn, "__code__", None))
        return snap

    def check(self, runner: RunnerBase, clock_ns: Callable[[], int]) -> str | None:
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


class OpRecorder:
    """Records the aten ops a call dispatches (a TorchDispatchMode built lazily).

    PyTorch wraps every dispatch mode's ``__torch_dispatch__`` so that dynamo never
    traces into it, and that wrapper imports ``torch._dynamo`` on its first call: 1 to 2
    CPU-seconds in every runner that traces a call (each verification's candidate runner),
    though only a process that has imported dynamo can trace anything. The recorder keeps
    PyTorch's protection from the moment dynamo exists in the process (the candidate
    imported it, or ``torch.compile``) and skips the import before (:func:`_dynamo_safe`).
    """

    def __new__(cls, torch: Any) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                return False  # _dynamo_safe below does what PyTorch's wrapper would

            def __init__(self) -> None:
                super().__init__()  # type: ignore[no-untyped-call]
                self.ops: dict[str, None] = {}

            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                self.ops[str(func.overloadpacket.__name__)] = None
                return func(*args, **(kwargs or {}))

        Recorder.__torch_dispatch__ = _dynamo_safe(torch, Recorder.__torch_dispatch__)  # type: ignore[method-assign]
        return Recorder()


def _dynamo_safe(torch: Any, raw: Callable[..., Any]) -> Callable[..., Any]:
    """``raw`` as PyTorch's ``TorchDispatchMode`` makes it (``torch._disable_dynamo``:
    dynamo skips it and everything it calls) whenever ``torch._dynamo`` is in the
    process; called as it is while it is not, when no frame can be traced (dynamo's
    frame evaluation is set only by ``torch._dynamo``), so the import is not paid."""
    disabled = torch._disable_dynamo(raw, recursive=True)
    modules = sys.modules

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if getattr(modules.get("torch._dynamo"), "disable", None) is not None:
            return disabled(*args, **kwargs)
        return raw(*args, **kwargs)

    return dispatch
