"""The reference role: the task's Model makes each trial's inputs and expected outputs
and judges the candidate's outputs; it also audits the task and compiles the reference
under ``torch.compile``. No candidate code ever runs in a reference runner.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import msgspec

from kf.evaluation.runner import common as runner_common
from kf.evaluation.runner.baselines import compile_kwargs, describe_compile
from kf.evaluation.runner.common import (
    MAX_COMPILED,
    TRIALS_KEPT,
    Compiled,
    Made,
    RequestFailure,
    RunnerBase,
    describe_exception,
    dynamo_graphs,
    flatten_outputs,
    traceback_tail,
)
from kf.evaluation.wire import protocol as p

#: the largest share of a reference runner's cache budget one kept set may take
CACHED_SET_SHARE = 1 / 8


class _WroteItsInputs(Exception):
    """The reference's forward changed an input it was called on in place of a copy."""


class ReferenceRole(RunnerBase):
    """Request handlers of a reference runner (the task's Model)."""

    #: whether the reference's forward is given copies of its large inputs too: set once
    #: it is seen to write to one (:meth:`_given`)
    forward_on_copies = False

    def op_load_task(self, msg: p.LoadTask) -> p.TaskLoaded:
        module = self._import_task(msg.source, msg.name)
        if msg.tests:  # a package's user tests must import (they run in candidate runners)
            from kf.evaluation.runner.user_tests import import_tests

            import_tests(msg.tests)
        seed = msg.seed
        self.model_seed = seed  # the model's parameters: part of what made inputs are keyed by
        init = self._init_inputs(module, seed)
        self.torch.manual_seed(seed)
        try:
            model = module.Model(*init)
        except BaseException as exc:
            raise RequestFailure(
                "task_error",
                f"Model(*get_init_inputs()) raised {describe_exception(exc)}",
                traceback_tail(),
            ) from exc
        self.model = self.backend.to_device(model)
        return p.TaskLoaded(init=self.dump(init))

    def _variant_candidates(self, seed: int, variant: int) -> Iterable[tuple[str, list[Any]]]:
        """Input sets for generalisation variant ``variant``, most preferred first.

        The task's own ``get_extra_inputs()`` when it defines one; otherwise shapes the
        task can make itself (:func:`kf.evaluation.runner.variants.derived_shapes`).
        """
        torch = self.torch
        extra = getattr(self.task_module, "get_extra_inputs", None)
        if callable(extra):
            torch.manual_seed(seed)
            try:
                sets = extra()  # a sequence is indexed: only the set asked for is made
                if not hasattr(sets, "__getitem__") or not hasattr(sets, "__len__"):
                    sets = list(sets)
                return [("get_extra_inputs()", list(sets[variant]))] if variant < len(sets) else []
            except BaseException as exc:
                raise RequestFailure(
                    "task_error",
                    f"get_extra_inputs() raised {describe_exception(exc)}",
                    traceback_tail(),
                ) from exc
        from kf.evaluation.runner.variants import derived_shapes

        return derived_shapes(torch, self.task_module, self._get_inputs, seed, variant)

    def op_make_inputs(self, msg: p.MakeInputs) -> p.InputsMade:
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

    def _op_make_inputs(self, msg: p.MakeInputs) -> p.InputsMade:
        seed, variant, scale = msg.seed, msg.variant, msg.scale
        key = (self.model_seed, seed, variant, scale)
        made = self.made.get(key)
        reused = made is not None
        if made is None:
            self._make_room()
            made = self._make(seed, variant, scale)
        memory = self._device_memory()  # with the set made: for the cache and the reply
        if reused:
            self.made.move_to_end(key)
        else:
            self._remember(key, made, memory)
        if made.pristine is None:
            return msgspec.structs.replace(made.reply, reused=reused)
        reply = msgspec.structs.replace(made.reply, reused=reused, **memory)
        self._inputs, self._inputs_from = None, made.pristine
        # a check follows its own trial's inputs; keeping every trial's inputs and outputs
        # would hold tens of GB at KernelBench's sizes
        self.trials.pop(seed, None)
        self.trials[seed] = (made.pristine, made.expected)
        self.trial_variant[seed] = variant
        self.trial_scale[seed] = scale
        while len(self.trials) > 1 and (
            len(self.trials) > TRIALS_KEPT
            or sum(map(self._nbytes, self.trials.values())) > self._trials_budget()
        ):
            del self.trials[next(iter(self.trials))]
        if not msg.send:  # the candidate runner makes its own (own_inputs)
            return reply
        return msgspec.structs.replace(reply, inputs=self._dump_inputs(made.pristine))

    def _make_room(self) -> None:
        """Before a new input set is made: let go of the last timed inputs (replaced
        after it anyway) and of the oldest trials while those kept and one more of the
        last one's size would exceed the budget. At KernelBench's sizes one trial's
        inputs and outputs are 12.8 GB; a trial dropped here is made again if a check
        asks for it (its inputs and outputs are a pure function of the seed)."""
        self.inputs = []
        if self.trials:
            budget = self._trials_budget()
            sizes = [self._nbytes(t) for t in self.trials.values()]
            last = sizes[-1]
            while self.trials and sum(sizes) + last > budget:
                del self.trials[next(iter(self.trials))]
                sizes.pop(0)
        # the blocks of what was let go, given back: a set of another size (a gate
        # variant) cannot reuse them, and the caching allocator would keep them reserved
        self._trim_device_cache()

    def _trials_budget(self) -> int:
        """Bytes of trials this runner may hold: its cache budget, at least the floor."""
        return max(self.made_budget, runner_common.TRIALS_FLOOR)

    def _nbytes(self, trial: tuple[list[Any], list[Any]]) -> int:
        """The bytes of a trial's inputs and outputs."""
        from kf.evaluation.runner.compare import tensor_bytes

        return tensor_bytes(self.torch, (*trial[0], *trial[1]))

    def _remember(
        self, key: tuple[int, int, int | None, float | None], made: Made, memory: dict[str, int]
    ) -> None:
        """Keep what was made for later candidates, within ``made_budget`` bytes, a set
        of at most :data:`CACHED_SET_SHARE` of it, and on a GPU only while the device
        stays at least half free with it kept: every task's reference runner keeps such a
        cache while idle, and those of a many-task run add up beside the task being
        evaluated. A kept set spares a reference forward, which is worth its memory for
        small sets made often; at KernelBench's sizes a kept set was gigabytes held beside
        every later request (HuberLoss: its gate's smaller shape, 5.4 GB, through the
        whole profile, while the task's own sets, just over the budget, were not kept)."""
        if made.nbytes > self.made_budget * CACHED_SET_SHARE:
            return
        if memory and memory["device_free_bytes"] - made.nbytes < memory["device_total_bytes"] // 2:
            return
        self.made[key] = made
        while sum(m.nbytes for m in self.made.values()) > self.made_budget:
            self.made.popitem(last=False)

    def _make(self, seed: int, variant: int | None, scale: float | None) -> Made:
        """:meth:`_make_inputs`, made again with copies when the reference turns out to
        write to a large input it was called on (the set is a pure function of its
        seed, variant and scale)."""
        try:
            return self._make_inputs(seed, variant, scale)
        except _WroteItsInputs:
            self.forward_on_copies = True
            return self._make_inputs(seed, variant, scale)

    def _given(self, pristine: list[Any]) -> tuple[list[Any], list[Any]]:
        """What the reference's forward is called on, and what to check after it.

        A copy of each input it may write to, as the candidate's inputs are compared with
        the kept ones; but an input of :data:`~kf.evaluation.runner.common.FINGERPRINT_ABOVE`
        bytes or more is the kept one itself, with its checksums to check after the call
        (:func:`kf.evaluation.runner.compare.fingerprint`): at KernelBench's sizes a copy is as
        large as the set (8.6 GB for the mat-vec task's matrix), and no candidate runs
        here to defeat a checksum. A forward that writes one gets copies from then on."""
        from kf.evaluation.runner.compare import fingerprint, is_large

        torch = self.torch
        if self.forward_on_copies:
            return self.clone(pristine), []
        large = [is_large(torch, v, runner_common.FINGERPRINT_ABOVE) for v in pristine]
        if not any(large):
            return self.clone(pristine), []
        given = [v if big else self.clone([v])[0] for v, big in zip(pristine, large, strict=True)]
        sums = [
            (i, fingerprint(torch, v))
            for i, (v, big) in enumerate(zip(pristine, large, strict=True))
            if big
        ]
        return given, sums

    def _private(self, values: list[Any]) -> list[Any]:
        """The timed calls' inputs: a copy of each, except a large one the reference's
        forward was seen not to write when the set was made (:meth:`_given`), which is
        shared: at KernelBench's sizes the copy was a third set on the device while the
        candidate's was timed."""
        from kf.evaluation.runner.compare import is_large

        if self.forward_on_copies:
            return self.clone(values)
        above = runner_common.FINGERPRINT_ABOVE
        return [v if is_large(self.torch, v, above) else self.clone([v])[0] for v in values]

    def _make_inputs(
        self,
        seed: int,
        variant: int | None,
        scale: float | None = None,
        options: Iterable[tuple[str, list[Any]]] | None = None,
    ) -> Made:
        torch = self.torch
        if scale is not None:  # a hidden input distribution (kf.evaluation.runner.variants)
            return self._scaled_inputs(seed, scale)
        if options is None:
            if variant is None:
                options = [("", self._get_inputs(seed))]
            else:
                options = self._variant_candidates(seed, variant)
        # Each option in turn (one at a time: at KernelBench's sizes a set is several GB):
        # the inputs as made, kept; the reference's forward gets a copy of each it may
        # write to, or a large one itself with checksums (_given). A variant the reference
        # rejects is not used: the next one is tried. Nothing is kept of an option the
        # reference rejects before the next is made.
        how = ""
        for label, raw in options:
            how = label
            inputs = pristine = [self.backend.to_device(v) for v in raw]
            del raw
            given, sums = self._given(pristine)
            start = self.clock_ns()
            try:
                with torch.no_grad():
                    out = self.model(*given)
                self.backend.synchronize()
            except BaseException as exc:
                if variant is None:
                    raise RequestFailure(
                        "task_error",
                        f"Model.forward raised {describe_exception(exc)}",
                        traceback_tail(),
                    ) from exc
                del given, inputs, pristine
                continue
            break
        else:
            return Made(p.InputsMade(missing="the task has no other input shapes kf could derive"))
        eager_ms = (self.clock_ns() - start) / 1e6
        from kf.evaluation.runner.compare import aliases, compact, fingerprint

        if sums and any(fingerprint(torch, pristine[i]) != fp for i, fp in sums):
            raise _WroteItsInputs
        outs = flatten_outputs(torch, out, "Model.forward", "task_error")
        del out
        # the reference's own outputs; one that shares storage with what it was given (a
        # view or an in-place op) keeps that copy alive, and none can alias the kept
        # inputs; one in a much larger buffer (a loss's 0-d result) would keep the buffer
        expected = [
            o.detach().clone() if any(aliases(torch, o, v) for v in pristine) else compact(torch, o)
            for o in outs
        ]
        del given
        reply = p.InputsMade(
            input_shapes=[list(v.shape) if isinstance(v, torch.Tensor) else [] for v in inputs],
            input_dtypes=[
                str(v.dtype).removeprefix("torch.")
                if isinstance(v, torch.Tensor)
                else type(v).__name__
                for v in inputs
            ],
            output_shapes=[list(o.shape) for o in outs],
            output_dtypes=[str(o.dtype).removeprefix("torch.") for o in outs],
            eager_ms=eager_ms,
            variant=(
                f"{how}: input shapes "
                f"{[list(v.shape) for v in inputs if isinstance(v, torch.Tensor)]}"
                if variant is not None
                else ""
            ),
        )
        return Made(reply, pristine, expected, self._nbytes((pristine, expected)))

    def _scaled_inputs(self, seed: int, scale: float) -> Made:
        """The task's inputs for ``seed`` with floating-point tensors scaled: none when
        there are none, or when the reference rejects them."""
        from kf.evaluation.runner.variants import scale_inputs

        raw = scale_inputs(self.torch, self._get_inputs(seed), scale)
        if raw is None:
            return Made(p.InputsMade(missing="the task has no floating-point inputs"))
        made = self._make_inputs(seed, 0, options=[(f"inputs ×{scale:g}", raw)])
        if made.pristine is None:
            return Made(p.InputsMade(missing=f"the reference rejects inputs ×{scale:g}"))
        return made

    def op_trim(self, msg: p.Trim) -> p.Trimmed:
        """Between stages: drop the trials' tensors and the last inputs when they are
        large (a reference runner stays alive for the task's next candidate, and idle
        runners holding 25 GB each ran a GPU out of memory), then return cached blocks."""
        limit = msg.keep_bytes
        held = sum(map(self._nbytes, self.trials.values())) + self._nbytes((self._inputs or [], []))
        dropped = 0
        if held > limit:
            self.trials.clear()
            self.inputs = []
            dropped = held
        self._trim_device_cache()
        return p.Trimmed(dropped_bytes=dropped)

    def op_audit(self, msg: p.Audit) -> p.Audited:
        """Whether the reference's outputs depend on its inputs (kf.evaluation.grader.audit)."""
        from kf.evaluation.runner.audit import audit_reference

        return audit_reference(self, msg)

    def op_check(self, msg: p.Check) -> p.Checked:
        try:
            return p.Checked(verdict=msgspec.convert(self._check(msg), p.Verdict))
        finally:
            self._trim_device_cache()

    def _check(self, msg: p.Check) -> dict[str, Any]:
        from kf.evaluation.runner.compare import compare_inputs, compare_outputs
        from kf.evaluation.runner.float64 import check_with_float64

        seed = msg.seed
        if seed not in self.trials:
            # evicted to bound memory: the inputs and outputs are a pure function of the seed
            made = self._make(seed, self.trial_variant.get(seed), self.trial_scale.get(seed))
            self.trials[seed] = (made.pristine or [], made.expected or [])
        pristine, expected = self.trials[seed]
        try:
            got = self.load(msg.outputs)
            after = None if msg.inputs_after is None else self.load(msg.inputs_after)
        except Exception as exc:
            return {
                "ok": False,
                "kind": "exception",
                "reason": f"unreadable output: {describe_exception(exc)}",
            }
        tol = _builtins(msg.tol)
        verdict = compare_outputs(self.torch, expected, got, tol)
        if not verdict["ok"]:  # the float64 rule: a float64 run only where allclose failed
            verdict = check_with_float64(
                self.torch, self.model, pristine, expected, got, tol, verdict
            )
        if verdict["ok"]:
            if after is None:  # the candidate runner made and checked its own inputs
                problem = msg.inputs_problem
            else:
                problem = compare_inputs(self.torch, pristine, after)
            if problem is not None:
                return {**verdict, "ok": False, "kind": "input_mutated", "reason": problem}
        return verdict

    def op_compile_baseline(self, msg: p.CompileBaseline) -> p.BaselineCompiled:
        """Compile the reference with ``torch.compile`` for the current inputs, once.

        Default mode, inductor, static shapes (what a first compile gives; no
        recompilation for other shapes turns them dynamic). The first call, which
        compiles, is timed; its output must pass the same check as a candidate's, or
        the compiled reference is not a baseline. A failure is an answer (``error``),
        not a failed request: the task is fine, only the baseline is missing.
        """
        mode = msg.mode or "default"
        key = self._signature(self.inputs)
        known = self.compiled.get(key)
        if known is not None and known.reply.mode == mode:
            self.compiled.move_to_end(key)
            return msgspec.structs.replace(known.reply, cached=True)
        if msg.cache_dir:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = msg.cache_dir
        fn, reply = self._compile_reference(mode)
        self.compiled[key] = Compiled(fn, reply)
        while len(self.compiled) > MAX_COMPILED:
            self.compiled.popitem(last=False)
        return reply

    def _compile_reference(self, mode: str = "default") -> tuple[Any, p.BaselineCompiled]:
        from kf.evaluation.runner.compare import compare_outputs
        from kf.evaluation.runner.float64 import check_with_float64

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
            graphs_before = dynamo_graphs(torch)
            fn = torch.compile(self.model, **compile_kwargs(mode))
            # each call on the timed inputs as the timed calls get them (_private: a large
            # input the forward does not write is shared; a copy was 6.4 GB more at
            # KernelBench's sizes, twice, beside both outputs)
            with torch.no_grad():
                got = fn(*self._private(self.inputs))
            self.backend.synchronize()
            compile_s = (self.clock_ns() - start) / 1e9
            with torch.no_grad():
                want = self.model(*self._private(self.inputs))
            got_list = [got] if isinstance(got, torch.Tensor) else list(got)
            want_list = [w.detach() for w in ([want] if isinstance(want, torch.Tensor) else want)]
            verdict = compare_outputs(torch, want_list, got_list)
            verdict = check_with_float64(
                torch, self.model, self.inputs, want_list, got_list, None, verdict
            )
        except Exception as exc:  # any failure of torch.compile is the answer
            return None, p.BaselineCompiled(
                baseline=described,
                mode=mode,
                compile_s=(self.clock_ns() - start) / 1e9,
                error=f"torch.compile failed: {describe_exception(exc)}",
            )
        if not verdict["ok"]:
            return None, p.BaselineCompiled(
                baseline=described,
                mode=mode,
                compile_s=compile_s,
                error=f"torch.compile's output fails kf's check against eager: "
                f"{verdict['kind']}: {verdict['reason']}",
            )
        graphs = dynamo_graphs(torch) - graphs_before
        return fn, p.BaselineCompiled(
            baseline=described, mode=mode, compile_s=compile_s, graphs=graphs
        )


def _builtins(tol: Any) -> dict[str, Any] | None:
    """A tolerance as :func:`kf.evaluation.runner.compare.compare_outputs` takes it."""
    return None if tol is None else dict(msgspec.to_builtins(tol))
