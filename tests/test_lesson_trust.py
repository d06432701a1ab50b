"""Trust in lessons (issue 48): a control arm for every prompt that quotes lessons, lessons
verified only by a gain beyond the timing noise, counts written back to the library, and
retired when they stop paying. Runs use the scripted model server (tests/llm_server.py,
labelled "scripted": no language model)."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import msgspec

from agents.archive import Cand
from agents.lessons import RETIRE_AFTER, Tally, _outcome, counted
from kf.app.dashboard import RunView
from kf.events import Record, decode_event
from kf.llm.lessons import FENCE, read_library, write_library
from kf.llm_facts import PromptChosen
from kf.log import EventLog
from kf.search_facts import Lesson, LessonCompared
from tests.harness import SCALE_RELU, logged, replay_check, run_kf, scripted_llm_run
from tests.llm_server import user_text

_PARENT = re.compile(r"# Parent kernel[^\n]*\n```python\n(.*?)\n```", re.DOTALL)
_CONFIG = re.compile(r"^CONFIG = \{.*\}$", re.MULTILINE)
_SLOW = "        for _ in range(40):  # scripted: slow\n"
_CALL = "            self.lib.scale_relu(x.data_ptr(), self.bias.data_ptr(), y.data_ptr(), "
_CALL += "x.shape[0], x.shape[1])\n"
HELPFUL, USELESS = "b-helpful", "a-useless"


def _cand(cid: str, status: str, speedup: float = 0.0, std: float = 0.0) -> Cand:
    return Cand(
        id=cid, task="t", island=0, operator="mutate", mutator="scripted", family="",
        status=status, speedup=speedup or None, runtime_ms=1.0 / speedup if speedup else None,
        runtime_std_ms=std / speedup if speedup else None,
    )  # fmt: skip


def test_lesson_comparison_gain_only_beyond_noise() -> None:
    """A 10 % gain counts with 3 % timing noise on each arm, not with 10 %; a correct arm
    beats a failed one; two failed arms gain nothing, and a duplicate ties."""
    fast, slow = _cand("a", "profiled", 1.1, 0.03), _cand("b", "profiled", 1.0, 0.03)
    assert _outcome((1.1, fast), (1.0, slow))[0] == "gain"
    noisy, noisy_b = _cand("a", "profiled", 1.1, 0.1), _cand("b", "profiled", 1.0, 0.1)
    outcome, gain, noise = _outcome((1.1, noisy), (1.0, noisy_b))
    assert outcome == "none" and gain is not None and noise is not None and noise > 0.1
    assert _outcome((1.0, slow), (0.0, _cand("c", "failed")))[0] == "gain"
    assert _outcome((0.0, None), (1.0, slow))[0] == "loss"
    assert _outcome((0.0, None), (0.0, None))[0] == "none"
    assert _outcome((1.0, slow), (1.0, slow)) == ("none", 1.0, 0.0)


def test_lessons_forged_counts_checked_on_read(tmp_path: Path) -> None:
    """A library line that claims ``verified`` with no comparison that gained, or counts
    that cannot be, is read as unverified with its counts made consistent."""
    forged = Lesson(
        lesson_id="forged", kind="improvement", task="t", text="trust me", status="verified",
        comparisons=-3, wins=50, dry=-1, timed=9, gain_sum=1e300, uses=-7,
    )  # fmt: skip
    honest = Lesson(
        lesson_id="honest", kind="improvement", task="t", text="t", status="verified",
        comparisons=3, wins=2, timed=2, gain_sum=3.0,
    )  # fmt: skip
    lib = tmp_path / "lib.jsonl"
    lib.write_bytes(b"".join(msgspec.json.encode(x) + b"\n" for x in (forged, honest)))
    (a, b), refused = read_library(lib)
    assert not refused and a.status == "unverified" and b.status == "verified"
    assert (a.comparisons, a.wins, a.dry, a.timed, a.gain_sum, a.uses) == (0, 0, 0, 0, 0.0, 0)
    assert b.bought == 1.5


def test_lessons_write_back_counts_once_and_retires() -> None:
    """A run's comparisons are folded into a library lesson once (a resumed run's second
    write-back changes nothing), and :data:`RETIRE_AFTER` without a gain retire it."""
    x = Lesson(lesson_id="x", kind="improvement", task="t", text="t", status="verified",
               comparisons=1, wins=1, timed=1, gain_sum=2.0)  # fmt: skip
    compared = [
        LessonCompared(task="t", selection=i, lessons=("x",), candidate_id="a", control_id="b",
                       score=1.0, control_score=1.0, gain=1.0, noise=0.0, outcome="none")
        for i in range(RETIRE_AFTER)
    ]  # fmt: skip
    chosen = PromptChosen(task="t", selection=0, island=0, operator="mutate", parent_id="p",
                          prompt_id="p0", model="m", lessons=("x",), arm="lessons")  # fmt: skip
    once = counted(x, "run-1", [chosen, *compared])
    assert (once.uses, once.comparisons, once.wins, once.dry, once.timed) == (1, 4, 1, 3, 4)
    assert once.bought == (2.0 + RETIRE_AFTER) / 4 and once.counted_runs == ("run-1",)
    assert counted(once, "run-1", [chosen, *compared]) == once
    t = Tally(status="verified", comparisons=1, wins=1)
    for _ in range(RETIRE_AFTER):
        t.count("none", 1.0)
    assert t.dry == RETIRE_AFTER


class ArmResponder:
    """Scripted answers by the lessons a prompt quotes: with the HELPFUL lesson, the parent
    at its best configuration (fast); with the USELESS one, the parent broken (a compile
    error); with no lesson (the control arm) or another one, the parent calling its kernel
    40 times more (slow). Any slowness of the parent is removed first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answers: list[str] = []

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        text = user_text(body)
        parent = _PARENT.search(text)
        if parent is None:
            return {"content": "```\nKeep the inner loop vectorisable.\n```"}
        src = parent.group(1).replace(_SLOW + _CALL, "")
        quoted = "".join(re.findall(r"<<<lesson.*?lesson>>>", text, re.DOTALL))
        if "HELPFUL" in quoted:
            old = _CONFIG.search(src)
            assert old is not None
            new, kind = (
                src.replace(old.group(0), 'CONFIG = {"UNROLL": 4, "CHUNK": 256, "SIMD": 0}'),
                "fast",
            )
        elif "USELESS" in quoted:
            new = src.replace("#include <algorithm>", "#include <algorithm>\n#include <no_such.h>")
            kind = "broken"
        else:
            new, kind = (
                src.replace("        return y\n", _SLOW + _CALL + "        return y\n"),
                "slow",
            )
        with self.lock:
            self.answers.append(kind)
        return {"content": "```python\n" + new + "\n```"}


def _library(path: Path) -> None:
    """A library written by hand, as a team would import one: two unverified lessons."""
    common = {"kind": "improvement", "task": "scale_relu", "device": "cpu",
              "diagnosis_before": "ok"}  # fmt: skip
    write_library(path, [
        Lesson(lesson_id=USELESS, text="Add a header (marker USELESS).", **common),
        Lesson(lesson_id=HELPFUL, text="Widest CHUNK, unroll 4 (marker HELPFUL).", **common),
    ])  # fmt: skip


def test_lessons_control_arm_verifies_and_carries_over(tmp_path: Path) -> None:
    """Run 1 answers each prompt with lessons twice (with and without them): the lesson
    whose arm beat its control beyond the noise is verified, the one whose arm broke stays
    unverified, and the library gets the counts and the failure run 1 learned; run 2's
    prompts quote the verified lesson as verified, its control arm runs, and both runs
    replay with the library gone; the dashboard shows the counts."""
    db1, db2, lib = tmp_path / "r1.db", tmp_path / "r2.db", tmp_path / "lib.jsonl"
    _library(lib)
    args = ("--max-in-flight", "1", "--tune-budget", "0", "--seed", "2", "--budget", "3")
    report, _ = scripted_llm_run(ArmResponder(), SCALE_RELU, db1, "--lessons", str(lib), *args)
    ls = report["lessons"]
    assert (ls["controls"], ls["compared"], ls["verified"]) == (2, 2, 1), ls
    by = {c.lessons: c for c in logged(db1, "lesson.compared")}
    assert by[(USELESS,)].outcome != "gain" and by[(HELPFUL,)].outcome == "gain"
    helped = by[(HELPFUL,)]
    assert helped.gain is not None and helped.noise is not None
    assert helped.gain > 1 + 2 * helped.noise
    assert [v.lesson_id for v in logged(db1, "lesson.verified")] == [HELPFUL]
    assert ls["per_lesson"][HELPFUL]["status"] == "verified"
    assert ls["per_lesson"][HELPFUL]["bought"] == round(helped.gain, 4)
    learned = [e.lesson for e in logged(db1, "lesson.learned")]
    assert any(x.kind == "failure" and "compile_error" in x.text for x in learned), learned
    after = {x.lesson_id: x for x in read_library(lib)[0]}
    assert after[HELPFUL].status == "verified" and after[HELPFUL].wins == 1
    assert after[USELESS].status == "unverified" and after[USELESS].comparisons == 1
    assert after[USELESS].uses == 1 and after[USELESS].wins == 0
    assert {x.lesson_id for x in learned} <= set(after)
    view = RunView()
    with EventLog(db1, readonly=True) as elog:
        for env in elog.read():
            view.feed(Record(env, decode_event(env)))
    shown = view.lessons_view()["lessons"]
    assert shown[HELPFUL]["status"] == "verified" and shown[HELPFUL]["wins"] == 1
    assert shown[USELESS]["status"] == "unverified" and shown[USELESS]["comparisons"] == 1
    proc = run_kf("lessons", "import", str(db1), "--lessons", str(lib))
    assert f"imported 0 lesson(s) from {db1} ({len(learned)} known)" in proc.stdout
    lines = run_kf("lessons", "list", "--lessons", str(lib)).stdout
    assert re.search(rf"{HELPFUL}\s+verified .* used 1, 1/1 comparisons gained, bought", lines)

    report2, _ = scripted_llm_run(ArmResponder(), SCALE_RELU, db2, "--lessons", str(lib), *args)
    assert report2["lessons"]["controls"] >= 1
    chosen = logged(db2, "prompt.chosen")
    assert any(c.arm == "lessons" and c.lessons == (HELPFUL,) for c in chosen)
    assert all((c.arm == "control") == (not c.lessons) for c in chosen)
    prompts = [c.messages[1].content for c in logged(db2, "llm.called") if c.purpose == "mutate"]
    assert sum(FENCE not in p for p in prompts) == sum(c.arm == "control" for c in chosen)
    meta = f'"{HELPFUL} verified, 1 of 1 controlled comparisons gained"'
    assert any(meta in p and "marker HELPFUL" in p for p in prompts)
    for p in prompts:
        for block in re.findall(r"<<<lesson.*?lesson>>>", p, re.DOTALL):
            assert "```" not in block
    lib.unlink()
    for db in (db1, db2):
        assert replay_check(db)["check"]["decisions_checked"] >= 6
