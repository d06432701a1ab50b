"""Hardware counters: ncu's CSV read right, the collector's new-best policy, and (on a GPU
with Nsight Compute) counters for a real kernel."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from agents.counters import CounterCollector, CounterState
from kf.agent import AgentContext
from kf.cuda import ncu
from kf.evaluation import ProfileReport
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.counters import collect_counters
from kf.events import Event, Record, make_envelope
from kf.facts import RunStarted, TaskSpec
from kf.kernels.tasks import load_task
from kf.search_facts import CandidateProfiled, CandidateProposed, CountersMeasured
from kf.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "examples" / "cuda_tasks" / "gelu_residual.py"
SEED = ROOT / "examples" / "cuda_tasks" / "seeds" / "gelu_residual.py"

# The shape of `ncu --csv --page raw` output (two kernels), with ncu's scaled units.
# ruff: noqa: E501
NCU_LOG = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "gelu_residual" - 0: 0%....50%....100% - 9 passes
==PROF== Profiling "vectorized_elementwise_kernel" - 1: 0%....50%....100% - 9 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","launch__block_size","launch__grid_size","launch__registers_per_thread","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active"
"","","","","","","","","","","","Mbyte","Mbyte","%","usecond","","","register/thread","%","%"
"0","4242","python3.12","127.0.0.1","gelu_residual","1","7","(256, 1, 1)","(8192, 1, 1)","0","9.0","268.44","134.22","91.50","94.00","256","8192","40","35.20","88.10"
"1","4242","python3.12","127.0.0.1","vectorized_elementwise_kernel","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","1,000.00","0.50","50.00","6.00","128","1024","16","10.00","60.00"
==PROF== Disconnected from process 4242
"""


def test_ncu_raw_csv_is_read_in_bytes_and_nanoseconds() -> None:
    """Each kernel's row becomes its metrics, scaled from ncu's units to bytes and ns."""
    kernels = ncu.parse(NCU_LOG)
    assert [k["kernel"] for k in kernels] == ["gelu_residual", "vectorized_elementwise_kernel"]
    first = kernels[0]
    assert first["dram_bytes_read"] == pytest.approx(268.44e6)
    assert first["duration_ns"] == pytest.approx(94_000.0)
    assert first["registers_per_thread"] == 40
    assert kernels[1]["dram_bytes_read"] == pytest.approx(1e9)  # thousands separator
    summary = ncu.summarise(kernels)
    assert summary["kernels"] == 2
    assert summary["duration_ns"] == pytest.approx(100_000.0)
    # time-weighted: (91.5 * 94 + 50 * 6) / 100
    assert summary["dram_throughput_pct"] == pytest.approx(89.01)
    assert summary["dram_gbs"] == pytest.approx((268.44e6 + 134.22e6 + 1e9 + 0.5e6) / 1e5)


def test_ncu_log_without_kernels_and_refusals_are_told_apart() -> None:
    """No CSV at all parses to nothing; a permission refusal is recognised as one."""
    assert ncu.parse("==PROF== Connected\n==ERROR== nothing\n") == []
    assert ncu.permission_refused("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission")
    assert not ncu.permission_refused("==PROF== Disconnected")


def test_find_ncu_honours_the_switch_and_an_explicit_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KF_NCU=0`` switches counters off; ``KF_NCU=/path`` is used when executable; a
    caller's settings are read instead of the process's."""
    monkeypatch.setenv("KF_NCU", "0")
    assert ncu.find_ncu() is None
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho 'Version 2099.1.0.0 (build 1)'\n")
    monkeypatch.setenv("KF_NCU", str(fake))
    assert ncu.find_ncu() is None  # not executable
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert ncu.find_ncu() == str(fake)
    # settings handed down (a grading session's) are read instead of the process's
    assert ncu.find_ncu(Settings.from_env({"KF_NCU": "0"})) is None
    assert ncu.version(str(fake)) == "Version 2099.1.0.0 (build 1)"
    argv = ncu.command(str(fake), "/tmp/x.csv")
    assert argv[0] == str(fake) and "--profile-from-start" in argv and "off" in argv


def test_the_box_binds_the_nsight_compute_installation_ncu_starts(tmp_path: Path) -> None:
    """A CUDA toolkit's ``bin/ncu`` starts ``<toolkit>/nsight-compute-<version>``: the
    box gets that folder too (the H200's runners under ncu died without it), reached
    through a link as the toolkit's own ``/usr/local/cuda`` is; nothing else beside it."""
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "nsight-compute-2099.1.0").mkdir()
    (toolkit / "secrets").mkdir()
    (toolkit / "bin" / "ncu").write_text("#!/bin/sh\n")
    (tmp_path / "cuda").symlink_to(toolkit)
    paths = ncu.install_paths(str(tmp_path / "cuda" / "bin" / "ncu"))
    assert paths[:2] == [str(toolkit / "bin"), str(toolkit / "nsight-compute-2099.1.0")]
    assert str(toolkit / "secrets") not in paths and str(toolkit) not in paths


def test_counters_on_a_cpu_say_why_there_are_none() -> None:
    """Asked for a CPU device, the stage reports the reason instead of measuring."""
    report = collect_counters(load_task(TASK), SEED.read_text(), device="cpu")
    assert not report.ok and report.error


_seq = 0


def _rec(ev: Event) -> Record:
    global _seq
    _seq += 1
    return Record(make_envelope(ev, run_id="r", source="t@x", event_id=f"c{_seq}", seq=_seq), ev)


def _profiled(
    cid: str, speedup: float, *, device: str = "gpu0", flags: tuple[str, ...] = ()
) -> Record:
    report = ProfileReport(ok=True, speedup=speedup, runtime_ms=1.0, flags=flags)
    return _rec(CandidateProfiled(candidate_id=cid, task="t", device_id=device, report=report))


def test_collector_measures_only_new_trustworthy_bests_of_its_own_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """New bests on this device are measured; slower ones, suspect ones and other devices'
    are not; without ncu nothing is measured at all."""
    agent = CounterCollector(
        AgentContext(
            run_id="r", agent_id="counters@t", options={"device": "cuda:0", "device_id": "gpu0"}
        )
    )
    state = agent.initial_state()
    assert isinstance(state, CounterState)
    for rec in (
        _profiled("a", 1.5),
        _profiled("b", 1.2),
        _profiled("c", 3.0, flags=("timer_disagreement: x",)),
        _profiled("d", 9.0, device="gpu1"),
        _profiled("e", 2.0),
    ):
        state = agent.evolve(state, rec)
    assert isinstance(state, CounterState)
    assert state.new_bests == {"a", "e"}
    assert state.best == {"t": 2.0}
    monkeypatch.setenv("KF_NCU", "0")
    assert asyncio.run(agent.react(state, _profiled("a", 1.5))) == ()


EVAL_TASK = ROOT / "tests" / "fixtures" / "eval" / "task_gelu.py"


def _collector(device: str, device_id: str, started: RunStarted, *rest: Event) -> Any:
    """A counter collector of ``device`` that folded ``started`` and ``rest``, and its state."""
    agent = CounterCollector(
        AgentContext(
            run_id="r", agent_id="counters@t", options={"device": device, "device_id": device_id}
        )
    )
    state = agent.initial_state()
    for ev in (started, *rest):
        state = agent.evolve(state, _rec(ev))
    return agent, state


def _started(task_path: Path, config: dict[str, Any], seed: int = 0) -> RunStarted:
    task = load_task(task_path)
    return RunStarted(
        run_id="r",
        seed=seed,
        config=config,
        tasks=(TaskSpec(name=task.name, source=task.source, sha256=task.sha256),),
    )


def test_collector_grades_at_the_runs_recorded_tolerance_and_conditions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session a collector measures a new best in carries what the run recorded in
    ``run.started`` (seed, tolerance, TF32 and compile mode), not this process's
    settings, which say otherwise; the reference runner it sets up computes under the
    run's TF32."""
    from kf.evaluation.grader.session import Stage

    monkeypatch.setenv("KF_TF32", "off")
    monkeypatch.setenv("KF_COMPILE_MODE", "reduce-overhead")
    recorded = Conditions(compile_mode="max-autotune", tf32="on")
    config = {"atol": 0.02, "rtol": 0.03, **recorded.config()}
    source = (EVAL_TASK.parent / "honest.py").read_text()
    proposed = CandidateProposed(
        candidate_id="k", task="task_gelu", source=source, operator="seed", mutator="test"
    )
    agent, state = _collector("cpu", "cpu0", _started(EVAL_TASK, config, seed=5), proposed)
    found = agent.lookup(state, "task_gelu", "k")
    assert found is not None
    session = agent.grading(state, *found)()
    assert session.seed == 5
    assert (session.tol.atol, session.tol.rtol) == (0.02, 0.03)
    assert session.cond == recorded
    stage = Stage(session)
    with stage.reference_lease():
        setup = stage.setup_reference()
    assert setup.precision is not None and setup.precision["tf32"] == "on"


def test_a_turn_budget_waits_until_its_turns_are_within_their_share() -> None:
    """After 2 s of turns at a share of 0.1 the next waits until 20 s have passed since
    the budget began; turns are counted from inside the session's ``alone``."""
    from agents.counters import TurnBudget

    now = [100.0]
    budget = TurnBudget(0.1, clock=lambda: now[0])
    assert budget.wait_s() == 0.0
    events: list[str] = []

    class Alone:
        def __enter__(self) -> None:
            events.append("turn")
            now[0] += 5.0  # waiting for the turn is not counted

        def __exit__(self, *exc: object) -> None:
            events.append("back")

    with budget.counting(Alone)():
        now[0] += 2.0
    assert events == ["turn", "back"] and budget.held_s == 2.0
    assert budget.wait_s() == pytest.approx(20.0 - 7.0)
    now[0] += 13.0
    assert budget.wait_s() == 0.0


class _PacedCollector(NamedTuple):
    agent: Any
    state: Any
    recs: list[Any]
    measured: list[str]
    first: asyncio.Event  # set as the first measurement ends


def _paced_collector(
    monkeypatch: pytest.MonkeyPatch, share: str, held_s: float,
    bests: Sequence[tuple[str, str, float]],
) -> _PacedCollector:  # fmt: skip
    """A GPU collector at ``KF_COUNTERS_SHARE=share`` that has folded ``bests``
    (candidate, task, speed-up), each a new best; its measurement only counts a turn of
    ``held_s`` (ncu's own run is the GPU tests')."""
    from agents import counters as counters_agent
    from kf.reports import CountersReport

    monkeypatch.setenv("KF_COUNTERS_SHARE", share)
    monkeypatch.setattr(counters_agent, "find_ncu", lambda *a: "/usr/bin/ncu")
    source = (EVAL_TASK.parent / "honest.py").read_text()
    proposed = [
        CandidateProposed(candidate_id=c, task="task_gelu", source=source, operator="seed",
                          mutator="test")
        for c, _, _ in bests
    ]  # fmt: skip
    agent, state = _collector("cuda:0", "gpu0", _started(EVAL_TASK, {}), *proposed)
    measured: list[str] = []
    first = asyncio.Event()

    async def measure(state: Any, ev: CandidateProfiled, task: Any, source: str, budget: Any):
        measured.append(ev.candidate_id)
        budget.held_s += held_s
        first.set()
        return CountersReport(ok=True, device="cuda:0")

    monkeypatch.setattr(agent, "_measure", measure)
    recs = []
    for cid, task, speedup in bests:
        report = ProfileReport(ok=True, speedup=speedup, runtime_ms=1.0)
        rec = _rec(CandidateProfiled(candidate_id=cid, task=task, device_id="gpu0", report=report))
        state = agent.evolve(state, rec)
        recs.append(rec)
    agent.lookup = lambda state, task, cid: (task, source)  # "other" is not a run task here
    return _PacedCollector(agent, state, recs, measured, first)


def test_collector_measures_one_at_a_time_within_its_share_and_skips_overtaken_bests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three new bests of one task and one of another in quick succession: the first is
    measured at once, the others wait for the budget one at a time; the task's second
    best, overtaken by its third while it waited, is not measured."""
    c = _paced_collector(monkeypatch, "0.5", 0.1, (
        ("a", "task_gelu", 1.1), ("b", "task_gelu", 1.2), ("c", "task_gelu", 1.3),
        ("d", "other", 2.0),
    ))  # fmt: skip

    async def main() -> list[Any]:
        return await asyncio.gather(*(c.agent.react(c.state, rec) for rec in c.recs))

    out = asyncio.run(main())
    assert c.measured == ["a", "c", "d"]
    assert [len(o) for o in out] == [1, 0, 1, 1]
    assert all(isinstance(o[0], CountersMeasured) for o in out if o)
    assert c.agent._budget is not None and c.agent._budget.held_s == pytest.approx(0.3)


def test_collector_does_not_hold_the_runs_end_for_bests_waiting_for_their_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two new bests of two tasks: the first is measured, the second waits for the
    collector's share (a minute here); the run's agents drain meanwhile, and the waiting
    best ends at once, unmeasured, rather than holding the run's end for its turn."""
    # the next turn is a minute away at a 1 % share after a turn of 0.6 s
    c = _paced_collector(monkeypatch, "0.01", 0.6, (("a", "task_gelu", 1.5), ("b", "other", 1.5)))
    agent = c.agent

    async def main() -> tuple[list[Any], float]:
        reactions = [asyncio.ensure_future(agent.react(c.state, rec)) for rec in c.recs]
        await asyncio.wait_for(c.first.wait(), 10)
        await asyncio.sleep(0.1)
        assert agent._budget is not None and agent._budget.wait_s() > 30
        assert not reactions[1].done()  # "b" waits for its turn
        began = time.monotonic()
        await agent.on_drain()
        out = await asyncio.wait_for(asyncio.gather(*reactions), 10)
        return out, time.monotonic() - began

    out, drained_s = asyncio.run(main())
    assert c.measured == ["a"]
    assert [len(o) for o in out] == [1, 0]
    assert drained_s < 10  # the wait_for above fails first; the turn was 59 s away


needs_gpu_ncu = pytest.mark.skipif(
    not torch.cuda.is_available() or ncu.find_ncu() is None,
    reason="needs an NVIDIA GPU, a CUDA build of PyTorch and Nsight Compute (CI has none)",
)


@needs_gpu_ncu
def test_counters_of_the_fused_kernel_on_a_gpu() -> None:
    """ncu measures the NVRTC seed's one kernel: it moves about the bytes the task needs
    (two 128 MiB inputs read, one written) at a large share of DRAM bandwidth."""
    report = collect_counters(load_task(TASK), SEED.read_text(), device="cuda:0")
    print(report.error, report.summary, report.network_isolated)
    assert report.ok, report.error
    assert len(report.kernels) == 1
    moved = report.summary["dram_bytes"]
    assert 0.9 * 3 * 128 * 2**20 < moved < 1.3 * 3 * 128 * 2**20
    assert report.summary["dram_throughput_pct"] > 50
    print(os.environ.get("KF_NCU"), report.tool, report.summary, report.network_isolated)


@needs_gpu_ncu
def test_collector_checks_the_output_at_the_runs_recorded_tolerance_on_a_gpu() -> None:
    """Before ncu measures, the collector checks the new best's output at the run's
    recorded tolerance: the NVRTC seed made 0.3 % off is measured in a run of
    atol = rtol = 1e-2 and refused as wrong in a run at the default tolerance."""
    seed = SEED.read_text()
    off = seed.replace(
        "out[i] = o;", "o.x *= 1.003f; o.y *= 1.003f; o.z *= 1.003f; o.w *= 1.003f; out[i] = o;"
    )
    assert off != seed

    def measured(config: dict[str, Any]) -> Any:
        proposed = CandidateProposed(
            candidate_id="k", task="gelu_residual", source=off, operator="seed", mutator="test"
        )
        profiled = CandidateProfiled(
            candidate_id="k",
            task="gelu_residual",
            device_id="gpu0",
            report=ProfileReport(ok=True, speedup=2.0, runtime_ms=1.0),
        )
        agent, state = _collector("cuda:0", "gpu0", _started(TASK, config), proposed)
        rec = _rec(profiled)
        state = agent.evolve(state, rec)
        (ev,) = asyncio.run(agent.react(state, rec))
        assert isinstance(ev, CountersMeasured)
        return ev.report

    loose = measured({"atol": 1e-2, "rtol": 1e-2})
    assert loose.ok, loose.error
    strict = measured({})
    assert not strict.ok and "wrong output under ncu" in (strict.error or ""), strict.error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CI has none)")
def test_an_ncu_that_cannot_start_is_tried_once_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ncu that fails before any candidate code runs (here one that only says its
    installation is missing, as the H200's did in the box) is reported once as unusable;
    the collector then measures no more new bests, each of which would have held the
    device to itself for nothing."""
    broken = tmp_path / "ncu"
    broken.write_text(
        "#!/bin/sh\necho 'ERROR : nsight-compute directory is not found' >&2\nexit 1\n"
    )
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("KF_NCU", str(broken))
    source = SEED.read_text()
    proposed = [
        CandidateProposed(
            candidate_id=c, task="gelu_residual", source=source, operator="seed", mutator="test"
        )
        for c in ("k1", "k2")
    ]
    agent, state = _collector("cuda:0", "gpu0", _started(TASK, {}), *proposed)
    first, second = (
        _rec(
            CandidateProfiled(
                candidate_id=c,
                task="gelu_residual",
                device_id="gpu0",
                report=ProfileReport(ok=True, speedup=s, runtime_ms=1.0),
            )
        )
        for c, s in (("k1", 2.0), ("k2", 3.0))
    )
    for rec in (first, second):
        state = agent.evolve(state, rec)
    (ev,) = asyncio.run(agent.react(state, first))
    assert isinstance(ev, CountersMeasured) and not ev.report.ok
    # (the box may not even reach this fake one: either way it never started a runner)
    assert ev.report.unusable and "during start-up" in (ev.report.error or ""), ev.report
    assert asyncio.run(agent.react(state, second)) == ()


def test_mutation_prompt_carries_the_parents_build_report_and_counters() -> None:
    """What the compiler said (registers, spills) and ncu measured reaches the model."""
    from agents.llm_mutator import build_notes
    from kf.llm.prompts import MutationContext, mutation_messages

    log = (
        "building…\n"
        "kf.cuda: gelu_residual sm_90: 40 registers, 0 bytes smem, 8 bytes spill stores\n"
        "other line\n"
    )
    notes = build_notes(log)
    assert notes == "kf.cuda: gelu_residual sm_90: 40 registers, 0 bytes smem, 8 bytes spill stores"
    assert build_notes("nothing here") is None
    ctx = MutationContext(
        task="t", reference="ref", parent_id="p" * 12, parent_source="src", operator="rewrite",
        regions={}, parent_build=notes,
        parent_counters={"dram_throughput_pct": 91.5, "achieved_occupancy_pct": 88.1},
    )  # fmt: skip
    user = mutation_messages(ctx)[1]["content"]
    assert "8 bytes spill stores" in user
    assert "DRAM throughput % of peak 91.5" in user and "achieved occupancy % 88.1" in user
    bare = mutation_messages(
        MutationContext(
            task="t", reference="r", parent_id="p", parent_source="s", operator="o", regions={}
        )
    )
    assert "hardware counters say" not in bare[1]["content"]
