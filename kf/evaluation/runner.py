"""The sandboxed runner process: ``python -m kf.evaluation.runner FD PARENT_PID``.

It binds its clock, imports torch, says it is ready and then serves requests from the
grader on the socket ``FD``. One runner serves one candidate (or one task reference)
and is then discarded. Candidate code runs here, so the clock is bound in :func:`main`
before anything else is imported, and is never stored where the candidate can reach
it by name.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

_MAX_ERROR = 2000
_MAX_LOG = 20_000


def _watch_parent(parent_pid: int) -> None:
    """Exit when the grader goes away, so a runner is never left behind."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(70)
        time.sleep(0.5)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR] + " …"


class _Failure(Exception):
    """A request failed in a way the grader should see with a given kind."""

    def __init__(self, kind: str, error: str, log: str = "") -> None:
        super().__init__(error)
        self.kind = kind
        self.error = error
        self.log = log


class Runner:
    """Request handlers; ``self.model`` is either the task's Model or the candidate's ModelNew."""

    def __init__(self, clock_ns: Callable[[], int]) -> None:
        import torch

        from kf.evaluation.device import Backend, make_backend

        self.torch = torch
        self.clock_ns = clock_ns
        self.backend: Backend = make_backend("cpu", clock_ns)
        self.model: Any = None
        self.task_module: Any = None
        self.inputs: list[Any] = []
        self.trials: dict[int, tuple[list[Any], list[Any]]] = {}

    # -- serialisation -------------------------------------------------------------
    def dump(self, value: Any) -> bytes:
        buf = io.BytesIO()
        self.torch.save(value, buf)
        return buf.getvalue()

    def load(self, data: bytes) -> Any:
        return self.torch.load(io.BytesIO(data), weights_only=True)

    def clone(self, values: list[Any]) -> list[Any]:
        return [v.detach().clone() if isinstance(v, self.torch.Tensor) else v for v in values]

    # -- handlers ------------------------------------------------------------------
    def op_ping(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {}

    def op_setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        import resource

        from kf.evaluation.device import make_backend

        self.backend = make_backend(msg["device"], self.clock_ns)
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
        return {"threads": self.torch.get_num_threads()}

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

    def op_make_inputs(self, msg: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        seed = int(msg["seed"])
        torch.manual_seed(seed)
        try:
            raw = self.task_module.get_inputs()
        except BaseException as exc:
            raise _Failure("task_error", f"get_inputs() raised {_describe(exc)}", _tb()) from exc
        if not isinstance(raw, list | tuple):
            raise _Failure("task_error", f"get_inputs() returned {type(raw).__name__}, not a list")
        inputs = [self.backend.to_device(v) for v in raw]
        pristine = self.clone(inputs)
        self.inputs = self.clone(inputs)
        start = self.clock_ns()
        try:
            with torch.no_grad():
                out = self.model(*self.clone(inputs))
        except BaseException as exc:
            raise _Failure("task_error", f"Model.forward raised {_describe(exc)}", _tb()) from exc
        self.backend.synchronize()
        eager_ms = (self.clock_ns() - start) / 1e6
        outs = _flatten(torch, out, "Model.forward", "task_error")
        self.trials[seed] = (pristine, [o.detach().clone() for o in outs])
        return {
            "inputs": self.dump(inputs),
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
        }

    def op_load_candidate(self, msg: dict[str, Any]) -> dict[str, Any]:
        from kf.native import NativeCompileError
        from kf.tasks import import_source

        seed = int(msg["seed"])
        if msg.get("init") is not None:
            init = list(self.load(msg["init"]))
        else:
            init = self._init_inputs(self._import_task(msg["task_source"], msg["task_name"]), seed)
        try:
            module = import_source("kf_candidate", msg["source"], filename="<candidate>")
        except NativeCompileError as exc:
            raise _Failure("compile_error", "C++ compilation failed", exc.log) from exc
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
            raise _Failure("compile_error", "C++ compilation failed", exc.log) from exc
        except BaseException as exc:
            raise _Failure(
                "exception", f"ModelNew(*get_init_inputs()) raised {_describe(exc)}", _tb()
            ) from exc
        self.model = self.backend.to_device(model)
        return {}

    def op_run(self, msg: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        self.inputs = [self.backend.to_device(v) for v in self.load(msg["inputs"])]
        try:
            with torch.no_grad():
                out = self.model(*self.inputs)
            self.backend.synchronize()
        except BaseException as exc:
            raise _Failure("exception", f"ModelNew.forward raised {_describe(exc)}", _tb()) from exc
        outs = _flatten(torch, out, "ModelNew.forward", "exception")
        return {
            "outputs": self.dump([o.detach().cpu().clone() for o in outs]),
            "inputs_after": self.dump(
                [
                    v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                    for v in self.inputs
                ]
            ),
        }

    def op_check(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"verdict": self._check(msg)}

    def _check(self, msg: dict[str, Any]) -> dict[str, Any]:
        from kf.evaluation.compare import compare_inputs, compare_outputs

        pristine, expected = self.trials[int(msg["seed"])]
        try:
            got = self.load(msg["outputs"])
            after = self.load(msg["inputs_after"])
        except Exception as exc:
            return {
                "ok": False,
                "kind": "exception",
                "reason": f"unreadable output: {_describe(exc)}",
            }
        verdict = compare_outputs(self.torch, expected, got)
        if verdict["ok"]:
            problem = compare_inputs(self.torch, pristine, after)
            if problem is not None:
                return {**verdict, "ok": False, "kind": "input_mutated", "reason": problem}
        return verdict

    def op_time(self, msg: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        model, inputs, backend = self.model, self.inputs, self.backend
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

    def op_batch(self, msg: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        model, inputs, backend = self.model, self.inputs, self.backend
        start = self.clock_ns()
        with torch.no_grad():
            for _ in range(int(msg["n"])):
                model(*inputs)
        backend.synchronize()
        return {"total_ns": self.clock_ns() - start}


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
    import faulthandler
    from multiprocessing.connection import Connection

    from kf.evaluation.protocol import decode, encode

    faulthandler.enable()  # a crashing candidate leaves a Python traceback in the log
    fd, parent_pid = int(argv[0]), int(argv[1])
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    conn = Connection(fd)
    runner = Runner(clock_ns)
    conn.send_bytes(
        encode({"op": "ready", "pid": os.getpid(), "torch": str(runner.torch.__version__)})
    )
    while True:
        try:
            msg = decode(conn.recv_bytes())
        except EOFError:
            return 0
        op = msg.get("op")
        if op == "exit":
            return 0
        handler = getattr(runner, f"op_{op}", None)
        try:
            if handler is None:
                raise _Failure("protocol", f"unknown op {op!r}")
            reply = {"ok": True, **handler(msg)}
        except _Failure as failure:
            reply = {"ok": False, "kind": failure.kind, "error": failure.error, "log": failure.log}
        except BaseException as exc:
            reply = {"ok": False, "kind": "exception", "error": _describe(exc), "log": _tb()}
        sys.stdout.flush()
        conn.send_bytes(encode(reply))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
