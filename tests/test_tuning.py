"""Template tuning per shape and device, and its use: the archive's decisions as pure
folds, then one real `kf run` (offline seed and an LLM-written template, through the
scripted server) whose tuned configurations become candidates, replay, the exported
module's dispatch by shape, and the dashboard's tuning table.

The task is tests/fixtures/search/scale_relu.py with one more shape set (8 rows). The
fixture template (tests/fixtures/tuning/seeds/rows_relu.py) is fast only for the row
count its parameters name and repeats its pass 400 times otherwise, so which
configuration is best at each shape is a property of the code, not of timing noise.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from agents import archive_tuning
from agents.mutator import OfflineMutator
from agents.tuned import TUNER_LABEL
from agents.tuner import improvement
from kf.agent import AgentContext
from kf.events import decode_event
from kf.kernels import params
from kf.kernels.params import apply, parse
from kf.kernels.tasks import Task
from kf.kernels.tuning import bind_shape, parse_shape
from kf.llm_facts import ConfigTuned, TuningTrial
from kf.log import EventLog
from kf.search_facts import (
    CandidateProposed,
    EliteAdmitted,
    TunedChosen,
    TuningRequested,
)
from tests.harness import SCALE_RELU, run_kf
from tests.llm_server import ScriptedServer, user_text
from tests.test_archive import SEED_SRC, Driver, announce, propose, rec, started

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = (ROOT / "tests/fixtures/tuning/seeds/rows_relu.py").read_text()
#: the tuning task: SCALE_RELU (relu(x * 2 + b) on 64 x 256) with one more shape set, 8 rows
ROWS_RELU = SCALE_RELU.read_text() + (
    "\n\ndef get_tuning_inputs():\n    return [[torch.randn(8, 256)]]\n"
)


# -- pure parts ------------------------------------------------------------------------------


def test_shape_sets_bind_get_inputs_and_shapes_parse() -> None:
    """Shape set 0 is the task itself; set i rebinds get_inputs to get_tuning_inputs()[i-1]."""
    task = Task.from_source("rows_relu", ROWS_RELU)
    assert bind_shape(task, 0) is task
    bound = bind_shape(task, 1)
    assert "return list(get_tuning_inputs()[0])" in bound.source and bound.sha256 != task.sha256
    assert parse_shape("[[8, 256], []]") == ((8, 256), ())
    assert parse_shape("not a shape") is None and parse_shape("[['a']]") is None


def _trial(ms: float, ci: float) -> TuningTrial:
    return TuningTrial(config={}, ok=True, runtime_ms=ms, runtime_ci95_ms=ci)


def test_improvement_needs_a_margin_beyond_the_noise() -> None:
    """Better in every round and with non-overlapping 95% intervals, or it is not better."""
    assert improvement([_trial(1.0, 0.05), _trial(1.1, 0.05)], [_trial(0.5, 0.02)] * 2)[0]
    overlapping = improvement([_trial(1.0, 0.3)] * 2, [_trial(0.8, 0.2)] * 2)
    assert not overlapping[0] and "not beyond the noise" in overlapping[1]
    assert not improvement([_trial(1.0, 0.0), _trial(0.4, 0.0)], [_trial(0.5, 0.0)] * 2)[0]


def _tuned(index: int, best: dict[str, int], *, last: bool, improved: bool = True) -> ConfigTuned:
    return ConfigTuned(
        task="t",
        candidate_id="s1",
        device_id="d",
        family="f",
        shape_index=index,
        shape=f"[[{64 if index == 0 else 8}, 256]]",
        baseline_config={"UNROLL": 1, "CHUNK": 16, "SIMD": 0},
        best_config=best,
        best_ms=0.1,
        baseline_ms=0.2,
        requested=True,
        last=last,
        improved=improved,
    )


def test_archive_tunes_the_best_kernel_once_the_search_is_spent() -> None:
    """Search version 3: a request per live device once the budget is spent; an improved
    shape set becomes a tuned candidate pinned to the device; one at another shape set is
    evaluated but never an elite or the best; the run ends after all of it."""
    d = Driver()
    d.feed(started(budget=1, search_version=3, tune_budget=8))
    d.feed(propose("s1"))
    out = d.finish("s1", speedup=1.5)
    req = [x for x in out if isinstance(x, TuningRequested)]
    assert [(r.candidate_id, r.device_id, r.budget) for r in req] == [("s1", "d", 8)]
    assert not d.state.finished
    d.feed(_tuned(0, {"UNROLL": 1, "CHUNK": 16, "SIMD": 0}, last=False))  # no better config
    out = d.feed(_tuned(1, {"UNROLL": 4, "CHUNK": 16, "SIMD": 1}, last=True))
    chosen = [x for x in out if isinstance(x, TunedChosen)]
    assert [(c.shape_index, c.config["UNROLL"], c.device_id) for c in chosen] == [(1, 4, "d")]
    assert not d.state.finished  # the chosen candidate is not yet proposed
    m = OfflineMutator(AgentContext(run_id="r", agent_id="mutator@t"))
    st = m.evolve(m.initial_state(), rec(propose("s1")))
    proposal = m.react(st, rec(chosen[0], "chosen-1"))[0]
    assert isinstance(proposal, CandidateProposed)
    assert proposal.operator == "tune" and proposal.mutator == TUNER_LABEL
    assert proposal.shape_index == 1 and proposal.tuned_on == "d"
    assert "UNROLL': 4" in proposal.source or '"UNROLL": 4' in proposal.source
    out = d.feed(announce("e"))  # a second device: it tunes too; the candidate stays on "d"
    assert [(r.device_id, r.candidate_id) for r in out if isinstance(r, TuningRequested)] == [
        ("e", "s1")
    ]
    d.feed(proposal)
    assert d.state.candidates[proposal.candidate_id].device_id == "d"  # pinned, not "e"
    out = d.finish(proposal.candidate_id, speedup=9.0)
    assert not any(isinstance(x, EliteAdmitted) for x in out)
    assert d.state.tasks["t"].elites and all(
        cid == "s1" for cid in d.state.tasks["t"].elites.values()
    )
    assert not d.state.finished  # device "e" has not answered
    d.feed(msgspec.structs.replace(_tuned(0, {}, last=True, improved=False), device_id="e"))
    assert d.state.finished


def _answer(cid: str, index: int, trials: int, best: dict[str, int] | None, *, last: bool):
    """A tuner's answer for ``cid`` at shape set ``index`` that timed ``trials`` configurations
    (improved when ``best`` is given)."""
    base = parse(SEED_SRC)
    assert base is not None
    own = dict(base[1]) if cid == "s1" else {"UNROLL": 2, "CHUNK": 16, "SIMD": 0}
    return msgspec.structs.replace(
        _tuned(index, best or own, last=last, improved=best is not None),
        candidate_id=cid,
        baseline_config=own,
        trials=tuple(_trial(0.1, 0.0) for _ in range(trials)),
    )


def _two_elites(tune_budget: int) -> Driver:
    """Search version 4, a task with two elites (on two islands): s1 (1.5x), c0 (2.0x)."""
    d = Driver()
    d.feed(started(budget=2, search_version=4, tune_budget=tune_budget))
    d.feed(propose("s1"))
    d.finish("s1", speedup=1.5)
    src = apply(SEED_SRC, {"UNROLL": 2, "CHUNK": 16, "SIMD": 0})
    d.feed(propose("c0", selection=0, island=1, source=src))
    return d


def test_every_elite_is_tuned_best_first_within_the_budget() -> None:
    """Version 4: the faster elite is asked first with the whole budget, the other next with
    what the first left; the same tuned candidate is chosen once per device; the run ends
    when both are done; a third request never comes."""
    d = _two_elites(tune_budget=10)
    out = d.finish("c0", speedup=2.0)
    req = [x for x in out if isinstance(x, TuningRequested)]
    assert [(r.candidate_id, r.budget) for r in req] == [("c0", 10)]  # one at a time
    fast = {"UNROLL": 4, "CHUNK": 16, "SIMD": 1}
    d.feed(_answer("c0", 0, 3, None, last=False))
    out = d.feed(_answer("c0", 1, 3, fast, last=True))
    assert [(c.parent_id, c.shape_index) for c in out if isinstance(c, TunedChosen)] == [("c0", 1)]
    req = [x for x in out if isinstance(x, TuningRequested)]
    assert [(r.candidate_id, r.budget) for r in req] == [("s1", 4)]  # 10 less c0's 6
    d.feed(_answer("s1", 0, 2, None, last=False))
    out = d.feed(_answer("s1", 1, 2, fast, last=True))  # same source as c0's: chosen once
    assert not any(isinstance(x, (TunedChosen, TuningRequested)) for x in out)
    assert archive_tuning.spent(d.state, "t", "d") == 10
    assert {r["candidate_id"] for r in archive_tuning.summary(d.state, "t")} == {"c0", "s1"}
    chosen = next(x for x in d.decisions if isinstance(x, TunedChosen))
    m = OfflineMutator(AgentContext(run_id="r", agent_id="mutator@t"))
    st = m.evolve(
        m.initial_state(),
        rec(
            propose(
                "c0", selection=0, source=apply(SEED_SRC, {"UNROLL": 2, "CHUNK": 16, "SIMD": 0})
            )
        ),
    )
    d.feed(m.react(st, rec(chosen, "chosen-c0"))[0])
    assert archive_tuning.open_count(d.state) == 0 and not d.state.finished
    tuned = next(c for c in d.state.candidates.values() if c.operator == "tune")
    d.finish(tuned.id, speedup=9.0)
    assert d.state.finished


def test_the_next_elite_waits_for_enough_budget() -> None:
    """Less than a shape set's minimum left after the first elite: the second is not asked."""
    d = _two_elites(tune_budget=10)
    d.finish("c0", speedup=2.0)
    out = d.feed(_answer("c0", 0, 7, None, last=True))
    assert not any(isinstance(x, TuningRequested) for x in out)
    assert d.state.finished
    assert [r.candidate_id for r in d.decisions if isinstance(r, TuningRequested)] == ["c0"]


def test_version_3_tunes_only_the_best_kernel() -> None:
    """A version-3 log (the same events) still asks once, for the best kernel."""
    d = Driver()
    d.feed(started(budget=2, search_version=3, tune_budget=10))
    d.feed(propose("s1"))
    d.finish("s1", speedup=1.5)
    d.feed(
        propose(
            "c0",
            selection=0,
            island=1,
            source=apply(SEED_SRC, {"UNROLL": 2, "CHUNK": 16, "SIMD": 0}),
        )
    )
    d.finish("c0", speedup=2.0)
    out = d.feed(_answer("c0", 0, 3, None, last=True))
    assert not any(isinstance(x, TuningRequested) for x in out)
    assert [r.candidate_id for r in d.decisions if isinstance(r, TuningRequested)] == ["c0"]
    assert d.state.finished


def test_logs_before_search_version_3_never_tune() -> None:
    """A run config without search version 3 (an older log) decides as it always did."""
    d = Driver()
    d.feed(started(budget=1, search_version=2, tune_budget=8))
    d.feed(propose("s1"))
    out = d.finish("s1")
    assert not any(isinstance(x, TuningRequested) for x in out)
    assert d.state.finished
    assert SEED_SRC  # the fixture template the driver proposes declares a space


def _propose_chosen(d: Driver, chosen: TunedChosen) -> CandidateProposed:
    """The offline mutator's proposal of the tuned candidate ``chosen`` names, fed."""
    m = OfflineMutator(AgentContext(run_id="r", agent_id="mutator@t"))
    st = m.evolve(m.initial_state(), rec(propose("s1")))
    proposal = m.react(st, rec(chosen, f"chosen-{chosen.shape_index}"))[0]
    assert isinstance(proposal, CandidateProposed)
    d.feed(proposal)
    return proposal


def test_a_lying_tuner_raises_no_speedup_and_export_runs_what_another_device_measured() -> None:
    """A tuning answer from a device the run does not trust only chooses which configuration
    to evaluate: the tuned candidates it names run the normal stages on that device, and
    their results are measured again on another device before they count: at the task's own
    shape set (a 77x claim, as any result) and at another shape set (below the bound and in
    no cell, but what kf export dispatches to there). Without the trust list (old logs, or
    KF_TRUSTED_DEVICES=*) the liar's 3x at shape set 1 would have been taken."""
    from kf.app.export import tuned_choices
    from kf.events import make_envelope
    from kf.search_facts import CandidateConfirmed, ConfirmationRequested

    lie = {"device_id": "evil", "best_ms": 1e-6, "baseline_ms": 1.0}
    for trusted in (["d"], None):
        d = Driver()  # device "d": the run's own
        d.feed(announce("evil"))
        d.feed(started(budget=1, search_version=3, tune_budget=8, confirm_trusted=trusted))
        d.feed(propose("s1"))
        assert d.state.candidates["s1"].device_id == "d"
        out = d.finish("s1", speedup=1.5)
        assert {r.device_id for r in out if isinstance(r, TuningRequested)} == {"d", "evil"}
        fast = _tuned(0, {"UNROLL": 4, "CHUNK": 16, "SIMD": 1}, last=False)
        d.feed(msgspec.structs.replace(fast, **lie))
        other = _tuned(1, {"UNROLL": 2, "CHUNK": 64, "SIMD": 1}, last=True)
        out = d.feed(msgspec.structs.replace(other, **lie))
        chosen = [x for x in out if isinstance(x, TunedChosen)]
        assert [(c.shape_index, c.device_id) for c in chosen] == [(0, "evil"), (1, "evil")]
        proposals = [_propose_chosen(d, c) for c in chosen]
        ids = [p.candidate_id for p in proposals]
        assert all(d.state.candidates[i].device_id == "evil" for i in ids)  # tuned there
        asked = [
            e
            for i, claim in zip(ids, (77.0, 3.0), strict=True)
            for e in d.finish(i, speedup=claim)
            if isinstance(e, ConfirmationRequested)
        ]
        envs = [make_envelope(p, run_id="r", source="t@x") for p in proposals]
        if trusted is None:
            assert not asked
            (row,) = tuned_choices(d.state, envs, "t")
            assert row.speedup == 3.0  # the liar's word, dispatched by kf export
            continue
        assert [(a.candidate_id, a.claimed_by) for a in asked] == [(i, "evil") for i in ids]
        assert "shape set 1, which kf export runs there" in asked[1].reason
        assert all(d.state.candidates[i].device_id == "d" for i in ids)  # measured again
        done = [
            e
            for i, measured in zip(ids, (1.2, 1.1), strict=True)
            for e in d.finish(i, speedup=measured)
            if isinstance(e, CandidateConfirmed)
        ]
        assert [(c.confirmed_by, c.accepted) for c in done] == [("d", False), ("d", False)]
        assert [d.state.candidates[i].speedup for i in ids] == [1.2, 1.1]
        admitted = [e.speedup for e in d.decisions if isinstance(e, EliteAdmitted)]
        assert admitted == [1.5], admitted  # the seed's; the tuned 1.2 is not better
        (row,) = tuned_choices(d.state, envs, "t")
        assert (row.candidate_id, row.speedup) == (ids[1], 1.1)  # what "d" measured
        d.feed(_tuned(0, {}, last=True, improved=False))  # the run's own tuner: nothing better
        assert d.state.finished


# -- one real run ----------------------------------------------------------------------------


# another template, slower at every configuration: tuned, its fast path still makes 4
# passes, so the best kernel (which the export's dispatch follows) is always TEMPLATE's
# slower on its fast path by far more than timing noise: a 8 x 256 pass is about a
# microsecond, under the call's own overhead, so 4 passes against 1 was within noise and
# a run under load once ranked this template first at the tuning shape
SLOW = TEMPLATE.replace("fast ? 1 : 400", "fast ? 60 : 800")
assert SLOW != TEMPLATE


class TemplateResponder:
    """Answers with the templated kernel (a reasoning preamble, then code): the second
    request gets a slower template of another family, so the task has two elites; keeps the
    prompts it saw."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.prompts.append(user_text(body))
            code = SLOW if len(self.prompts) == 2 else TEMPLATE
        return {
            "content": "Rows differ in cost, so I expose the fast path as parameters.\n\n"
            f"```python\n{code}```\n"
        }


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Any]:
    """`kf run` on a seedless copy of the task, whose two first kernels (on two islands, so
    both elites) the scripted server writes (the offline path, a seed tuned and proposed by
    the offline mutator, is the unit test above and tests/test_loop.py's run)."""
    tmp = tmp_path_factory.mktemp("tuning")
    tasks = tmp / "tasks"
    tasks.mkdir()
    (tasks / "rows_llm.py").write_text(ROWS_RELU)  # no seed: the LLM writes it
    db = tmp / "run.db"
    responder = TemplateResponder()
    with ScriptedServer(responder=responder) as server:
        proc = run_kf(
            "run", str(tasks), "--llm-url", server.url, "--model", "scripted", "--budget", "2",
            "--init", "2", "--tune-budget", "24", "--seed", "2", "--db", str(db), "--json",
            timeout=500,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return db, json.loads(proc.stdout), responder


def _events(db: Path, tag: str) -> list[Any]:
    with EventLog(db, readonly=True) as elog:
        return [decode_event(e) for e in elog.read(types=[tag])]


def test_an_llm_written_template_is_tuned_per_shape_and_device(tuned_run: Any) -> None:
    """A kernel the LLM wrote with a declared space is tuned like a seed: at the task's own
    shape and at its tuning shape, on the run's device; the prompt explained kf:params."""
    db, report, responder = tuned_run
    assert any("kf then tunes CONFIG for each input shape" in p for p in responder.prompts)
    proposed = {c.candidate_id: c for c in _events(db, "kernel.candidate_proposed")}
    first = _events(db, "search.tuning_requested")[0].candidate_id  # tuned with the most budget
    tuned = _events(db, "tuning.config_tuned")
    devices = {d.device_id for d in _events(db, "device.announced")}
    mine = [t for t in tuned if t.task == "rows_llm" and t.candidate_id == first]
    assert sorted(t.shape for t in mine) == ["[[64, 256]]", "[[8, 256]]"], mine
    assert {t.device_id for t in mine} <= devices and mine[-1].last
    assert proposed[first].operator == "init"
    best = {t.shape: t.best_config for t in mine}
    assert best["[[8, 256]]"]["FAST_8"] == 1 and best["[[64, 256]]"]["FAST_64"] == 1
    entry = next(t for t in report["tasks"] if t["task"] == "rows_llm")
    rows = {r["shape"]: r for r in entry["tuning"] if r["candidate_id"] == first}
    assert rows["[[8, 256]]"]["tuned_status"] == "profiled"


def test_both_elites_are_tuned_within_the_task_budget(tuned_run: Any) -> None:
    """Search version 4: the elite with the higher recorded speed-up is tuned first with the
    whole --tune-budget, the other next with what is left; the tuner's timings never exceed
    the budget."""
    db, _, _ = tuned_run
    proposed = {c.candidate_id: c for c in _events(db, "kernel.candidate_proposed")}
    speedup = {p.candidate_id: p.report.speedup for p in _events(db, "kernel.candidate_profiled")}
    asked = _events(db, "search.tuning_requested")
    assert len(asked) == 2
    families = {params.family(proposed[a.candidate_id].source) for a in asked}
    assert families == {params.family(TEMPLATE), params.family(SLOW)}
    assert {proposed[a.candidate_id].operator for a in asked} == {"init"}
    assert speedup[asked[0].candidate_id] >= speedup[asked[1].candidate_id]
    assert asked[0].budget == 24
    tuned = _events(db, "tuning.config_tuned")
    spent = {a.candidate_id: sum(len(t.trials) for t in tuned if t.candidate_id == a.candidate_id)
             for a in asked}  # fmt: skip
    assert asked[1].budget == 24 - spent[asked[0].candidate_id] >= 4
    assert spent[asked[1].candidate_id] <= asked[1].budget
    second = [t for t in tuned if t.candidate_id == asked[1].candidate_id]
    assert [t.shape_index for t in second] == [0, 1] and second[-1].last


def test_tuned_configurations_are_candidates_measured_like_any_other(tuned_run: Any) -> None:
    """Each improved shape set's configuration was proposed (operator tune), compiled,
    verified and profiled at its shapes on the device it was tuned on."""
    db, _, _ = tuned_run
    tunes = [c for c in _events(db, "kernel.candidate_proposed") if c.operator == "tune"]
    assert {(c.task, c.shape_index) for c in tunes} == {("rows_llm", 0), ("rows_llm", 1)}
    assigned = {a.candidate_id: a.device_id for a in _events(db, "search.candidate_assigned")}
    profiled = {p.candidate_id: p for p in _events(db, "kernel.candidate_profiled")}
    verified = {v.candidate_id for v in _events(db, "kernel.candidate_verified")}
    for c in tunes:
        assert assigned[c.candidate_id] == c.tuned_on
        assert c.candidate_id in verified and profiled[c.candidate_id].report.ok
    proc = run_kf("replay", str(db), "--check", "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check = json.loads(proc.stdout)["check"]
    assert check["ok"] is True and check["decisions_checked"] > 0


def test_export_dispatches_by_shape(tuned_run: Any, tmp_path: Path) -> None:
    """The exported module names its choice per shape in its source, and a call at the
    tuning shape runs the tuned configuration while the task's own shape runs the default;
    both agree with the reference."""
    db, _, _ = tuned_run
    out = tmp_path / "fast_rows.py"
    proc = run_kf("export", str(db), "-o", str(out), "--task", "rows_llm")
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "('cpu', ((8, 256),)): {'FAST_8': 1" in text
    fast = {c.candidate_id for c in _events(db, "kernel.candidate_proposed")
            if params.family(c.source) == params.family(TEMPLATE)}  # fmt: skip
    rows = re.findall(r"# candidate (\S+), tuned on", text)
    assert rows and set(rows) <= fast  # never a configuration tuned for the other template
    spec = importlib.util.spec_from_file_location("fast_rows", out)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fast_rows"] = module
    spec.loader.exec_module(module)
    ref_spec = importlib.util.spec_from_file_location("rows_ref", db.parent / "tasks/rows_llm.py")
    assert ref_spec is not None and ref_spec.loader is not None
    ref_module = importlib.util.module_from_spec(ref_spec)
    ref_spec.loader.exec_module(ref_module)
    model, ref = module.ModelNew(256), ref_module.Model(256)
    assert list(model.state_dict()) == list(ref.state_dict())
    model.load_state_dict(ref.state_dict())
    small, own = torch.randn(8, 256), torch.randn(64, 256)
    assert model.choose(small)["FAST_8"] == 1
    assert model.choose(own) is None  # the default
    for x in (small, own, torch.randn(3, 256)):
        torch.testing.assert_close(model(x), ref(x))


async def test_dashboard_shows_the_tuned_configuration_per_shape(
    tuned_run: Any, tmp_path: Path
) -> None:
    """The dashboard's tuning table has a row per task, shape and device with the tuned
    configuration (in a real headless Chromium)."""
    from tests.test_dashboard import CHROMIUM, chromium, copy_log, dashboard

    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (scripts/bootstrap installs it)")
    db = copy_log(tuned_run[0], tmp_path / "run.db")

    async with dashboard(db) as url, chromium(tmp_path) as page:
        await page.goto(url)
        await page.wait_for("document.querySelectorAll('#tuning tr.tuning-row').length >= 2")
        rows: list[list[str]] = await page.eval(
            "[...document.querySelectorAll('#tuning tr.tuning-row')].map(r => ["
            "r.closest('.tuning-task').dataset.task, r.dataset.device, r.dataset.shape, "
            "r.querySelector('.tuned-config').textContent, r.dataset.elite])"
        )
        await page.screenshot("tuning")
        assert page.errors == []
    first = _events(tuned_run[0], "search.tuning_requested")[0].candidate_id
    small = {r[0]: r[3] for r in rows if r[2] == "[[8, 256]]" and r[4] == first}
    assert set(small) == {"rows_llm"}
    assert all("FAST_8=1" in v for v in small.values())
    assert all(r[1] and r[4] for r in rows)  # every row names its device and its elite
    assert len({r[4] for r in rows}) == 2  # both elites


def test_tuning_line_says_when_the_candidates_own_configuration_was_fastest() -> None:
    """The report's tuning line says the tuner found nothing faster than the candidate's
    own configuration when that was the fastest it timed, rather than comparing that
    configuration with itself; another configuration is named with both times, and the
    noise verdict stays."""
    from kf.app.report import _tuning_line

    own = {"VEC_WIDTH": 512, "THREADS": 2}
    s = {
        "device_id": "cpu0",
        "shape": "[[8, 4096]]",
        "baseline_config": dict(own),
        "best_config": dict(own),
        "best_ms": 0.0607,
        "baseline_ms": 0.0607,
        "improved": False,
    }
    line = _tuning_line("gelu_bias", s)
    assert "vs own" not in line, line
    assert "nothing faster than its own configuration" in line and "0.0607 ms" in line, line
    other = {**s, "best_config": {"VEC_WIDTH": 256, "THREADS": 2}, "best_ms": 0.05}
    line = _tuning_line("gelu_bias", other)
    assert "{'VEC_WIDTH': 256, 'THREADS': 2} 0.0500 ms vs own 0.0607 ms" in line, line
    assert line.endswith("not beyond the noise: no candidate"), line
