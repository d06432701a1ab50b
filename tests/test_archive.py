"""The MAP-Elites archive and the offline mutator as pure folds: no server, no clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agents.archive import ArchiveAgent, cell_key
from agents.mutator import OFFLINE_MUTATOR, OfflineMutator
from kf.agent import AgentContext
from kf.events import Event, Record, make_envelope
from kf.facts import DeviceAnnounced, DeviceLost, RunFinished, RunStarted, TaskSpec
from kf.kernels.params import parse
from kf.reports import CompileReport, ProfileReport, VerifyReport
from kf.search_facts import (
    CandidateAssigned,
    CandidateCompiled,
    CandidateProfiled,
    CandidateProposed,
    CandidateRejected,
    CandidateVerified,
    EliteAdmitted,
    MutationFailed,
    ParentSelected,
    TaskSkipped,
)

SEED_SRC = (Path(__file__).parent / "fixtures/search/seeds/scale_relu.py").read_text()
_seq = 0


def rec(ev: Event, eid: str | None = None) -> Record:
    global _seq
    _seq += 1
    env = make_envelope(ev, run_id="r", source="t@x", event_id=eid or f"e{_seq}", seq=_seq)
    return Record(env, ev)


def started(budget: int = 4, tasks: tuple[str, ...] = ("t",), seeds: bool = True, **cfg: Any):
    return RunStarted(
        run_id="r",
        seed=7,
        config={"budget": budget, "islands": 2, "max_in_flight": 2, **cfg},
        tasks=tuple(
            TaskSpec(name=n, source="x", sha256="h", seeds=(("s", SEED_SRC),) if seeds else ())
            for n in tasks
        ),
    )


class Driver:
    """Feeds events to an archive and collects the decisions its react returns."""

    def __init__(self) -> None:
        self.agent = ArchiveAgent(AgentContext(run_id="r", agent_id="archive@t"))
        self.state = self.agent.initial_state()
        self.decisions: list[Event] = []
        self.feed(announce("d"))

    def feed(self, ev: Event) -> list[Event]:
        r = rec(ev)
        self.state = self.agent.evolve(self.state, r)
        out = list(self.agent.react(self.state, r))
        self.decisions.extend(out)
        for d in out:  # decisions are committed too, and folded back
            self.state = self.agent.evolve(self.state, rec(d))
        return out

    def finish(self, cid: str, task: str = "t", speedup: float = 1.5) -> list[Event]:
        c = self.state.candidates[cid]
        where: dict[str, Any] = {"device_id": c.device_id or "?", "attempt": c.attempt}
        self.feed(
            CandidateCompiled(candidate_id=cid, task=task, report=CompileReport(ok=True), **where)
        )
        self.feed(
            CandidateVerified(
                candidate_id=cid, task=task, report=VerifyReport(correct=True, trials=5), **where
            )
        )
        return self.feed(
            CandidateProfiled(
                candidate_id=cid,
                task=task,
                **where,
                report=ProfileReport(
                    ok=True, speedup=speedup, runtime_ms=1.0, ref_runtime_ms=speedup
                ),
            )
        )


def announce(device_id: str, kind: str = "cpu") -> DeviceAnnounced:
    return DeviceAnnounced(
        device_id=device_id, kind=kind, agent_id="hw@x", capabilities={"backends": ["cpp-openmp"]}
    )


def propose(
    cid: str,
    *,
    task: str = "t",
    selection: int | None = None,
    island: int = 0,
    source: str = SEED_SRC,
) -> CandidateProposed:
    return CandidateProposed(
        candidate_id=cid,
        task=task,
        source=source,
        island=island,
        operator="seed" if selection is None else "mutate",
        mutator=OFFLINE_MUTATOR,
        selection=selection,
    )


def test_archive_admits_profiled_seed_and_selects_parents() -> None:
    """A profiled seed becomes an elite and selections fill the in-flight slots."""
    d = Driver()
    d.feed(started())
    d.feed(propose("seed1"))
    out = d.finish("seed1", speedup=1.2)
    admitted = [e for e in out if isinstance(e, EliteAdmitted)]
    selected = [e for e in out if isinstance(e, ParentSelected)]
    assert len(admitted) == 1 and admitted[0].candidate_id == "seed1"
    assert len(selected) == 2 and {s.selection for s in selected} == {0, 1}
    assert all(s.parent_id == "seed1" for s in selected)
    assert cell_key(0, admitted[0].cell) in d.state.tasks["t"].elites


def test_archive_never_exceeds_budget() -> None:
    """Selections stop once seeds plus selections reach the budget, and the run finishes."""
    d = Driver()
    d.feed(started(budget=3))
    d.feed(propose("seed1"))
    d.finish("seed1")
    sels = [e for e in d.decisions if isinstance(e, ParentSelected)]
    assert len(sels) == 2
    for s in sels:
        d.feed(propose(f"c{s.selection}", selection=s.selection, island=s.island))
    d.finish("c0", speedup=2.0)
    assert not any(isinstance(e, RunFinished) for e in d.decisions)
    d.feed(
        CandidateRejected(
            candidate_id="c1",
            task="t",
            device_id="d",
            report=VerifyReport(correct=False, failure_kind="mismatch"),
        )
    )
    assert len([e for e in d.decisions if isinstance(e, ParentSelected)]) == 2
    assert sum(isinstance(e, RunFinished) for e in d.decisions) == 1
    assert d.state.tasks["t"].failed == 1


def test_archive_keeps_the_faster_elite_per_cell() -> None:
    """A slower candidate in an occupied cell is not admitted; a faster one replaces."""
    d = Driver()
    d.feed(started(budget=10))
    d.feed(propose("seed1"))
    d.finish("seed1", speedup=1.5)
    sels = [e for e in d.decisions if isinstance(e, ParentSelected)]
    d.feed(propose("slow", selection=sels[0].selection, island=0))
    out = d.finish("slow", speedup=1.1)
    assert not any(isinstance(e, EliteAdmitted) for e in out)
    d.feed(propose("fast", selection=sels[1].selection, island=0))
    out = d.finish("fast", speedup=3.0)
    adm = [e for e in out if isinstance(e, EliteAdmitted)]
    assert adm and adm[0].replaced == "seed1"


def test_archive_decisions_are_deterministic() -> None:
    """Two archives fed the same events decide exactly the same things."""

    def run() -> list[Event]:
        d = Driver()
        d.feed(started(budget=8))
        d.feed(propose("seed1"))
        d.finish("seed1", speedup=1.3)
        for s in [e for e in d.decisions if isinstance(e, ParentSelected)]:
            d.feed(propose(f"c{s.selection}", selection=s.selection, island=s.island))
            d.finish(f"c{s.selection}", speedup=1.0 + s.selection / 10)
        return d.decisions

    assert run() == run()


def test_archive_skips_task_without_seed_and_llm() -> None:
    """A task with no seed and no LLM is skipped with a reason; the run finishes."""
    d = Driver()
    out = d.feed(started(seeds=False))
    skipped = [e for e in out if isinstance(e, TaskSkipped)]
    assert skipped and "no seed kernel and no LLM" in skipped[0].reason
    assert any(isinstance(e, RunFinished) for e in out)


def test_archive_skips_task_whose_seeds_all_failed() -> None:
    """When every seed fails, the task ends with that reason instead of waiting forever."""
    d = Driver()
    d.feed(started())
    d.feed(propose("seed1"))
    out = d.feed(
        CandidateCompiled(
            candidate_id="seed1",
            task="t",
            device_id="d",
            report=CompileReport(ok=False, error="boom", failure_kind="compile_error"),
        )
    )
    assert any(isinstance(e, TaskSkipped) and "every seed failed" in e.reason for e in out)
    assert any(isinstance(e, RunFinished) for e in out)


def mutated(
    m: OfflineMutator, st: Any, parent_id: str, *, selection: int = 0, island: int = 0, seed: int
) -> tuple[Any, list[Event]]:
    """The offline mutator's state after the archive selects ``parent_id`` to mutate, and
    what it answers."""
    sel = rec(
        ParentSelected(
            task="t", selection=selection, island=island, operator="mutate",
            parent_id=parent_id, rng_seed=seed,
        )
    )  # fmt: skip
    st = m.evolve(st, sel)
    return st, list(m.react(st, sel))


def test_mutator_proposes_seeds_and_honest_mutations() -> None:
    """The offline mutator proposes seeds, then children inside the declared space."""
    m = OfflineMutator(AgentContext(run_id="r", agent_id="mutator@t"))
    st = m.initial_state()
    r = rec(started())
    st = m.evolve(st, r)
    seeds = list(m.react(st, r))
    assert len(seeds) == 1 and isinstance(seeds[0], CandidateProposed)
    assert seeds[0].mutator == OFFLINE_MUTATOR and "no LLM" in seeds[0].mutator
    st = m.evolve(st, rec(seeds[0]))
    st, (child,) = mutated(m, st, seeds[0].candidate_id, island=1, seed=11)
    assert isinstance(child, CandidateProposed)
    parsed = parse(child.source)
    assert parsed is not None
    space, config = parsed
    assert config != parse(SEED_SRC)[1]  # type: ignore[index]
    assert all(config[k] in space.choices(k) for k in space.names)
    assert child.selection == 0 and child.parent_id == seeds[0].candidate_id
    assert child.island == 1


def test_mutator_fails_clearly_on_parent_without_parameters() -> None:
    """A parent with no kf:params block gets a MutationFailed that says why."""
    m = OfflineMutator(AgentContext(run_id="r", agent_id="mutator@t"))
    st = m.initial_state()
    st = m.evolve(st, rec(started()))
    st = m.evolve(st, rec(propose("plain", source="class ModelNew: pass\n")))
    _, (out,) = mutated(m, st, "plain", seed=1)
    assert isinstance(out, MutationFailed) and "no template parameters" in out.reason


def test_archive_routes_candidates_to_matching_live_devices() -> None:
    """Candidates go to the least-loaded live device of their kind; none to a GPU."""
    d = Driver()
    d.feed(announce("e"))
    d.feed(announce("g", kind="cuda"))
    d.feed(started(tasks=("t", "u")))
    d.feed(propose("s1"))
    d.feed(propose("s2", task="u"))
    assigned = [e for e in d.decisions if isinstance(e, CandidateAssigned)]
    assert [(a.candidate_id, a.device_id) for a in assigned] == [("s1", "d"), ("s2", "e")]


def test_archive_waits_for_a_device_before_assigning() -> None:
    """With no matching device announced, a candidate waits; it is assigned on announce."""
    d = Driver()
    d.feed(DeviceLost(device_id="d", silent_s=9.0))
    d.feed(started())
    d.feed(propose("s1"))
    assert not any(isinstance(e, CandidateAssigned) for e in d.decisions)
    out = d.feed(announce("late"))
    assert [
        (a.candidate_id, a.device_id, a.attempt) for a in out if isinstance(a, CandidateAssigned)
    ] == [("s1", "late", 1)]


def test_archive_second_announcement_of_a_device_reassigns_nothing() -> None:
    """A GPU is announced before and again after its measurements: its work stays put."""
    d = Driver()
    d.feed(announce("g"))
    d.feed(started())
    d.feed(propose("s1"))
    d.feed(propose("s2"))
    where = {c: d.state.candidates[c].device_id for c in ("s1", "s2")}
    assert where == {"s1": "d", "s2": "g"}  # the driver's own device "d" and "g" share
    out = d.feed(announce("g"))
    assert not [e for e in out if isinstance(e, CandidateAssigned)]
    assert {c: d.state.candidates[c].device_id for c in ("s1", "s2")} == where
    assert [d.state.candidates[c].attempt for c in ("s1", "s2")] == [1, 1]
    assert d.state.devices["g"].live


def test_archive_redispatches_work_of_a_lost_device_and_counts_it_once() -> None:
    """A lost device's candidate is reassigned; the old device's late result is ignored."""
    d = Driver()
    d.feed(announce("e"))
    d.feed(started())
    d.feed(propose("s1"))  # goes to "d" (ties broken by id)
    out = d.feed(DeviceLost(device_id="d", silent_s=31.0))
    again = [a for a in out if isinstance(a, CandidateAssigned)]
    assert [(a.device_id, a.attempt) for a in again] == [("e", 2)]
    # the lost device wakes up and reports; it no longer counts
    d.feed(
        CandidateCompiled(
            candidate_id="s1",
            task="t",
            device_id="d",
            report=CompileReport(ok=False, error="late", failure_kind="x"),
        )
    )
    assert d.state.candidates["s1"].status == "proposed"
    d.feed(
        CandidateCompiled(
            candidate_id="s1", task="t", device_id="e", attempt=2, report=CompileReport(ok=True)
        )
    )
    assert d.state.candidates["s1"].status == "compiled"
    assert d.state.tasks["t"].compiled == 1


def test_mutator_jumps_when_the_neighbourhood_is_explored() -> None:
    """With every neighbour already proposed, the child is an unexplored point elsewhere."""
    from kf.kernels.params import apply, grid

    m = OfflineMutator(AgentContext(run_id="r", agent_id="mutator@t"))
    st = m.initial_state()
    st = m.evolve(st, rec(started()))
    space, _ = parse(SEED_SRC)  # type: ignore[misc]
    everything = list(grid(space))
    far = everything[-1]
    for i, cfg in enumerate(everything):
        if cfg != far:
            st = m.evolve(st, rec(propose(f"c{i}", source=apply(SEED_SRC, cfg))))
    st, (child,) = mutated(m, st, "c0", seed=5)
    assert isinstance(child, CandidateProposed)
    assert child.operator == "jump" and child.config == far
    st = m.evolve(st, rec(child))
    _, (out,) = mutated(m, st, "c0", selection=1, seed=6)
    assert isinstance(out, MutationFailed) and "already proposed" in out.reason


def _confirming(trusted: list[str] | None, *devices: str) -> Driver:
    d = Driver()  # device "d" announced
    for device in devices:
        d.feed(announce(device))
    d.feed(started(**({} if trusted is None else {"confirm_trusted": trusted})))
    d.feed(propose("seed1"))
    assert d.state.candidates["seed1"].device_id == "d"
    return d


def test_archive_confirms_an_untrusted_devices_result_on_another_device() -> None:
    """A result from a device the run does not trust that would enter the archive is held:
    the candidate runs again on another device, and enters by the lower speed-up; a claim
    more than twice the other measurement is recorded as not confirmed and flagged."""
    from kf.search_facts import CandidateConfirmed, ConfirmationRequested

    for measured, accepted in ((1.5, False), (40.0, True)):
        d = _confirming(["home"], "home")
        out = d.finish("seed1", speedup=50.0)
        (asked,) = [e for e in out if isinstance(e, ConfirmationRequested)]
        assert (asked.claimed_by, asked.claimed_speedup) == ("d", 50.0)
        assert not [e for e in out if isinstance(e, EliteAdmitted)]
        (again,) = [e for e in out if isinstance(e, CandidateAssigned)]
        assert (again.candidate_id, again.device_id, again.attempt) == ("seed1", "home", 2)
        assert d.state.tasks["t"].profiled == 0 and d.state.tasks["t"].compiled == 1
        out = d.finish("seed1", speedup=measured)
        (done,) = [e for e in out if isinstance(e, CandidateConfirmed)]
        assert (done.confirmed_by, done.measured_speedup, done.accepted) == (
            "home",
            measured,
            accepted,
        )
        elites = [e for e in out if isinstance(e, EliteAdmitted)]
        assert [e.speedup for e in elites] == [measured]  # never the claim's 50x
        flags = d.state.candidates["seed1"].flags
        assert any(f.startswith("claim_not_confirmed: d claimed 50.00x") for f in flags) != (
            accepted
        )
        assert d.state.tasks["t"].profiled == 1 and d.state.tasks["t"].compiled == 1


def test_archive_trusts_its_own_device_and_old_logs() -> None:
    """A trusted device's result, and any result in a log without confirm_trusted (as every
    log before issue 34), enters the archive at once."""
    for trusted in (["d"], None):
        d = _confirming(trusted, "home")
        out = d.finish("seed1", speedup=50.0)
        assert [e.speedup for e in out if isinstance(e, EliteAdmitted)] == [50.0]
        assert not [e for e in out if type(e).__name__ == "ConfirmationRequested"]


def test_archive_result_no_other_device_can_confirm_stays_out() -> None:
    """With no device but the claimant, the claim is recorded as unconfirmed and never
    becomes an elite; the run still ends."""
    from kf.search_facts import CandidateConfirmed

    d = _confirming([])
    out = d.finish("seed1", speedup=50.0)
    (done,) = [e for e in out if isinstance(e, CandidateConfirmed)]
    assert done.confirmed_by == "" and not done.accepted and "no live device" in done.reason
    assert not [e for e in out if isinstance(e, EliteAdmitted)]
    assert d.state.candidates["seed1"].suspect
    assert [e for e in out if isinstance(e, (TaskSkipped, RunFinished))]


class Recording(Driver):
    """A driver that keeps every event it was fed and every decision, in log order."""

    def __init__(self) -> None:
        self.log: list[Event] = []
        super().__init__()

    def feed(self, ev: Event) -> list[Event]:
        self.log.append(ev)
        out = super().feed(ev)
        self.log.extend(out)
        return out


def test_archive_forged_counters_change_no_decision_report_or_prompt() -> None:
    """Counters are one device's word and informational: a lying device's counters for its
    own assignment (absurd values, entitled) change none of the archive's decisions and
    nothing of kf report (headline included), and the LLM mutator does not tell the model
    counters of a device the run does not trust (a trusted device's it does)."""
    from agents.llm_mutator import LlmMutator
    from kf.app.report import build_report_from
    from kf.reports import CountersReport
    from kf.search_facts import CountersMeasured

    def counters(device: str) -> CountersMeasured:
        summary = {"dram_throughput_pct": 1e9, "sm_throughput_pct": -5.0, "kernels": 0.0}
        report = CountersReport(ok=True, device="cuda", summary=summary)
        return CountersMeasured(candidate_id="seed1", task="t", device_id=device, report=report)

    reports = []
    for forged in (False, True):
        d = Recording()  # seed1 goes to "d", which the run does not trust; "home" confirms
        d.feed(announce("home"))
        d.feed(started(confirm_trusted=["home"]))
        d.feed(propose("seed1"))
        if forged:
            assert not d.feed(counters("d"))  # no decision
        d.finish("seed1", speedup=50.0)
        d.finish("seed1", speedup=1.5)
        envs = [
            make_envelope(e, run_id="r", source="t@x", event_id=f"x{i}", seq=i + 1)
            for i, e in enumerate(d.log)
        ]
        report = build_report_from(envs)
        report.pop("events")
        report.pop("run_stats")  # wall-clock spans of the envelopes made here
        reports.append(report)
    assert reports[0] == reports[1]
    assert reports[1]["tasks"][0]["best_speedup"] == 1.5  # what "home" measured

    mutator = LlmMutator(AgentContext(run_id="r", agent_id="llm@t"))
    for device, told in (("d", False), ("home", True)):
        st = mutator.initial_state()
        for ev in (started(confirm_trusted=["home"]), propose("seed1"), counters(device)):
            st = mutator.evolve(st, rec(ev))
        assert (st.cands["seed1"].counters is not None) == told
