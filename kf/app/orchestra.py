"""``kf run`` and ``kf worker``: start the agents of a run in this process.

``kf run`` starts (or connects to) NATS, the archivist hosting the archive, the mutator
and a worker for the chosen device, publishes ``RunStarted`` with the tasks' sources,
shows progress from the committed log and stops everything cleanly when the archive
decides the run is finished. ``kf worker`` runs just the worker agents (hardware,
compiler, verifier, profiler) for a run started elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import msgspec

from kf import bus
from kf.agent import Agent, AgentContext, make_agent_id
from kf.app.request import RunRequest
from kf.auth import RunBus
from kf.config import RunConfig
from kf.devices.slots import DeviceSlot
from kf.events import Envelope, Event, Record, decode_event, derived_id, make_envelope
from kf.facts import RunFinished, RunStarted, TaskSpec
from kf.fold import fold
from kf.kernels.tasks import Task
from kf.log import EventLog
from kf.runtime import AgentRunner, CommittedFeed, Outbox, supervise
from kf.settings import current
from kf.shutdown import BUS_LOST_S

__all__ = [
    "PartDied",
    "RunOptions",
    "run_search",
    "run_worker",
    "stop_tasks",
    "watch_bus",
    "worker_agents",
]


@dataclass
class RunOptions:
    """The run ``kf run`` composes: what was asked (``request``, :class:`kf.app.RunRequest`)
    and what was resolved from it (:func:`kf.app.prepare_run`)."""

    request: RunRequest
    device: str = "cpu"  # the run's target (the first of ``devices``)
    devices: list[str] = field(default_factory=list)  # the local worker's ([]: ``device``)
    db: Path | None = None  # default runs/<run_id>.db
    run_id: str | None = None  # default a new one
    max_in_flight: int = 2
    measure_device: bool = True
    resuming: bool = False  # the log holds this run already: continue it (kf.app.opening)
    config: RunConfig = field(default_factory=RunConfig)  # recorded in run.started
    # observations made before the run started (the task checks, kf.app.checks), each with
    # the time it was made: recorded right after ``run.started`` (also on resume)
    records: list[tuple[Event, float]] = field(default_factory=list)


def new_run_id() -> str:
    """A readable, unique run id (chosen once, recorded in the log)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def worker_agents(device: str = "cpu", *, devices: int = 1) -> list[type[Agent[Any]]]:
    """The agents a worker process hosts next to each of its devices (``cpu``/``cuda:N``,
    :func:`agents.worker.device_agents`), its runner pool made ready for them.

    For a GPU: the CUDA hardware agent, and a compiler that builds many candidates at
    once on the host's cores while the GPU verifies (two at once) and times others; the
    runner pool keeps warm runners for all of those (``$KF_EVAL_POOL`` overrides). With
    ``devices`` GPUs, each GPU gets its own pool of runners warmed for it
    (:func:`kf.evaluation.grader.pools.configure_runner_pools`, sized by the caller) and
    the compilers share the host's build slots (:mod:`agents.build_pool`).
    """
    from agents.worker import compile_concurrency, device_agents

    if device.startswith("cuda") and devices == 1:
        from kf.evaluation.grader.sandbox import configure_default_pool

        settings = current()
        size = settings.eval_pool
        # idle runners make their CUDA context and load the op tracer before a stage
        # needs them; `kf run` checked its tasks first, which may have made the pool
        from kf.evaluation.grader.pools import gpu_pool_size, kept_runners

        pool_size = gpu_pool_size(device, compile_concurrency(settings) + 4)
        configure_default_pool(
            # as many as fit in the GPU's free memory beside the tasks' tensors
            size=pool_size if size is None else size,
            warm=settings.runner_warm or device,
            # a reference runner per task keeps its compiled baseline (a fresh one
            # compiles it again: 5-15 s of an H200 host's time per profile)
            references=settings.reference_runners or min(16, max(4, pool_size)),
            kept=kept_runners(pool_size),
        )
    return device_agents(device)


def llm_roles(llm: bool) -> tuple[list[Any], Any, list[Any]]:
    """``(hosted decision agents, the mutator, worker-side agents)`` an LLM-driven run
    adds to ``kf run``.

    With an LLM: the prompt evolver (hosted by the archivist) and the LLM mutator instead
    of the offline one. Without: nothing extra and the offline mutator. (The template
    tuner is a worker agent in every run: :func:`worker_agents`.)
    """
    from agents.mutator import OfflineMutator

    if not llm:
        return [], OfflineMutator, []
    from agents.llm_mutator import LlmMutator
    from agents.prompt_evolver import PromptEvolver

    return [PromptEvolver], LlmMutator, []


def prepare_worker(device: str) -> None:
    """Start, before a local worker for ``device`` exists, what it would otherwise wait
    for: on a GPU, the device's description (``kf run`` does this while it checks its
    tasks, so the GPU is announced, and builds for it start, as soon as the run starts).
    Raises :class:`kf.evaluation.DeviceError` for a device this machine lacks. ``device``
    may be a list (:func:`kf.devices.slots.parse_devices`): every GPU of it is described."""
    from kf.devices.slots import parse_devices

    for one in parse_devices(device):  # "cuda" → "cuda:0", as the worker will name it
        if one.startswith("cuda"):
            from hardware_agents.cuda import probe_early

            probe_early(one)


def worker_plan(
    devices: list[str], name: str | None = None
) -> tuple[list[DeviceSlot], list[type[Agent[Any]]]]:
    """The device slots a worker serves (ids as :func:`kf.devices.slots.device_slots` makes
    them) and the agent types each slot gets; sets up the runner pools for them."""
    from hardware_agents.cpu import host_id
    from kf.devices.slots import device_slots
    from kf.evaluation.grader.pools import configure_runner_pools

    slots = device_slots(devices, host_id(), name)
    agents = worker_agents(devices[0], devices=len(devices))
    if devices[0].startswith("cuda"):
        from kf.evaluation.grader import box, inline_writer, pch_prewarm

        if not box.unsafe_requested():  # boxed load_inline builds: the writer writes them
            inline_writer.prewarm()
            # and torch/extension.h's precompiled header is made before the first wave
            pch_prewarm.prewarm(devices[0])
    if devices[0].startswith("cuda") and len(devices) > 1:
        from agents.worker import compile_concurrency

        configure_runner_pools(devices, compile_concurrency())
    return slots, agents


def _runner_factory(
    cls: type[Agent[Any]], run_id: str, nc: Any, options: dict[str, Any]
) -> Callable[[], AgentRunner]:
    agent_id = make_agent_id(cls.kind)
    return lambda: AgentRunner(
        cls(AgentContext(run_id=run_id, agent_id=agent_id, options=dict(options))), nc
    )


async def run_worker(
    run_id: str,
    opts: Any,
    *,
    device: str = "cpu",
    stop: asyncio.Event | None = None,
    options: dict[str, Any] | None = None,
) -> None:
    """Serve a run from this machine's devices until ``stop`` (or SIGINT/SIGTERM).

    ``device`` is a ``--device`` argument: one device, a list or ``cuda:all``; each
    device gets its own hardware agent, compiler, verifier and profiler (one connection
    serves them all). ``options["device_id"]`` (``--name``) names the one device, or
    prefixes the ids of several."""
    from dataclasses import replace

    from kf.auth import password_env, worker_user
    from kf.devices.slots import parse_devices

    devices = parse_devices(device)  # a DeviceError (a ValueError) says what is available
    options = dict(options or {})
    lost_s = float(options.pop("bus_timeout_s", None) or BUS_LOST_S)
    slots, agents = worker_plan(devices, options.pop("device_id", None))
    stop = stop or asyncio.Event()
    nc = await bus.connect(opts)
    conns = {s.device_id: nc for s in slots}
    try:
        if len(slots) > 1:
            # against a role-separated server each device has its own worker user
            # (docs/authorization.md): its password in $KF_NATS_WORKER_<ID>_PASSWORD
            for s in slots:
                password = current().get(password_env("worker", s.device_id))
                if password:
                    conns[s.device_id] = await bus.connect(
                        replace(opts, token=None, user=worker_user(s.device_id), password=password)
                    )
        async with asyncio.TaskGroup() as tg:
            for slot in slots:
                opt = {**options, "device": slot.device, "device_id": slot.device_id}
                for cls in agents:
                    tg.create_task(
                        supervise(
                            _runner_factory(cls, run_id, conns[slot.device_id], opt),
                            stop,
                            name=f"{cls.kind}@{slot.device_id}",
                        )
                    )
                tg.create_task(_tool_server(conns[slot.device_id], run_id, opt).run(stop))
            tg.create_task(watch_bus(list(conns.values()), lost_s, opts.url))
    finally:
        for c in {id(c): c for c in conns.values()}.values():
            await bus.close(c)


def _tool_server(nc: Any, run_id: str, opt: dict[str, Any]) -> Any:
    """The worker's answerer of mutators' tool requests (``agents.tool_server``)."""
    from agents.tool_server import ToolServer
    from kf.evaluation import parse_device

    device = parse_device(str(opt["device"]))
    return ToolServer(
        nc,
        run_id,
        device,
        str(opt.get("device_id", device)),
        timeout_s=float(opt.get("timeout_s", 300.0)),
    )


@dataclass
class Progress:
    """Folds the committed log with the archive's own fold, for the live display."""

    out: TextIO
    total_budget: int
    finished: RunFinished | None = None
    seen: list[Envelope] = field(default_factory=list)
    state: Any = None
    agent: Any = None
    mutation_failures: int = 0

    def __post_init__(self) -> None:
        from agents.archive import ArchiveAgent

        self.agent = ArchiveAgent(AgentContext(run_id="", agent_id="archive@progress"))
        self.state = self.agent.initial_state()

    def feed(self, rec: Record) -> None:
        from kf.facts import DeviceLost
        from kf.search_facts import (
            CandidateCompiled,
            CandidateConfirmed,
            CandidateProfiled,
            CandidateRejected,
            CandidateUnroutable,
            MutationFailed,
            TaskSkipped,
        )

        ev = rec.event
        self.seen.append(rec.envelope)
        before = self._status(getattr(ev, "candidate_id", None))
        self.state = fold([rec], self.agent, self.state)
        if isinstance(ev, RunFinished):
            self.finished = ev
        elif isinstance(ev, TaskSkipped):
            print(f"  {ev.task}: skipped — {ev.reason}", file=self.out, flush=True)
            self._held_note(ev.task)
        elif isinstance(ev, CandidateConfirmed) and not ev.accepted and not ev.confirmed_by:
            print(
                f"  {ev.task}: held unconfirmed — {ev.claimed_speedup:.2f}× claimed by "
                f"{ev.claimed_by}, a device this run does not trust, and no other device "
                f"could measure it again; to take its word, run with --trust {ev.claimed_by}",
                file=self.out,
                flush=True,
            )
        elif isinstance(ev, DeviceLost):
            print(f"  device {ev.device_id} lost: {ev.reason}", file=self.out, flush=True)
        elif isinstance(ev, MutationFailed):
            self.mutation_failures += 1
            self._line(ev)
        elif isinstance(
            ev, (CandidateProfiled, CandidateRejected, CandidateCompiled, CandidateUnroutable)
        ):
            if isinstance(ev, CandidateCompiled) and ev.report.ok:
                return
            if not isinstance(ev, CandidateUnroutable) and self._status(ev.candidate_id) == before:
                return  # a result that changed nothing (a duplicate, a forged or late one)
            self._line(ev)

    def _held_note(self, task: str) -> None:
        """After a skip: the task's results held unconfirmed (not failed), and how to
        take their device's word."""
        held = [
            c
            for c in self.state.candidates.values()
            if c.task == task and any(f.startswith("unconfirmed") for f in c.flags)
        ]
        if held:
            by = sorted({c.claimed_by or "" for c in held})
            print(
                f"  {task}: {len(held)} result(s) held unconfirmed, not failed: only "
                f"{', '.join(by)} measured them, and this run does not take its word; "
                f"kf run --trust {by[0]} does (docs/authorization.md)",
                file=self.out,
                flush=True,
            )

    def _status(self, candidate_id: str | None) -> tuple[str, int, bool] | None:
        c = self.state.candidates.get(candidate_id or "")
        return None if c is None else (c.status, c.attempt, c.confirming)

    def _line(self, ev: Any) -> None:
        from agents.archive import best_candidate

        task = ev.task
        c = self.state.candidates.get(getattr(ev, "candidate_id", ""), None)
        if c is None:
            what = f"mutation failed: {getattr(ev, 'reason', '')}"
        elif c.confirming:  # agents/archive.py: measured again on another device first
            what = (
                f"held     {c.claimed_speedup or 0:.2f}× claimed by {c.claimed_by}, which this "
                f"run does not trust (--trust {c.claimed_by}): measuring again elsewhere"
            )
        elif c.status == "profiled":
            what = f"correct  {c.speedup:6.2f}×  ({c.runtime_ms:.3f} ms vs eager {c.ref_ms:.3f} ms)"
        else:
            what = (
                f"failed   {c.failure}: {(c.error or '').splitlines()[0][:80] if c.error else ''}"
            )
        t = self.state.tasks[task]
        best = best_candidate(self.state, task)
        best_s = f"best {best.speedup:.2f}×" if best is not None and best.speedup else "best —"
        op = c.operator if c is not None else ""
        # budget units used up: finished candidates (seeds, first kernels, children) and
        # selections that produced no candidate; a verdict revised later is counted once
        done = (
            sum(x.profiled + x.failed for x in self.state.tasks.values()) + self.mutation_failures
        )
        finished = t.profiled + t.failed
        print(
            f"[{min(done, self.total_budget):4d}/{self.total_budget}] {task:<18} {op:<9} "
            f"{what}   (evaluated {finished}, correct {t.profiled}, {best_s})",
            file=self.out,
            flush=True,
        )


async def run_search(
    tasks: list[Task], o: RunOptions, *, out: TextIO = sys.stdout
) -> tuple[str, list[Envelope]]:
    """Run a whole search; return the run id and every committed envelope once it finished.

    Locally (the default) this process hosts the archivist, the archive, the mutator and a
    worker. With ``join`` it only publishes the run's start to a deployment whose agents
    run elsewhere (``compose.yaml``) and follows the run to its end.
    """
    from agents.mutator import OFFLINE_MUTATOR

    # which run (a new one, or the one the log holds: o.resuming) was decided by the
    # caller (kf.app.opening)
    run_id = bus.valid_run_id(o.run_id) if o.run_id else new_run_id()
    db = o.db or Path("runs") / f"{run_id}.db"
    if o.request.nats_url is None and o.request.join:
        raise ValueError("--join needs --nats: the run's agents must already be running")
    # one connection per role (kf.auth): without --nats an embedded server with fresh
    # per-run credentials, watched and restarted if it dies
    local = o.request.local_worker and not o.request.join
    slots, worker_types = worker_plan(o.devices or [o.device]) if local else ([], [])
    rb = await RunBus.open(
        run_id,
        url=o.request.nats_url,
        options=o.request.bus_options,
        device_ids=[s.device_id for s in slots],
        join=o.request.join,
    )
    mutator = "llm" if o.request.llm_url else OFFLINE_MUTATOR
    where = f"log: {db}" if not o.request.join else f"joined via {bus.redact(rb.url)}"
    print(
        f"kf run {run_id}: {len(tasks)} task(s), budget {o.request.budget} candidates each, "
        f"seed {o.request.seed}, device {','.join(o.devices) if len(o.devices) > 1 else o.device}"
        f"\n  {where}\n  mutator: {mutator}",
        file=out,
        flush=True,
    )
    parts = _Parts()
    try:
        if not o.request.join:
            await parts.start_archivist(rb, run_id, db, o)
        # the start is committed by the archivist: if it gives up (a full disk), say so
        # instead of waiting for ever
        await _first(
            _record_start(rb.proposer, run_id, tasks, o, mutator),
            [*([parts.archivist] if parts.archivist else []), *rb.watched()],
        )
        parts.start_agents(rb, run_id, o, slots, worker_types)
        if o.request.serve is not None and db.exists():
            from kf.app.dashboard import start_dashboard

            url_, parts.stop_dashboard = await start_dashboard(
                db, host=o.request.serve[0], port=o.request.serve[1]
            )
            print(
                f"  dashboard: {url_} (while the run lasts; then: kf serve {db})",
                file=out,
                flush=True,
            )
        progress = Progress(out=out, total_budget=o.request.budget * max(1, len(tasks)))
        await _first(_follow(rb.follower, run_id, progress), parts.watched(rb, o))
        if await parts.drain():
            # what the agents said while draining (agent.stopped, device.left) is committed
            # now; keep the caller's copy of the log complete
            with EventLog(db, readonly=True) as elog:
                progress.seen = list(elog.read())
    finally:
        await parts.stop()
        await rb.close()
    return run_id, progress.seen


@dataclass
class _Parts:
    """The tasks of a run's local parts (the archivist; the mutator and the workers'
    agents), and how they end: drained after the run, stopped on the way out."""

    agents: list[asyncio.Task[None]] = field(default_factory=list)
    archivist: asyncio.Task[None] | None = None
    stop_agents: asyncio.Event = field(default_factory=asyncio.Event)
    stop_archivist: asyncio.Event = field(default_factory=asyncio.Event)
    stop_dashboard: Any = None

    async def start_archivist(self, rb: RunBus, run_id: str, db: Path, o: RunOptions) -> None:
        """The archivist on ``db``, hosting the archive (and the prompt evolver with an
        LLM); returns once it serves."""
        from agents.archive import ArchiveAgent
        from agents.archivist import Archivist

        db.parent.mkdir(parents=True, exist_ok=True)
        ctx = AgentContext(
            run_id=run_id,
            agent_id=make_agent_id("archivist"),
            options={
                "heartbeat_timeout_s": o.request.heartbeat_timeout_s,
                "assignment_timeout_s": o.request.assignment_deadline_s(),
            },
        )
        hosted = [ArchiveAgent, *llm_roles(bool(o.request.llm_url))[0]]
        arch = Archivist(ctx, db=db, hosted=hosted, nc=rb.archivist)
        ready = asyncio.Event()
        self.archivist = asyncio.create_task(
            supervise(lambda: arch, self.stop_archivist, ready, name="archivist"),
            name="archivist",
        )
        await _first(ready.wait(), [self.archivist, *rb.watched()])

    def start_agents(
        self,
        rb: RunBus,
        run_id: str,
        o: RunOptions,
        slots: list[DeviceSlot],
        worker_types: list[type[Agent[Any]]],
    ) -> None:
        """The mutator (unless joined) and, for each local device, its worker agents and
        tool server."""
        _, mutator_cls, llm_workers = llm_roles(bool(o.request.llm_url))
        if not o.request.join:
            factory = _runner_factory(mutator_cls, run_id, rb.proposer, {})
            self._spawn(supervise(factory, self.stop_agents, name="mutator"), "the mutator")
        for i, slot in enumerate(slots):
            opt = {
                "device": slot.device,
                "device_id": slot.device_id,
                "timeout_s": o.request.timeout_s,
                "build_timeout_s": o.request.build_timeout_s,
                "measure": o.measure_device,
                "heartbeat_s": o.request.heartbeat_s,
            }
            # the LLM-side worker agents (the tuner) serve the first device only
            for cls in [*worker_types, *(llm_workers if i == 0 else [])]:
                factory = _runner_factory(cls, run_id, rb.workers[slot.device_id], opt)
                name = f"{cls.kind}@{slot.device_id}"
                self._spawn(
                    supervise(factory, self.stop_agents, name=name),
                    f"the {cls.kind} of {slot.device_id}",
                )
            server = _tool_server(rb.worker, run_id, opt)
            self._spawn(server.run(self.stop_agents), f"the tool server of {slot.device_id}")

    def _spawn(self, work: Any, name: str) -> None:
        self.agents.append(asyncio.create_task(work, name=name))

    def watched(self, rb: RunBus, o: RunOptions) -> list[asyncio.Task[None]]:
        """The tasks whose end before the run's means a part died (kf.app.orchestra._first)."""
        watch = [*self.agents, *([self.archivist] if self.archivist else []), *rb.watched()]
        if rb.server is None:  # a server kf did not start: a bounded wait for it
            clients = list({id(c): c for c in (rb.proposer, rb.archivist, *rb.workers.values())
                            if c is not None}.values())  # fmt: skip
            watch.append(
                asyncio.create_task(
                    watch_bus(clients, o.request.bus_timeout_s, rb.url), name="the bus"
                )
            )
        return watch

    async def drain(self) -> bool:
        """After the run: the agents drain (flushing what they produced), then the
        archivist stops; whether this process had one."""
        self.stop_agents.set()
        await asyncio.gather(*self.agents)
        self.stop_archivist.set()
        if self.archivist is None:
            return False
        await self.archivist
        return True

    async def stop(self) -> None:
        """On the way out, however the run ended: the dashboard, then the agents all at
        once (each records what it cut short, agent.stopped, while the archivist still
        commits), then the archivist."""
        if self.stop_dashboard is not None:
            await self.stop_dashboard()
        self.stop_agents.set()
        await stop_tasks(self.agents)
        self.stop_archivist.set()
        await stop_tasks([self.archivist] if self.archivist else [])


async def stop_tasks(tasks: list[asyncio.Task[None]], timeout_s: float = 5.0) -> None:
    """Cancel the tasks not yet done and wait, at most ``timeout_s``, until they end
    (a cancelled agent runner spends at most :data:`kf.runtime.INTERRUPT_S` on its
    clean-up); what they raised is theirs to have logged."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        with contextlib.suppress(BaseException):
            await asyncio.wait(pending, timeout=timeout_s)
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: not reported again as never retrieved


async def watch_bus(clients: list[Any], lost_s: float, url: str) -> None:
    """Raise :class:`PartDied` once one of ``clients`` has been disconnected for
    ``lost_s`` seconds on end (they reconnect by themselves until then)."""
    down_since: float | None = None
    while True:
        await asyncio.sleep(min(1.0, lost_s / 4))
        if all(c.is_connected for c in clients):
            down_since = None
            continue
        down_since = down_since or time.monotonic()
        if time.monotonic() - down_since >= lost_s:
            raise PartDied(
                f"lost the NATS server at {bus.redact(url)} for {lost_s:g} s (--bus-timeout); "
                "giving up"
            )


class PartDied(RuntimeError):
    """A part of the run (the embedded nats-server, an agent past its restarts) ended
    before the run finished and could not be brought back; the message says which."""


async def _first(main: Any, watch: list[asyncio.Task[None]]) -> None:
    """Await ``main``; if a watched task ends first (an agent gave up, the embedded
    server stayed dead), raise :class:`PartDied` saying which and why."""
    main_task = asyncio.ensure_future(main)
    try:
        done, _ = await asyncio.wait({main_task, *watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        main_task.cancel()
        raise
    if main_task in done:
        main_task.result()
        return
    main_task.cancel()
    for t in done:
        exc = None if t.cancelled() else t.exception()
        if isinstance(exc, bus.BusDown):
            raise PartDied(str(exc)) from exc
        if exc is not None:
            raise PartDied(f"{t.get_name()} gave up: {exc}") from exc
    names = ", ".join(sorted(t.get_name() for t in done))
    raise PartDied(f"{names} stopped before the run finished")


async def _record_start(
    nc: Any, run_id: str, tasks: list[Task], o: RunOptions, mutator: str
) -> None:
    """Record the run's start (unless it is resumed) and ``o.records`` after it."""
    source = make_agent_id("cli")
    envelopes = [make_envelope(ev, run_id=run_id, source=source, at=at) for ev, at in o.records]
    if not o.resuming:
        # one id per run: starting the same run twice (a retried --join) commits it once
        start_id = derived_id("run.started", run_id)
        started = _started(run_id, tasks, o, mutator)
        envelopes.insert(0, make_envelope(started, run_id=run_id, source=source, event_id=start_id))
    if not envelopes:
        return
    outbox = Outbox(nc, run_id)
    ob_task = asyncio.create_task(outbox.run())
    outbox.put(envelopes)
    await outbox.flush()
    ob_task.cancel()


def _started(run_id: str, tasks: list[Task], o: RunOptions, mutator: str) -> RunStarted:
    """The run's first event: its config (``o.config``, with the search version this kf
    decides by and the mutator, unless the model named it), seed and tasks (their
    sources)."""
    search = msgspec.structs.replace(
        o.config.search,
        search_version=7,
        mutator=o.config.search.mutator or mutator,
    )
    return RunStarted(
        run_id=run_id,
        seed=o.request.seed,
        config=msgspec.structs.replace(o.config, search=search).wire(),
        tasks=tuple(
            TaskSpec(
                name=t.name,
                source=t.source,
                sha256=t.sha256,
                path=t.path,
                seeds=tuple((s.name, s.source) for s in t.seeds),
                tests=tuple((u.name, u.source) for u in t.tests),
                settings=dict(t.settings),
                origin=dict(t.origin),
            )
            for t in tasks
        ),
        kf_version=_version(),
    )


async def _follow(nc: Any, run_id: str, progress: Progress) -> None:
    feed = CommittedFeed(nc, run_id)
    await feed.subscribe()
    try:
        for env in await feed.catch_up():
            progress.feed(Record(env, decode_event(env)))
        if progress.finished:
            return
        async for env in feed:
            progress.feed(Record(env, decode_event(env)))
            if progress.finished:
                return
    finally:
        await feed.unsubscribe()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    with contextlib.suppress(PackageNotFoundError):
        return version("kf")
    return current().version
