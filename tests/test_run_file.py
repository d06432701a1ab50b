"""``kf run --config FILE``: a TOML file of kf run's options, under the command line's
flags and over the defaults, refused in one line when it is not what kf run takes
(issue 46, item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.archive import ArchiveAgent
from agents.verifier import Verifier
from kf.agent import AgentContext
from kf.app.cli import _run_request, main, parse_args
from kf.app.orchestra import RunOptions, _started
from kf.app.request import RunRequest
from kf.app.run import asked_conditions, run_config
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.wire.tolerance import Tolerance
from kf.events import Record, decode_envelope, decode_event, encode_envelope, make_envelope
from kf.facts import RunStarted
from kf.settings import current

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "run.toml"
TASK = str(ROOT / "tests" / "fixtures" / "search" / "scale_relu.py")


def _request(tmp_path: Path, text: str, *argv: str) -> RunRequest:
    """kf run's request for ``TASK --config FILE *argv``, FILE holding ``text``."""
    path = tmp_path / "run.toml"
    path.write_text(text)
    request = _run_request(parse_args(["run", TASK, "--config", str(path), *argv]))
    assert isinstance(request, RunRequest), request
    return request


def _recorded(request: RunRequest) -> Record:
    """The run.started ``kf run`` records for ``request``, as the log gives it back."""
    asked = asked_conditions(request, current())
    config = run_config(request, [], request.device, [], conditions=asked)
    started = _started("r", [], RunOptions(request=request, config=config), "offline")
    env = make_envelope(started, run_id="r", source="t@x", event_id="e1", seq=1)
    env = decode_envelope(encode_envelope(env))
    return Record(env, decode_event(env))


def test_run_file_options_reach_run_started_and_the_agents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Options given only in the file are recorded in run.started, and the archive and
    the verifier fold them from there (budget, islands, tolerance, TF32, trust)."""
    monkeypatch.delenv("KF_TRUSTED_DEVICES", raising=False)
    monkeypatch.delenv("KF_TF32", raising=False)
    request = _request(
        tmp_path,
        'budget = 3\nislands = 1\nmax-in-flight = 5\natol = 0.01\ntf32 = "on"\n'
        'trust = ["w1/cpu"]\ntune_budget = 0\nno-worker = true\nresume = true\n',
    )
    assert request.resume and not request.local_worker
    record = _recorded(request)
    started = record.event
    assert isinstance(started, RunStarted)
    assert {k: started.config[k] for k in ("budget", "islands", "max_in_flight")} == {
        "budget": 3,
        "islands": 1,
        "max_in_flight": 5,
    }
    assert started.config["atol"] == 0.01 and started.config["tf32"] == "on"
    assert started.config["confirm_trusted"] == ["w1/cpu"] and started.config["tune_budget"] == 0
    archive = ArchiveAgent(AgentContext(run_id="r", agent_id="archive@t"))
    state = archive.evolve(archive.initial_state(), record)
    assert (state.config.budget, state.config.islands, state.config.max_in_flight) == (3, 1, 5)
    assert state.config.confirm_trusted == ["w1/cpu"] and state.config.tune_budget == 0
    verifier = Verifier(AgentContext(run_id="r", agent_id="verifier@t"))
    seen = verifier.evolve(verifier.initial_state(), record)
    assert seen.tolerance == Tolerance(atol=0.01)
    assert seen.conditions.tf32 == "on" and isinstance(seen.conditions, Conditions)


def test_run_file_command_line_beats_the_file(tmp_path: Path) -> None:
    """A flag given on the command line wins over the file (a repeatable one replaces the
    file's list, not adds to it); the file wins over the defaults."""
    text = 'budget = 3\nseed = 9\ntrust = ["a/cpu"]\ntf32 = "on"\nllm-usd-per-mtok = [1, 2.5]\n'
    request = _request(tmp_path, text, "--budget", "5", "--trust", "b/cpu", "--tf32", "off")
    assert (request.budget, request.trust, request.tf32) == (5, ("b/cpu",), "off")
    assert request.seed == 9 and request.islands == 2  # the file's, the default
    assert request.llm == {} and request.tune_budget == 12  # no model: its keys unused
    plain = _request(tmp_path, text)
    assert (plain.budget, plain.trust, plain.tf32) == (3, ("a/cpu",), "on")


def test_run_file_example_is_read_whole(tmp_path: Path) -> None:
    """examples/run.toml, the documented example, is a file kf run takes."""
    request = _request(tmp_path, EXAMPLE.read_text())
    assert request.budget >= 1 and request.device


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (None, "no such file"),
        ("budget = = 3\n", "not TOML"),
        ("budget = 3\nbudgte = 4\n", "unknown key 'budgte' (did you mean 'budget'?)"),
        ('budget = "8"\n', "budget: a string, where --budget takes a whole number"),
        ("atol = true\n", "atol: a boolean, where --atol takes a number"),
        ('tf32 = "maybe"\n', "tf32: 'maybe' is not one of off, on"),
        ('trust = "a/cpu"\n', "trust: a string, where --trust takes a list of strings"),
        ("[search]\nbudget = 3\n", "search: a table, where keys are kf run's flags"),
        ("budget = 3\nmax_in_flight = 2\nmax-in-flight = 4\n", "max-in-flight: given twice"),
        ('config = "other.toml"\n', "unknown key 'config'"),
        ("resume = 1\n", "resume: an integer, where --resume takes true or false"),
    ],
    ids=[
        "missing", "bad-toml", "unknown", "wrong-type", "bool-for-number", "choice",
        "list", "table", "twice", "nested-config", "int-for-bool",
    ],
)  # fmt: skip
def test_run_file_bad_file_is_refused_in_one_line_and_nothing_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, said: str
) -> None:
    """A missing file, bad TOML, an unknown key or a value of the wrong type: one line on
    stderr naming the file (and the key), exit status 2, and no log made."""
    path = tmp_path / "run.toml"
    if text is not None:
        path.write_text(text)
    db = tmp_path / "r.db"
    assert main(["run", TASK, "--config", str(path), "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"kf run: {path}: ") and said in err, err
    assert not db.exists()


def test_run_file_config_is_shown_by_report_and_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the file gave and the run recorded is shown by kf report (JSON and text) and
    kf replay (text and JSON), read back from the log."""
    from kf.kernels.tasks import load_task
    from kf.log import EventLog

    request = _request(tmp_path, 'budget = 3\nislands = 1\ntf32 = "on"\natol = 0.01\n')
    config = run_config(request, [], "cpu", [], conditions=asked_conditions(request, current()))
    options = RunOptions(request=request, config=config)
    started = _started("r-file", [load_task(Path(TASK))], options, "offline")
    db = tmp_path / "r.db"
    with EventLog(db) as elog:
        elog.append([make_envelope(started, run_id="r-file", source="cli@t")])
    assert main(["report", str(db), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["config"]
    assert {k: shown[k] for k in ("budget", "islands", "tf32", "atol")} == {
        "budget": 3, "islands": 1, "tf32": "on", "atol": 0.01,
    }  # fmt: skip
    assert main(["report", str(db)]) == 0
    text = capsys.readouterr().out
    assert "config: budget 3, islands 1," in text and "tf32 on" in text and "atol 0.01" in text
    assert main(["replay", str(db)]) == 0
    assert "config: budget 3, islands 1," in capsys.readouterr().out
    assert main(["replay", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["tf32"] == "on"
