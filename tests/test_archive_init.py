"""First generations, languages and routing in the archive (search version 2), as pure folds."""

from __future__ import annotations

from typing import Any

from agents.archive import ArchiveAgent
from kf.agent import AgentContext
from kf.events import Event
from kf.facts import DeviceAnnounced, RunStarted, TaskSpec
from kf.reports import CompileReport
from kf.search_facts import (
    CandidateAssigned,
    CandidateCompiled,
    CandidateProposed,
    CandidateUnroutable,
    ParentSelected,
    TaskSkipped,
)
from tests.test_archive import SEED_SRC, rec

CUDA_SRC = "from torch.utils.cpp_extension import load_inline\nclass ModelNew: pass\n"
TRITON_SRC = "import triton\nclass ModelNew: pass\n"


def start(seeds: bool = False, device: str = "cuda:0", **cfg: Any) -> RunStarted:
    config = {
        "budget": 8,
        "islands": 2,
        "max_in_flight": 4,
        "llm": True,
        "search_version": 2,
        "init": 3,
        "device": device,
        **cfg,
    }
    spec = TaskSpec(name="t", source="x", sha256="h", seeds=(("s", SEED_SRC),) if seeds else ())
    return RunStarted(run_id="r", seed=7, config=config, tasks=(spec,))


def gpu(backends: tuple[str, ...] = ("cuda-nvrtc", "cuda-load-inline", "triton")) -> Event:
    return DeviceAnnounced(
        device_id="h/cuda:0", kind="cuda", agent_id="hw@x", capabilities={"backends": backends}
    )


class Driver:
    """Feeds events and folds the decisions back, as the archivist does."""

    def __init__(self) -> None:
        self.agent = ArchiveAgent(AgentContext(run_id="r", agent_id="archive@t"))
        self.state = self.agent.initial_state()
        self.decisions: list[Event] = []

    def feed(self, ev: Event) -> list[Event]:
        r = rec(ev)
        self.state = self.agent.evolve(self.state, r)
        out = list(self.agent.react(self.state, r))
        self.decisions.extend(out)
        for d in out:
            self.state = self.agent.evolve(self.state, rec(d))
        return out

    def inits(self) -> list[ParentSelected]:
        return [d for d in self.decisions if isinstance(d, ParentSelected) and d.operator == "init"]


def test_archive_first_generation_waits_for_a_device_then_covers_both_gpu_languages() -> None:
    """No init selection before a device is live; then --init of them, in CUDA and Triton."""
    d = Driver()
    d.feed(start())
    assert d.inits() == []
    d.feed(gpu())
    inits = d.inits()
    assert len(inits) == 3 and all(s.parent_id == "" and not s.evidence for s in inits)
    assert {s.language for s in inits} == {"cuda", "triton"}


def test_archive_languages_are_limited_to_what_the_device_serves() -> None:
    """A GPU without Triton gets only CUDA first kernels."""
    d = Driver()
    d.feed(start())
    d.feed(gpu(("cuda-nvrtc", "cuda-load-inline")))
    assert {s.language for s in d.inits()} == {"cuda"}


def test_archive_skips_a_task_whose_languages_no_device_runs() -> None:
    """Asking for Triton on a GPU that serves none skips the task with that reason."""
    d = Driver()
    d.feed(start(languages=["triton"]))
    d.feed(gpu(("cuda-load-inline",)))
    skipped = [x for x in d.decisions if isinstance(x, TaskSkipped)]
    assert skipped and "languages asked for (triton)" in skipped[0].reason
    assert d.inits() == []


def test_archive_retry_round_carries_the_failed_first_candidates() -> None:
    """When every first kernel failed, a new round names them as evidence."""
    d = Driver()
    d.feed(start(budget=6))
    d.feed(gpu())
    first = d.inits()
    for i, s in enumerate(first):
        d.feed(
            CandidateProposed(
                candidate_id=f"c{i}", task="t", source=CUDA_SRC + f"# {i}\n", operator="init",
                mutator="llm", selection=s.selection, device="cuda:0",
            )
        )  # fmt: skip
    for a in [x for x in d.decisions if isinstance(x, CandidateAssigned)]:
        d.feed(
            CandidateCompiled(
                candidate_id=a.candidate_id, task="t", device_id=a.device_id, attempt=a.attempt,
                report=CompileReport(ok=False, error="boom", failure_kind="compile_error"),
            )
        )  # fmt: skip
    retry = d.inits()[3:]
    assert len(retry) == 3
    assert all(set(s.evidence) == {"c0", "c1", "c2"} for s in retry)


def test_archive_backend_is_derived_from_the_source_and_an_unrunnable_candidate_ends() -> None:
    """The proposer's backend field is ignored; a Triton kernel on a GPU without Triton
    ends as unroutable with the reason instead of waiting."""
    d = Driver()
    d.feed(start(seeds=True, init=0))  # the task waits for its seed's proposal
    d.feed(gpu(("cuda-load-inline",)))
    d.feed(
        CandidateProposed(
            candidate_id="k", task="t", source=TRITON_SRC, operator="seed", mutator="x",
            device="cuda:0", backend="cpp-openmp",
        )
    )  # fmt: skip
    gone = [x for x in d.decisions if isinstance(x, CandidateUnroutable)]
    assert len(gone) == 1 and gone[0].backend == "triton"
    assert "no live cuda device runs backend triton" in gone[0].reason
    assert d.state.candidates["k"].status == "failed"


def test_archive_init_with_seeds_writes_a_first_generation_beside_them() -> None:
    """With --init-with-seeds a seeded task also gets init selections; without, none."""
    for flag, expected in ((True, 3), (False, 0)):
        d = Driver()
        d.feed(start(seeds=True, init_with_seeds=flag, device="cpu"))
        d.feed(
            DeviceAnnounced(
                device_id="h/cpu", kind="cpu", agent_id="hw@x",
                capabilities={"backends": ["cpp-openmp"]},
            )
        )  # fmt: skip
        assert len(d.inits()) == expected
        assert {s.language for s in d.inits()} <= {"cpp"}


def test_archive_version_1_logs_decide_as_before() -> None:
    """A log without search_version: a seedless LLM task gets no first generation."""
    d = Driver()
    cfg = start()
    d.feed(RunStarted(run_id="r", seed=7, tasks=cfg.tasks, config={
        k: v for k, v in cfg.config.items() if k not in ("search_version", "init")
    }))  # fmt: skip
    d.feed(gpu())
    assert d.inits() == []
