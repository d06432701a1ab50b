"""What bounds an evaluation's memory at KernelBench's sizes, tested at small sizes with
the limits made small: a reference runner drops old trials before it makes a new one, the
generalisation gate's shapes are made one at a time, and a candidate's large inputs are
checked against checksums instead of a copy (the H200 figures: README, "KernelBench at
its real size")."""

from __future__ import annotations

import time
import types

import pytest
import torch

from kf.evaluation.runner import common as runner_common
from kf.evaluation.runner.compare import Fingerprint
from kf.evaluation.runner.loop import Runner
from kf.evaluation.runner.variants import derived_shapes
from kf.evaluation.wire.protocol import Audit, Check, LoadTask, MakeInputs, Run, Setup
from tests.runner_cases import FIXTURES, TASK_FILE, runner_pair


def test_reference_lets_old_trials_go_before_making_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a budget smaller than one trial, the trials held while the next set is made
    are none (at KernelBench's sizes each held trial is 12.8 GB more at the peak), and a
    check of a dropped trial still gets the right verdict (it is made again)."""
    monkeypatch.setattr(runner_common, "TRIALS_FLOOR", 1)
    ref, cand = runner_pair((FIXTURES / "honest_cpp.py").read_text(), {}, {"own_inputs": True})
    ref.made_budget = 1
    held_while_making: list[int] = []
    module = ref.task_module
    original = module.get_inputs

    def spy() -> list[torch.Tensor]:
        held_while_making.append(len(ref.trials))
        return original()

    monkeypatch.setattr(module, "get_inputs", spy)
    for seed in (1, 2, 3):
        ref.op_make_inputs(MakeInputs(seed=seed, send=False))
    assert held_while_making == [0, 0, 0]
    assert list(ref.trials) == [3]
    ran = cand.op_run(Run(seed=1))
    assert ref.op_check(Check.of(ran, 1)).verdict.ok  # seed 1 made again for its check
    assert not ref.op_check(Check.of(ran, 3)).verdict.ok


def test_gate_shapes_are_made_one_at_a_time() -> None:
    """The gate takes the first set the reference accepts: later sets are not made
    before they are asked for (each is gigabytes at KernelBench's sizes)."""
    module = types.ModuleType("task_two_sizes")
    module.B = 8  # type: ignore[attr-defined]
    module.N = 64  # type: ignore[attr-defined]
    module.get_inputs = lambda: [torch.randn(module.B, module.N)]  # type: ignore[attr-defined]
    calls: list[tuple[int, int]] = []

    def get_inputs(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        calls.append((module.B, module.N))  # type: ignore[attr-defined]
        return list(module.get_inputs())  # type: ignore[attr-defined]

    sets = derived_shapes(torch, module, get_inputs, 1, 0)
    label, first = next(sets)
    assert tuple(first[0].shape) == (5, 33) and "B=8→5" in label and "N=64→33" in label
    assert calls == [(5, 33)]  # the task's own set sized on the meta device, not made
    rest = list(sets)
    assert [tuple(s[0].shape) for _, s in rest] == [(5, 64), (8, 33)]
    assert module.B == 8 and module.N == 64  # type: ignore[attr-defined]


@pytest.mark.parametrize(("fixture", "problem"), [("honest_cpp", None), ("input_write", "input 0")])
def test_candidate_checks_large_inputs_against_checksums(
    monkeypatch: pytest.MonkeyPatch, fixture: str, problem: str | None
) -> None:
    """Above the size limit (here 0 bytes) the candidate runner keeps checksums of its
    inputs, not a copy, and still reports an input its kernel wrote to."""
    monkeypatch.setattr(runner_common, "FINGERPRINT_ABOVE", 0)
    kept: list[list[object]] = []
    ref, cand = runner_pair((FIXTURES / f"{fixture}.py").read_text(), {}, {"own_inputs": True})
    seeded = cand._seeded

    def spy(seed: int, scale: float | None = None, *, check: bool = True):  # type: ignore[no-untyped-def]
        inputs, pristine = seeded(seed, scale, check=check)
        kept.append(pristine)
        return inputs, pristine

    monkeypatch.setattr(cand, "_seeded", spy)
    ref.op_make_inputs(MakeInputs(seed=4, send=False))
    ran = cand.op_run(Run(seed=4))
    assert kept and all(isinstance(v, Fingerprint) for v in kept[0] if not isinstance(v, int))
    if problem is None:
        assert ran.inputs_problem is None
        assert ref.op_check(Check.of(ran, 4)).verdict.ok
    else:
        assert ran.inputs_problem is not None and ran.inputs_problem.startswith(problem)
        assert not ref.op_check(Check.of(ran, 4)).verdict.ok


_CALLED_ON = """
import torch

CALLS = []
N = 64


class Model(torch.nn.Module):
    def forward(self, x):
        CALLS.append(x.data_ptr())
        if WRITES:
            x.mul_(2)  # the task's own forward writes its input
            return x + 1
        return x * 2 + 1


def get_inputs():
    return [torch.randn(N, 8)]


def get_init_inputs():
    return []
"""


def _reference(writes: bool) -> Runner:
    from kf.evaluation.wire.protocol import LoadTask, Setup

    ref = Runner(time.perf_counter_ns)
    ref.op_setup(Setup(device="cpu", threads=1))
    source = f"WRITES = {writes}\n" + _CALLED_ON
    ref.op_load_task(LoadTask(source=source, name="called_on", seed=3))
    return ref


@pytest.mark.parametrize("large", [True, False])
def test_reference_forward_gets_large_inputs_themselves_with_checksums(
    monkeypatch: pytest.MonkeyPatch, large: bool
) -> None:
    """An input of FINGERPRINT_ABOVE bytes or more (here: every one) is the kept input
    itself in the reference's forward, not a copy (a copy is 8.6 GB more for the
    mat-vec task); a small one is still a copy. Either way the expected outputs are the
    forward's on the trial's inputs."""
    if large:
        monkeypatch.setattr(runner_common, "FINGERPRINT_ABOVE", 0)
    ref = _reference(writes=False)
    calls = ref.task_module.CALLS
    ref.op_make_inputs(MakeInputs(seed=1, send=False))
    pristine, expected = ref.trials[1]
    assert (calls == [pristine[0].data_ptr()]) is large
    assert torch.equal(expected[0], pristine[0] * 2 + 1)
    assert not ref.forward_on_copies


def test_reference_that_writes_a_large_input_is_made_again_with_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reference whose forward writes its (large) input changes its checksums: the set
    is made again, the forward given a copy, and so for every later set; the kept inputs
    are the task's as made and the expected outputs are computed from them."""
    monkeypatch.setattr(runner_common, "FINGERPRINT_ABOVE", 0)
    ref = _reference(writes=True)
    module = ref.task_module
    for seed in (1, 2):
        ref.op_make_inputs(MakeInputs(seed=seed, send=False))
        pristine, expected = ref.trials[seed]
        torch.manual_seed(seed)
        (made,) = module.get_inputs()
        assert torch.equal(pristine[0], made)  # not doubled by the forward
        assert torch.equal(expected[0], made * 2 + 1)
        assert module.CALLS[-1] != pristine[0].data_ptr()  # the last call was on a copy
    assert ref.forward_on_copies
    assert len(module.CALLS) == 3  # seed 1 twice (on the set itself, then a copy), seed 2 once


@pytest.mark.parametrize(("fixture", "problem"), [("honest_cpp", None), ("input_write", "input 0")])
def test_candidate_checks_large_sent_inputs_itself(
    monkeypatch: pytest.MonkeyPatch, fixture: str, problem: str | None
) -> None:
    """Large inputs sent to the candidate (a gate variant's: the reference makes those)
    are checked in the candidate runner against checksums, as those it makes itself are,
    instead of coming back whole for the reference to compare; an input its kernel wrote
    to is still reported, and the verdict is the same."""
    monkeypatch.setattr(runner_common, "FINGERPRINT_ABOVE", 0)
    ref, cand = runner_pair((FIXTURES / f"{fixture}.py").read_text(), {}, {})
    made = ref.op_make_inputs(MakeInputs(seed=4, send=True))
    assert made.inputs is not None
    ran = cand.op_run(Run(inputs=made.inputs))
    assert ran.inputs_after is None
    verdict = ref.op_check(Check.of(ran, 4)).verdict
    if problem is None:
        assert ran.inputs_problem is None and verdict.ok
    else:
        assert ran.inputs_problem is not None and ran.inputs_problem.startswith(problem)
        assert not verdict.ok and verdict.kind == "input_mutated"


def _matvec_module(m: int = 64, k: int = 1024) -> types.ModuleType:
    module = types.ModuleType("task_matvec")
    module.M, module.K = m, k  # type: ignore[attr-defined]
    module.get_inputs = lambda: [torch.randn(module.M, module.K), torch.randn(module.K, 1)]  # type: ignore[attr-defined]
    return module


def _seeded_get_inputs(module: types.ModuleType, calls: list[int]):  # type: ignore[no-untyped-def]
    def get_inputs(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        calls.append(seed)
        return list(module.get_inputs())  # type: ignore[attr-defined]

    return get_inputs


def _set_bytes(values: list[torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in values)


@pytest.mark.parametrize("large", [True, False])
def test_gate_grows_a_large_set_by_an_eighth_at_most(
    monkeypatch: pytest.MonkeyPatch, large: bool
) -> None:
    """Variant 1 grows each size constant alone to about 1.5×; a set of GROW_CAP_ABOVE
    bytes or more (here: any) grows to at most GROW_CAP × its bytes, still odd and
    larger than the task's (KernelBench's mat-vec: a 12.9 GB matrix instead of 8.6 GB,
    held in both runners, put kf at 3.07× KernelBench's peak on the H200)."""
    from kf.evaluation.runner import variants

    if large:
        monkeypatch.setattr(variants, "GROW_CAP_ABOVE", 0)
    module = _matvec_module()
    base = _set_bytes(module.get_inputs())  # type: ignore[attr-defined]
    calls: list[int] = []
    sets = list(derived_shapes(torch, module, _seeded_get_inputs(module, calls), 1, 1))
    shapes = [tuple(s[0].shape) for _, s in sets]
    if large:
        assert shapes == [(69, 1024), (64, 1089)]
        assert all(_set_bytes(s) <= variants.GROW_CAP * base for _, s in sets)
        assert "M=64→69" in sets[0][0] and "K=1024→1089" in sets[1][0]
    else:
        assert shapes == [(97, 1024), (64, 1537)]
    assert calls == [1, 1]  # the two sets made; the task's own only sized, on meta
    assert (module.M, module.K) == (64, 1024)  # type: ignore[attr-defined]


def test_gate_sizes_a_task_that_cannot_run_on_meta_from_a_real_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task whose get_inputs() cannot run on the meta device (here an .item()) is
    sized from a real set, as before, and grows to about 1.5× (no estimate to cap by)."""
    from kf.evaluation.runner import variants

    monkeypatch.setattr(variants, "GROW_CAP_ABOVE", 0)
    module = _matvec_module()

    def get_inputs() -> list[torch.Tensor]:
        scale = float(torch.ones(1).sum().item())
        return [torch.randn(module.M, module.K) * scale, torch.randn(module.K, 1)]  # type: ignore[attr-defined]

    module.get_inputs = get_inputs  # type: ignore[attr-defined]
    calls: list[int] = []
    sets = list(derived_shapes(torch, module, _seeded_get_inputs(module, calls), 1, 1))
    assert [tuple(s[0].shape) for _, s in sets] == [(97, 1024), (64, 1537)]
    assert calls == [1, 1, 1]  # the task's own set made to be measured, then the two


@pytest.mark.parametrize("large", [True, False])
def test_reference_times_a_large_set_it_does_not_write_without_a_copy(
    monkeypatch: pytest.MonkeyPatch, large: bool
) -> None:
    """The reference's timed calls get a copy of a small set, but share a large one its
    forward was seen not to write; one whose forward writes it gets copies."""
    from kf.evaluation.wire.protocol import Time

    if large:
        monkeypatch.setattr(runner_common, "FINGERPRINT_ABOVE", 0)
    for writes in (False, True):
        ref = _reference(writes=writes)
        ref.op_make_inputs(MakeInputs(seed=1, send=False))
        pristine = ref.trials[1][0]
        ref.op_time(Time(n=2))
        shared = ref.inputs[0].data_ptr() == pristine[0].data_ptr()
        assert shared is (large and not writes)
        torch.manual_seed(1)
        assert torch.equal(pristine[0], ref.task_module.get_inputs()[0])


def _profiled_requests() -> list[str]:
    """The runner requests' ops, in order, of a whole evaluation (profiled, its fresh
    inputs timed) of the honest candidate on the small task."""
    from kf.evaluation import RunnerPool, evaluate
    from kf.evaluation.grader.runner_handle import REQUESTS
    from kf.kernels.tasks import load_task

    REQUESTS.clear()
    pool = RunnerPool(size=2, threads=1)
    pool.start()
    try:
        result = evaluate(
            load_task(TASK_FILE), (FIXTURES / "honest_cpp.py").read_text(),
            pool=pool, timeout_s=90, profile_options={"min_time_s": 0.05, "warmup": 2,
            "min_trials": 10}, profile=True,
        )  # fmt: skip
    finally:
        pool.close()
    assert result.passed, result.error
    assert result.profile is not None and result.profile.fresh_runtime_ms > 0
    return [r.op for r in REQUESTS]


def test_profile_trims_the_reference_before_the_fresh_timing() -> None:
    """The candidate holds two input sets while it times fresh ones against repeated ones;
    the reference is asked to let its sets go first (it does when they are large), so
    the two runners do not hold three sets at once."""
    ops = _profiled_requests()
    fresh = len(ops) - 1 - ops[::-1].index("time_inputs")
    assert "trim" in ops[:fresh]
    last_trim = fresh - 1 - ops[:fresh][::-1].index("trim")
    # nothing between that trim and the fresh timing asks the reference for a set
    assert "make_inputs" not in ops[last_trim:fresh] and "check" not in ops[last_trim:fresh]
    assert "settle" not in ops  # turns between timed requests: a GPU's (its cache)


def test_a_stages_peak_is_one_runners_peak_plus_what_the_others_hold() -> None:
    """A stage's requests go one at a time: the most its runners held at once is, over its
    requests, the handler's peak plus what the other runners held at the end of their last
    request (one from before the stage included); None when no runner states any (a CPU)."""
    from kf.evaluation.grader.grading import stage_peak_device_mb
    from kf.evaluation.grader.runner_handle import REQUESTS, RequestTiming

    ref, cand, other = (types.SimpleNamespace(pid=p) for p in (11, 12, 13))
    gb = 10**9
    REQUESTS.clear()
    for op, ended, pid, peak, held in [
        ("make_inputs", 1.0, 11, 9 * gb, 9 * gb),  # before the stage: the reference holds 9
        ("run", 2.0, 13, 50 * gb, 50 * gb),  # another stage's runner: not this stage's
        ("lease_wait", 2.5, 12, 0, 0),
        ("run", 3.0, 12, 12 * gb, 10 * gb),  # 12 + the reference's 9
        ("check", 4.0, 11, 11 * gb, 2 * gb),  # 11 + the candidate's 10
        ("run", 5.0, 12, 15 * gb, 0),  # 15 + the reference's 2
    ]:
        REQUESTS.append(RequestTiming(op, 0.1, 0.1, ended, pid, None, peak, held))
    try:
        assert stage_peak_device_mb(1.5, ref, cand) == 21_000.0  # type: ignore[arg-type]
        assert stage_peak_device_mb(4.5, ref, cand) == 17_000.0  # type: ignore[arg-type]
        assert stage_peak_device_mb(1.5, other) == 50_000.0  # type: ignore[arg-type]
        REQUESTS.clear()
        REQUESTS.append(RequestTiming("run", 0.1, 0.1, 3.0, 12, None))
        assert stage_peak_device_mb(0.0, cand) is None  # type: ignore[arg-type]
    finally:
        REQUESTS.clear()


@pytest.mark.parametrize(("free", "kept"), [(90, True), (55, False)])
def test_reference_keeps_made_sets_only_while_the_device_stays_half_free(
    monkeypatch: pytest.MonkeyPatch, free: int, kept: bool
) -> None:
    """A reference runner's cache of made sets (for the task's later candidates) takes a
    set only while the device would stay at least half free with it (here a 100-unit
    device; the set, inputs and outputs, is 4096 bytes: 20 % of it)."""
    ref = _reference(writes=False)
    ref.made_budget = 1 << 20
    unit = 2048 // 10
    monkeypatch.setattr(
        ref, "_device_memory",
        lambda: {"device_free_bytes": free * unit, "device_total_bytes": 100 * unit},
    )  # fmt: skip
    ref.op_make_inputs(MakeInputs(seed=1, send=False))
    assert bool(ref.made) is kept
    assert 1 in ref.trials  # the trial itself is held either way


def test_scaled_inputs_are_scaled_in_place_unless_the_task_keeps_them() -> None:
    """A hidden distribution's set is the task's fresh one scaled in place (a scaled copy
    beside it was one more set on the device: 8 GiB for the mat-vec task's matrix); a
    tensor the task keeps and returns again, or one sharing its storage, is copied and
    left as it was; the values are those of an out-of-place product either way."""
    from kf.evaluation.runner.variants import scale_inputs

    kept = torch.randn(8)
    before = kept.clone()
    fresh = torch.randn(8)
    want = [fresh * 3.0, kept * 3.0, kept * 3.0, kept[2:] * 3.0, torch.arange(3)]
    values = [fresh, kept, kept.detach(), kept[2:], torch.arange(3)]
    fresh_ptr = fresh.data_ptr()
    del fresh
    got = scale_inputs(torch, values, 3.0)
    assert got is not None
    assert got[0].data_ptr() == fresh_ptr  # nothing else held it: scaled where it lay
    assert all(g.data_ptr() != kept.data_ptr() for g in got[1:4])
    assert torch.equal(kept, before)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert scale_inputs(torch, [torch.arange(3)], 3.0) is None
    leaf = scale_inputs(torch, [torch.ones(3, requires_grad=True)], 3.0)  # copied, no error
    assert leaf is not None and torch.equal(leaf[0].detach(), torch.full((3,), 3.0))


def test_audit_makes_each_set_with_no_earlier_one_alive() -> None:
    """The audit's input sets (trial seeds, then the first's scaled) are made one at a
    time: when the task's get_inputs() runs, no set the reference was called on is still
    held (a scaled set kept across the generator's yield was a second set on the device)."""
    import weakref

    from kf.evaluation.wire.protocol import Audit

    ref, _ = runner_pair((FIXTURES / "honest_cpp.py").read_text(), {}, {})
    seen: list[weakref.ref[torch.Tensor]] = []
    alive_at_make: list[int] = []
    model, module = ref.model, ref.task_module
    original = module.get_inputs

    def forward(*inputs: torch.Tensor) -> torch.Tensor:
        seen.extend(weakref.ref(v) for v in inputs)
        return model(*inputs)

    def get_inputs() -> list[torch.Tensor]:
        alive_at_make.append(sum(r() is not None for r in seen))
        return original()

    ref.model = forward
    module.get_inputs = get_inputs
    try:
        reply = ref.op_audit(Audit(seeds=[1, 2, 3], scales=[3.0, 0.01]))
    finally:
        module.get_inputs = original
    assert reply.input_sets == 5
    assert alive_at_make == [0, 0, 0, 0, 0]


def test_profile_reference_makes_only_the_fresh_set_it_judges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the candidate makes its own inputs from seeds, the reference makes only the
    fresh set whose output it judges before the fresh timing, not every set the candidate
    times (each was another set on the device at KernelBench's sizes); the candidate
    still times every fresh set."""
    from kf.evaluation.grader.grading import FRESH_SETS

    monkeypatch.setenv("KF_TENSOR_TRANSPORT", "seed")
    ops = _profiled_requests()
    fresh = len(ops) - 1 - ops[::-1].index("time_inputs")
    batch = fresh - 1 - ops[:fresh][::-1].index("batch")
    assert ops[batch:fresh].count("make_inputs") == 1
    assert FRESH_SETS > 1


@pytest.mark.parametrize(("budget", "kept"), [(1 << 20, True), (8192, False)])
def test_reference_keeps_only_sets_small_beside_its_cache_budget(budget: int, kept: bool) -> None:
    """A made set is kept for the task's later candidates only when it is at most an
    eighth of the cache budget (here the set is 4096 bytes): at KernelBench's sizes a
    kept set within the budget was gigabytes beside every later request (HuberLoss: its
    gate's smaller shape, 5.4 GB, through the whole profile)."""
    ref = _reference(writes=False)
    ref.made_budget = budget
    ref.op_make_inputs(MakeInputs(seed=1, send=False))
    assert bool(ref.made) is kept
    assert 1 in ref.trials  # the trial itself is held either way
    assert ref.op_make_inputs(MakeInputs(seed=1, send=False)).reused is kept


_LOSS_TASK = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, predictions, targets):
        return torch.nn.functional.smooth_l1_loss(predictions, targets)

def get_inputs():
    return [torch.rand(512, 512), torch.rand(512, 512)]

def get_init_inputs():
    return []
"""


def test_a_loss_result_is_kept_without_its_elementwise_buffer() -> None:
    """PyTorch's reduced losses return a 0-d tensor that keeps the full elementwise
    buffer as its storage (KernelBench's HuberLoss: 4.3 GB on the device beside a
    4-byte answer, held as long as the expected output was). The reference keeps a
    compact copy, and the check still judges against the same value."""
    raw = torch.nn.functional.smooth_l1_loss(torch.rand(512, 512), torch.rand(512, 512))
    assert raw.untyped_storage().nbytes() > 512 * 512  # what PyTorch does (the premise)
    ref = Runner(time.perf_counter_ns)
    ref.op_setup(Setup(device="cpu", threads=1))
    ref.op_load_task(LoadTask(source=_LOSS_TASK, name="loss", seed=3))
    ref.op_make_inputs(MakeInputs(seed=1, send=False))
    pristine, expected = ref.trials[1]
    assert [tuple(o.shape) for o in expected] == [()]
    assert expected[0].untyped_storage().nbytes() == expected[0].element_size()
    want = torch.nn.functional.smooth_l1_loss(*pristine)
    assert torch.equal(expected[0], want)
    audited = ref.op_audit(Audit(seeds=[1, 2, 3]))
    assert audited.input_sets >= 2 and not audited.degenerate


@pytest.mark.parametrize("writes", [False, True])
def test_compile_check_calls_on_a_large_set_it_does_not_write_without_a_copy(
    monkeypatch: pytest.MonkeyPatch, writes: bool
) -> None:
    """The check of ``torch.compile``'s output against eager calls both on the timed
    inputs as the timed calls get them: a large input the forward does not write is
    shared (copies were 6.4 GB each at KernelBench's sizes, in a ``kf run``'s profile);
    a forward that writes its input gets copies, and the kept set is unchanged. The
    compiler is left out (the identity): what is checked is what each call is given."""
    from kf.evaluation.wire.protocol import CompileBaseline

    monkeypatch.setattr(runner_common, "FINGERPRINT_ABOVE", 0)
    monkeypatch.setattr(torch, "compile", lambda model, **_: model)
    ref = _reference(writes=writes)
    ref.op_make_inputs(MakeInputs(seed=1, send=False))
    pristine = ref.trials[1][0]
    calls = ref.task_module.CALLS
    calls.clear()
    reply = ref.op_compile_baseline(CompileBaseline())
    assert not reply.error, reply.error
    assert len(calls) == 2  # compiled, then eager
    assert all((ptr == pristine[0].data_ptr()) is not writes for ptr in calls)
    torch.manual_seed(1)
    assert torch.equal(pristine[0], ref.task_module.get_inputs()[0])


def test_settle_warms_up_outside_the_timed_requests_and_only_when_cold() -> None:
    """On a GPU the runners take turns: after its turn a runner gives its cached blocks
    back, and before its next one a ``settle`` request makes the untimed call that
    allocates them again. The timed requests themselves make exactly the calls they
    time (the grader's wall clock around them is compared with the samples), however
    cold the runner is. On a CPU nothing is given back, so nothing is warmed."""
    from kf.evaluation.wire.protocol import Settle, Time

    ref = _reference(writes=False)
    ref.op_make_inputs(MakeInputs(seed=1, send=False))
    calls = ref.task_module.CALLS
    calls.clear()
    ref.cold = True  # as after a GPU runner gave blocks back (a CPU runner never does)
    assert len(ref.op_time(Time(n=3)).samples_ns) == 3
    assert len(calls) == 3  # no warm-up inside the timed request
    ref.op_settle(Settle(warm=True))
    assert len(calls) == 4 and not ref.cold
    ref.op_settle(Settle(warm=True))
    assert len(calls) == 4  # warm already: no call
    ref.op_settle(Settle())
    assert not ref.cold  # nothing to give back on a CPU


def test_runners_settle_around_every_timed_request_when_they_take_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the runners take turns (a GPU's caching allocator; forced here on a CPU,
    where giving blocks back is a no-op), each runner's every timed request is preceded
    by its warm-up ``settle`` and followed by the one that gives blocks back, as requests
    of their own; the empty calls that measure the loop's cost are not (nothing to
    allocate); and the evaluation still passes."""
    from kf.evaluation.grader import profiling
    from kf.evaluation.grader.runner_handle import REQUESTS

    monkeypatch.setattr(profiling, "_takes_turns", lambda device: True)
    _profiled_requests()
    per_runner: dict[int, list[str]] = {}
    for r in REQUESTS:
        per_runner.setdefault(r.pid, []).append(r.op)
    settled = 0
    for ops in per_runner.values():
        for i, op in enumerate(ops):
            if op in ("batch", "time"):  # an empty call is logged as time_empty
                assert ops[i - 1] == "settle" and ops[i + 1] == "settle", (i, ops)
                settled += 1
    assert settled >= 4  # candidate and reference, warm-up rounds and timed rounds
    assert any("time_empty" in ops for ops in per_runner.values())  # measured, unbracketed
