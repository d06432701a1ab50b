"""Agents that test before they answer: tool-using episodes, coding-agent CLIs as
mutators, where their tools run, and a mixed population end to end.

The model is tests/llm_server.py's *scripted* server (model name ``scripted``; it plays
answers kf's developers wrote) and the coding agent is tests/fixtures/agents/fake_agent.py
(a script); tools run for real, in kf's sandboxed runners.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from agents.cli_mutator import CliSpec, run_cli_episode
from agents.prompt_evolver import PromptEvolver
from agents.tool_mutator import Elite, EpisodeSpec, run_episode
from agents.tool_server import BusTools, ToolServer
from kf import bus
from kf.agent import AgentContext
from kf.auth import RunCredentials
from kf.evaluation.grader.baseline_settings import Conditions
from kf.events import Record, make_envelope
from kf.facts import RunStarted, TaskSpec
from kf.kernels.tasks import load_task
from kf.llm.budget import Pricing
from kf.llm.cli import add_llm_options, llm_config, parse_mutators
from kf.llm.client import CallOutcome, ClientSettings, LlmClient
from kf.llm.prompts import Prompt
from kf.llm.tools import ToolLimits, ToolReply, run_device_tool, tool_specs
from kf.llm_facts import EpisodeEnded, LlmCalled, LlmToolCall, ToolCalled
from kf.log import EventLog
from kf.runtime import Outbox
from kf.search_facts import ParentSelected
from tests.harness import (
    SCALE_RELU,
    archivist,
    logged,
    run_kf,
    scripted_llm_run,
    seedless_scale_relu,
)
from tests.llm_server import ScriptedServer
from tests.scripted_answers import ToolEpisodeResponder, cpp_variant

ROOT = Path(__file__).resolve().parent.parent
TASK = SCALE_RELU
FAKE_AGENT = f"{sys.executable} {ROOT / 'tests/fixtures/agents/fake_agent.py'}"
PROMPT = Prompt(
    messages=[
        {"role": "system", "content": "You write fast kernels."},
        {"role": "user", "content": "Write a first, exactly correct kernel for scale_relu."},
    ],
    tokens=20,
)


async def local_tool(name: str, source: str) -> ToolReply:
    """The device tools run here, in kf's sandboxed runners on this machine's CPU."""
    return await asyncio.to_thread(
        run_device_tool, name, "scale_relu", TASK.read_text(), source, device="cpu", seed=0
    )


def caller(client: LlmClient) -> Any:
    async def call(
        conv: list[dict[str, Any]], new: list[dict[str, Any]], turn: int, tools: Any
    ) -> tuple[LlmCalled, CallOutcome]:
        out = await client.chat("scripted", conv, tools)
        called = LlmCalled(
            call_id=f"turn-{turn}",
            purpose="init",
            model="scripted",
            base_url=client.settings.base_url,
            response=out.response,
            error=out.error,
            turn=turn,
            tool_calls=tuple(LlmToolCall(id=i, name=n, arguments=a) for i, n, a in out.tool_calls),
        )
        return called, out

    return call


def client_for(url: str) -> LlmClient:
    return LlmClient(ClientSettings(base_url=url, max_retries=0, pricing=Pricing()))


def spec(limits: ToolLimits | None = None, elites: dict[str, Elite] | None = None) -> EpisodeSpec:
    return EpisodeSpec(
        episode="ep-1",
        task="scale_relu",
        selection=0,
        model="scripted",
        prompt=PROMPT,
        parent=None,
        limits=limits or ToolLimits(),
        tools=tool_specs(gpu=False),
        elites=elites or {},
    )


def episode(episode_spec: EpisodeSpec, **server: Any) -> Any:
    """One tool episode of ``episode_spec`` against a scripted server made with ``server``
    (a ``responder`` or a ``script``), its tools run here."""

    async def go() -> Any:
        with ScriptedServer(**server) as scripted:
            client = client_for(scripted.url)
            try:
                return await run_episode(episode_spec, caller(client), local_tool)
            finally:
                await client.close()

    return asyncio.run(go())


def test_tool_episode_sees_a_compile_error_fixes_it_checks_and_answers() -> None:
    """The scripted model compiles a broken module, is shown the compiler's error, checks
    the fixed module (correct, in the sandbox) and answers with it; every turn and tool
    result is recorded."""
    responder = ToolEpisodeResponder()
    result = episode(spec(), responder=responder)
    calls = [e for e in result.events if isinstance(e, LlmCalled)]
    tools = [e for e in result.events if isinstance(e, ToolCalled)]
    assert [c.tool_calls[0].name if c.tool_calls else "" for c in calls] == ["compile", "check", ""]
    assert [(t.tool, t.ok) for t in tools] == [("compile", False), ("check", True)]
    assert "xs" in tools[0].result and "failed to build" in tools[0].result
    assert tools[1].result.startswith("correct")
    assert result.ended is not None and result.ended.ended == "answered"
    assert (result.ended.turns, result.ended.tool_calls) == (3, 2)
    assert result.source is not None and "xs[r" not in result.source
    # the model was shown the compile error before it checked
    assert "failed to build" in responder.episodes[1][0]


def test_tool_episode_malformed_call_is_recorded_with_its_cause() -> None:
    """A tool call whose arguments are not JSON ends the episode, recorded as malformed."""
    script = [{"tool_calls": [{"name": "compile", "arguments": '{"source": "x'}]}]
    result = episode(spec(), script=script)
    assert result.source is None and result.ended is not None
    assert result.ended.ended == "malformed" and "not JSON" in result.ended.cause
    (tool,) = [e for e in result.events if isinstance(e, ToolCalled)]
    assert tool.error is not None and tool.arguments == '{"source": "x'
    assert "malformed" in result.reason


def test_tool_episode_stops_at_its_tool_call_limit() -> None:
    """With a limit of one tool call, a turn asking for two is cut short after the first
    (``show_elite``, answered from the log), and the cause says which limit."""
    elites = {"e1": Elite(id="e1", source=cpp_variant(16), speedup=1.5, cell=(1, 1, 1))}
    script = [
        {"tool_calls": [{"name": "show_elite", "arguments": {"id": "e1"}}] * 2},
    ]
    result = episode(spec(ToolLimits(tool_calls=1), elites), script=script)
    assert result.ended is not None and result.ended.ended == "limit"
    assert result.ended.cause == "tool calls: all 1 made"
    (tool,) = [e for e in result.events if isinstance(e, ToolCalled)]
    assert tool.tool == "show_elite" and "1.500x" in tool.result and "CHUNK" in tool.result


def test_cli_agent_leaves_a_candidate_its_check_passed() -> None:
    """The fake agent's first ./check fails (it does not build), its second passes; kf
    takes model_new.py, and records both checks, the transcript and the files left."""

    def cli(template: str, timeout_s: float = 120.0) -> Any:
        return asyncio.run(
            run_cli_episode(
                CliSpec(
                    episode="cli-1",
                    task="scale_relu",
                    selection=3,
                    template=template,
                    timeout_s=timeout_s,
                    prompt=PROMPT,
                    reference=TASK.read_text(),
                ),
                local_tool,
            )
        )

    result = cli(FAKE_AGENT)
    tools = [e for e in result.events if isinstance(e, ToolCalled)]
    assert [(t.tool, t.ok) for t in tools] == [("check", False), ("check", True)]
    assert "failed to build" in tools[0].result
    end = result.ended
    assert end is not None and end.ended == "answered" and end.exit_code == 0
    assert "second check exited 0" in end.transcript and end.files == ("model_new.py", "notes.txt")
    assert end.command == FAKE_AGENT
    assert result.source is not None and "xs[r" not in result.source

    slow = cli("sleep 30", timeout_s=0.5)
    assert slow.source is None and slow.ended is not None and slow.ended.ended == "limit"
    assert "ran past 0.5 s" in slow.ended.cause


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_llm_options(p)
    return p.parse_args(["--llm-url", "http://x/v1", "--model", "m", *argv])


def test_mutators_options_become_run_config_or_a_clear_error() -> None:
    """--mutators weights and --agent-cmd land in the run config; bad input is refused."""
    assert parse_mutators("single=2,tools=1") == [("single", 2.0), ("tools", 1.0)]
    cfg = llm_config(_args("--mutators", "single=1,cli=1", "--agent-cmd", "my-agent {dir}"))
    assert isinstance(cfg, dict)
    assert cfg["mutator_weights"] == [["single", 1.0], ["cli", 1.0]]
    assert cfg["agent_cmd"] == "my-agent {dir}" and "agent-cmd: my-agent" in cfg["mutator"]
    assert llm_config(_args())  # no new keys without the options
    assert "mutator_weights" not in llm_config(_args())  # type: ignore[operator]
    assert "needs --agent-cmd" in str(llm_config(_args("--mutators", "cli=1")))
    assert "unknown kind" in str(llm_config(_args("--mutators", "magic=1")))
    only = llm_config(_args("--agent-cmd", "a"))
    assert isinstance(only, dict) and only["mutator_weights"] == [["cli", 1.0]]


def _chosen(config: dict[str, Any]) -> list[str]:
    ev = PromptEvolver(AgentContext(run_id="r", agent_id="pe@t"))
    state = ev.initial_state()
    started = RunStarted(run_id="r", seed=7, config={"llm": True, **config})
    out: list[str] = []
    for i, e in enumerate(
        [started]
        + [
            ParentSelected(
                task="t",
                selection=n,
                island=0,
                operator="mutate",
                parent_id="p",
                rng_seed=n,
            )
            for n in range(12)
        ]
    ):
        rec = Record(make_envelope(e, run_id="r", source="x", event_id=f"e{i}", seq=i + 1), e)
        state = ev.evolve(state, rec)
        out += [getattr(d, "agent", None) for d in ev.react(state, rec) if d.tag == "prompt.chosen"]
    return out


def test_prompt_evolver_draws_the_mutator_kind_only_when_configured() -> None:
    """With mutator_weights each selection's kind is drawn (the same on every replay);
    without them every choice stays single-shot, as older runs decided."""
    mixed = {"mutator_weights": [["single", 1], ["tools", 1], ["cli", 1]]}
    first = _chosen(mixed)
    assert first == _chosen(mixed)
    assert set(first) == {"", "tools", "cli"}
    assert set(_chosen({})) == {""}
    assert set(_chosen({"mutator_weights": [["tools", 1]]})) == {"tools"}


def started(run_id: str, config: dict[str, Any], task: Path = TASK, seed: int = 0) -> Any:
    """The ``run.started`` envelope of a run of ``task`` with ``config``, as kf run makes it."""
    t = load_task(task)
    ev = RunStarted(
        run_id=run_id,
        seed=seed,
        config={"device": "cpu", **config},
        tasks=(TaskSpec(name=t.name, source=t.source, sha256=t.sha256),),
    )
    return make_envelope(ev, run_id=run_id, source="cli@test")


def test_tools_run_on_the_devices_worker_over_nats_and_answers_cannot_be_forged(
    tmp_path: Path,
) -> None:
    """A proposer's tool request is answered by the worker of the device it names (a
    real compile in its runners); another device's worker may not publish on that
    device's reply subjects, so its forged answer never arrives."""
    run_id = "toolbus"
    creds = RunCredentials.generate(run_id, ["h/cpu", "other/cpu"])
    db = tmp_path / "run.db"
    with EventLog(db) as elog:
        elog.append([started(run_id, {})])

    async def go() -> tuple[ToolReply, ToolReply, bool]:
        server = bus.EmbeddedServer(credentials=creds).start()
        try:
            async with archivist(
                server.url, run_id, db, options=creds.options(server.url, "archivist")
            ):
                return await exchange(server.url)
        finally:
            server.stop()

    async def exchange(url: str) -> tuple[ToolReply, ToolReply, bool]:
        worker = await bus.connect(creds.options(url, "worker", "h/cpu"))
        other = await bus.connect(creds.options(url, "worker", "other/cpu"))
        proposer = await bus.connect(creds.options(url, "proposer"))
        stop, ready = asyncio.Event(), asyncio.Event()
        ts = ToolServer(worker, run_id, "cpu", "h/cpu", timeout_s=120)
        serving = asyncio.create_task(ts.run(stop, ready))
        await ready.wait()
        tools = BusTools(proposer, run_id)
        good = await tools.run(
            "h/cpu", "compile", "scale_relu", TASK.read_text(), cpp_variant(64),
            seed=0, timeout_s=120,
        )  # fmt: skip
        # the other device's worker listens for nothing and publishes a forged answer
        reply_to = bus.tool_reply_subject(run_id, "h/cpu", "forged")
        sub = await proposer.subscribe(reply_to, max_msgs=1)
        await other.publish(reply_to, b"\x80")
        await other.flush()
        try:
            await sub.next_msg(timeout=1.0)
            forged_arrived = True
        except TimeoutError:
            forged_arrived = False
        none = await BusTools(proposer, run_id).run(
            "nobody/cpu", "compile", "t", "", "", seed=0, timeout_s=0.2
        )
        stop.set()
        await serving
        for c in (worker, other, proposer):
            await bus.close(c)
        return good, none, forged_arrived

    good, none, forged = asyncio.run(go())
    assert good.ok and good.ran_on == "h/cpu" and "compiled" in good.text
    assert not forged
    assert not none.ok and none.error == "no responders"


EVAL = ROOT / "tests" / "fixtures" / "eval"
# gelu(x + bias) off by 0.3 %: wrong at KernelBench's default tolerance (1e-4, and the
# float64 rule), right at a run's atol = rtol = 1e-2
OFF_BY_0_3_PERCENT = """
import torch
import torch.nn.functional as F
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.bias = nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x):
        return F.gelu(x + self.bias) * 1.003
"""


def test_tools_grade_at_the_runs_recorded_tolerance_and_conditions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's tools grade at the tolerance and under the TF32 setting its run recorded
    in ``run.started``, read from the archivist, not under the worker process's settings
    (which say TF32 off and have no tolerance): a module 0.3 % off passes ``check`` at the
    run's atol = rtol = 1e-2, and ``time``'s reference runner says it timed under TF32
    on. Before the run has started, a tool request is refused with why, not graded under
    the process's settings; the same check without the run's settings fails."""
    monkeypatch.setenv("KF_TF32", "off")
    task = load_task(EVAL / "task_gelu.py")
    run_id = "toolconds"
    config = {"atol": 1e-2, "rtol": 1e-2, **Conditions(tf32="on", compile_baseline=False).config()}

    async def go() -> tuple[ToolReply, ToolReply, ToolReply]:
        server = bus.EmbeddedServer().start()
        try:
            async with archivist(server.url, run_id, tmp_path / "run.db"):
                nc = await bus.connect(bus.BusOptions(server.url))
                stop, ready = asyncio.Event(), asyncio.Event()
                serving = asyncio.create_task(
                    ToolServer(nc, run_id, "cpu", "h/cpu", timeout_s=120).run(stop, ready)
                )
                await ready.wait()
                tools = BusTools(nc, run_id)

                async def call(tool: str) -> ToolReply:
                    return await tools.run(
                        "h/cpu", tool, task.name, task.source, OFF_BY_0_3_PERCENT,
                        seed=3, timeout_s=120,
                    )  # fmt: skip

                early = await call("check")
                # the run starts as kf run records it: through an outbox to the archivist
                outbox = Outbox(nc, run_id)
                sending = asyncio.create_task(outbox.run())
                outbox.put([started(run_id, config, EVAL / "task_gelu.py", seed=3)])
                assert await outbox.flush(10.0)
                sending.cancel()
                checked, timed = await call("check"), await call("time")
                stop.set()
                await serving
                await bus.close(nc)
                return early, checked, timed
        finally:
            server.stop()

    early, checked, timed = asyncio.run(go())
    assert not early.ok and "has not started" in early.text, early.text
    assert checked.ok, checked.text
    assert "atol 0.01, rtol 0.01" in checked.text
    assert timed.ok, timed.text
    assert timed.summary["tf32"] == "on"
    # what the worker's own settings would have said of the same module
    local = run_device_tool(
        "check", task.name, task.source, OFF_BY_0_3_PERCENT, device="cpu", seed=3
    )
    assert not local.ok and local.summary["failure_kind"], local.text


# -- end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    """`kf run` with single-shot, tool-using and CLI mutators on a seedless CPU task (no
    tuning of their templates after the search: tests/test_tuning.py tunes an LLM-written
    one); the scripted server is stopped when it ends."""
    db = tmp_path_factory.mktemp("mixed") / "run.db"
    task = seedless_scale_relu(db.parent / "tasks")
    report, url = scripted_llm_run(
        ToolEpisodeResponder(), task, db, "--budget", "3", "--init", "3", "--seed", "1",
        "--max-in-flight", "2", "--mutators", "single=1,tools=1,cli=1",
        "--agent-cmd", FAKE_AGENT, "--tune-budget", "0", timeout=500,
    )  # fmt: skip
    return db, report, url


def test_mixed_population_run_compares_its_mutators_and_replays_without_the_server(
    mixed_run: Any,
) -> None:
    """All three kinds wrote correct kernels, honestly labelled; the tool episode saw the
    compile error before it checked; the report compares the kinds; `kf replay --check`
    recomputes every decision with the scripted server stopped."""
    db, report, url = mixed_run
    proposed = logged(db, "kernel.candidate_proposed")
    labels = {p.mutator for p in proposed}
    assert f"llm: scripted via {url}" in labels
    assert f"llm+tools: scripted via {url}" in labels
    assert f"agent-cmd: {FAKE_AGENT}" in labels
    ended: list[EpisodeEnded] = logged(db, "episode.ended")
    assert {e.kind for e in ended} == {"tools", "cli"}
    assert all(e.ended == "answered" for e in ended)
    tools = logged(db, "episode.tool_called")
    by_episode: dict[str, list[ToolCalled]] = {}
    for t in tools:
        by_episode.setdefault(t.episode, []).append(t)
    kinds = {e.episode: e.kind for e in ended}
    tool_eps = [v for k, v in by_episode.items() if kinds.get(k) == "tools"]
    assert any(
        [(t.tool, t.ok) for t in v] == [("compile", False), ("check", True)] for v in tool_eps
    )
    assert all(t.ran_on.endswith("/cpu") for t in tools)
    turns = [c for c in logged(db, "llm.called") if c.episode]
    assert turns and all(c.purpose in ("init", "mutate") for c in turns)
    compared = report["mutators"]
    assert set(compared) == {"single", "tools", "cli"}
    # a kind whose kernel was the same code as another's correct one (comments and spacing
    # aside) is recorded as its duplicate and not run again: that counts as correct here
    kind_of = {"llm:": "single", "llm+tools:": "tools", "agent-cmd:": "cli"}
    kind_by_candidate = {p.candidate_id: kind_of.get(p.mutator.split(" ", 1)[0]) for p in proposed}
    correct_ids = {v.candidate_id for v in logged(db, "kernel.candidate_verified")}
    dup_kinds = {
        kind_by_candidate.get(d.candidate_id)
        for d in logged(db, "search.candidate_duplicate")
        if d.duplicate_of in correct_ids
    }
    assert all(r["correct"] >= 1 or k in dup_kinds for k, r in compared.items()), compared
    assert compared["tools"]["tokens"] > 0 and compared["cli"]["tool_calls"] >= 2
    check = run_kf("replay", str(db), "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "check: ok" in check.stdout
    table = run_kf("report", str(db))
    assert "mutators (per selection's recorded choice):" in table.stdout


# -- on a GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
def test_device_tools_on_a_gpu_compile_check_time_and_counters() -> None:
    """The tools an episode gets on a GPU run the NVRTC seed on cuda:0: it compiles, is
    correct, is timed against eager, and (with ncu) has counters; a broken copy's
    compile shows the compiler's error."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU and a CUDA build of PyTorch (CI has neither)")
    from kf.cuda import ncu

    task = ROOT / "examples/cuda_tasks/gelu_residual.py"
    seed = (ROOT / "examples/cuda_tasks/seeds/gelu_residual.py").read_text()

    def run(tool: str, source: str) -> ToolReply:
        return run_device_tool(
            tool, "gelu_residual", task.read_text(), source, device="cuda:0", seed=0
        )

    assert [t["function"]["name"] for t in tool_specs(gpu=True)] == [
        "compile", "check", "time", "counters", "show_elite",
    ]  # fmt: skip
    assert run("compile", seed).ok
    checked = run("check", seed)
    assert checked.ok and checked.text.startswith("correct"), checked.text
    timed = run("time", seed)
    assert timed.ok and timed.summary["speedup"] > 0, timed.text
    broken = run("compile", seed.replace("__global__", "__global__ not_a_type", 1))
    assert not broken.ok and "failed to build" in broken.text
    if ncu.find_ncu() is not None:
        counted = run("counters", seed)
        assert counted.ok and counted.summary, counted.text
