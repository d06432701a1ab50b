"""The candidate role: the candidate's ModelNew is loaded and run, its outputs sent for
judging; builds it asks for go to the grader (``$KF_BUILD_SERVICE`` in the box).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from kf.evaluation.runner import common as runner_common
from kf.evaluation.runner.common import (
    RequestFailure,
    RunnerBase,
    describe_exception,
    flatten_outputs,
    traceback_tail,
)
from kf.evaluation.runner.guard import DATA_OPS, OpRecorder
from kf.evaluation.wire import protocol as p


class CandidateRole(RunnerBase):
    """Request handlers of a candidate runner (the candidate's ModelNew)."""

    def op_load_candidate(self, msg: p.LoadCandidate) -> p.CandidateLoaded:
        from kf.kernels.tasks import import_source
        from kf.native import NativeCompileError

        seed = msg.seed
        self.task_text = (msg.task_source, msg.task_name)  # for the user tests
        if msg.init is not None:
            init = list(self.load(msg.init))
            if self.own_inputs:  # the task's get_inputs, imported before any candidate code
                self._import_task(msg.task_source, msg.task_name)
        else:
            init = self._init_inputs(self._import_task(msg.task_source, msg.task_name), seed)
        self.watch.active = True  # from here on, this process runs candidate code
        try:
            module = import_source("kf_candidate", msg.source, filename="<candidate>")
        except NativeCompileError as exc:
            raise RequestFailure("compile_error", _compile_failure(exc), exc.log) from exc
        except BaseException as exc:
            raise RequestFailure(
                "exception",
                f"importing the candidate raised {describe_exception(exc)}",
                traceback_tail(),
            ) from exc
        self.candidate_module, self.init_inputs = module, init
        cls = getattr(module, "ModelNew", None)
        if cls is None:
            raise RequestFailure("exception", "the candidate defines no class ModelNew")
        if not callable(cls):
            raise RequestFailure("exception", "ModelNew is not callable")
        self.torch.manual_seed(seed)
        try:
            model = cls(*init)
        except NativeCompileError as exc:
            raise RequestFailure("compile_error", _compile_failure(exc), exc.log) from exc
        except BaseException as exc:
            raise RequestFailure(
                "exception",
                f"ModelNew(*get_init_inputs()) raised {describe_exception(exc)}",
                traceback_tail(),
            ) from exc
        self.model = self.backend.to_device(model)
        return p.CandidateLoaded()

    def op_run(self, msg: p.Run) -> p.Ran:
        from kf.evaluation.runner.compare import checkable, compare_inputs, is_large

        torch = self.torch
        t0 = self.clock_ns()
        pristine: list[Any] | None = None
        self.inputs = []  # the last trial's let go before this one's are made (GBs each),
        self._trim_device_cache()  # and their blocks given back: the next set may differ in size
        if msg.inputs is None and msg.seed is not None and self.own_inputs:
            self.inputs, pristine = self._seeded(msg.seed, msg.scale)
        elif msg.inputs is None:
            raise RequestFailure(
                "protocol", "a run request with no inputs and no seed to make them"
            )
        else:
            self.inputs = [self.backend.to_device(v) for v in self.load(msg.inputs)]
            above = runner_common.FINGERPRINT_ABOVE
            if any(is_large(torch, v, above) for v in self.inputs):
                # checked here against checksums, as inputs made here are: sending a gate
                # variant's 12.9 GB back for the reference to compare would hold it twice
                pristine = checkable(torch, self.inputs, above)
        t1 = self.clock_ns()
        recorder = OpRecorder(torch) if msg.trace else None
        try:
            with torch.no_grad():
                if recorder is not None:
                    with recorder:
                        out = self.model(*self.inputs)
                else:
                    out = self.model(*self.inputs)
            self.backend.synchronize()
        except BaseException as exc:
            raise RequestFailure(
                "exception", f"ModelNew.forward raised {describe_exception(exc)}", traceback_tail()
            ) from exc
        t2 = self.clock_ns()
        outs = flatten_outputs(torch, out, "ModelNew.forward", "exception")
        ops = [] if recorder is None else [op for op in recorder.ops if op not in DATA_OPS]
        outputs = self.dump(outs)
        del out, outs
        if pristine is None:
            inputs_after: Any = self.dump(self.inputs)
            problem = None
        else:  # checked here; this process's word, as inputs_after bytes would be
            inputs_after = None
            problem = compare_inputs(torch, pristine, self.inputs)
        del pristine
        self._trim_device_cache()
        return p.Ran(
            torch_ops=ops,
            outputs=outputs,
            inputs_after=inputs_after,
            inputs_problem=problem,
            phases_ns={"inputs": t1 - t0, "forward": t2 - t1, "outputs": self.clock_ns() - t2},
        )

    def op_user_tests(self, msg: p.UserTests) -> p.UserTestsRan:
        """A package's user tests against the loaded candidate (:mod:`~kf.evaluation.
        runner.user_tests`); the reference they get is built here from the same seed."""
        from kf.evaluation.runner.user_tests import run_tests

        torch, seed, to_device = self.torch, msg.seed, self.backend.to_device
        task = self.task_module or self._import_task(*self.task_text)

        def reference() -> Any:
            torch.manual_seed(seed)
            return to_device(task.Model(*self.init_inputs))

        fixtures = {
            "candidate": lambda: self.model,
            "reference": reference,
            "inputs": lambda: [to_device(v) for v in self._get_inputs(seed)],
            "module": lambda: self.candidate_module,
            "task": lambda: task,
            "device": lambda: self.backend.device,
            "torch": lambda: torch,
        }
        passed, failed, message = run_tests(msg.tests, fixtures)
        return p.UserTestsRan(passed=passed, failed=failed, message=message)

    def op_counters(self, msg: p.Counters) -> p.CountersRan:
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
            raise RequestFailure(
                "exception",
                f"forward raised {describe_exception(exc)} under the profiler",
                traceback_tail(),
            ) from exc
        return p.CountersRan()

    def op_batch(self, msg: p.Batch) -> p.BatchRan:
        torch = self.torch
        model, inputs, backend = self.model, self.inputs, self.backend
        start = self.clock_ns()
        with torch.no_grad():
            for _ in range(msg.n):
                model(*inputs)
        backend.synchronize()
        return p.BatchRan(total_ns=self.clock_ns() - start)


def remote_build(
    send: Callable[[bytes], None],
    recv: Callable[[], bytes],
    encode: Callable[[p.Message], bytes],
    decode: Callable[[bytes], p.Message],
    source: str,
    flags: list[str],
    defines: dict[str, str],
    timeout_s: float,
) -> str:
    """:data:`kf.native.remote_builder` in the box: ask the grader, which builds the
    library in a box of its own and answers with its path in the read-only shared cache
    (kf.evaluation.grader.builds)."""
    from kf.native import NativeCompileError

    send(encode(p.BuildNative(source=source, flags=flags, defines=defines, timeout_s=timeout_s)))
    reply = _built(decode(recv()))
    if not reply.ok:
        raise NativeCompileError(reply.error, reply.log)
    return reply.path


def _built(reply: p.Message) -> p.Built:
    """The grader's answer to a build request (it sends nothing else meanwhile)."""
    if not isinstance(reply, p.Built):
        raise RuntimeError(f"the grader answered the build request with {reply.op!r}")
    return reply


def _compile_failure(exc: BaseException) -> str:
    """``C++ compilation failed``, with the first line of what said so (the compiler's
    summary, or the grader's reason for refusing a build)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"C++ compilation failed: {first}" if first else "C++ compilation failed"


def remote_inline_build(
    send: Callable[[bytes], None],
    recv: Callable[[], bytes],
    encode: Callable[[p.Message], bytes],
    decode: Callable[[bytes], p.Message],
    arguments: dict[str, Any],
    environment: dict[str, Any],
) -> str:
    """:data:`kf.cuda.inline.remote_builder` in the box: the grader builds the
    ``load_inline`` extension in a build box and answers with its folder in the
    read-only shared cache (kf.evaluation.grader.builds.build_inline)."""
    from kf.native import NativeCompileError

    request = p.BuildInline(arguments=arguments, environment=environment)
    if p.nesting_problem(request):  # the grader would take it for a forged message
        raise NativeCompileError(
            f"load_inline: its arguments nest more than {p.MAX_NESTING} levels deep; give "
            "sources and flags as strings or lists of strings",
            "",
        )
    send(encode(request))
    reply = _built(decode(recv()))
    log = reply.log
    if log:  # the build's own report (kf.cuda.objcache verdicts) for the compile log
        sys.stderr.write(log if log.endswith("\n") else log + "\n")
        sys.stderr.flush()
    if not reply.ok:
        raise NativeCompileError(reply.error, log)
    return reply.path
