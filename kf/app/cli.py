"""The ``kf`` command: run, eval, agent, worker, replay, report, serve, export, extract,
check-model, lessons."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kf.logs import configure
from kf.settings import current

if TYPE_CHECKING:
    from kf.app import RunRequest

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: a part of the run (the embedded nats-server, an agent past its restarts) died mid-run
#: and could not be brought back; the log keeps what was committed (README, "Exit codes")
EXIT_PART_DIED = 3
#: stopped by SIGINT (Ctrl-C); SIGTERM gives 143 (kf.shutdown)
EXIT_INTERRUPTED = 130

T = TypeVar("T")


def _add_nats_options(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument(
        "--nats",
        required=required,
        metavar="URL",
        help="NATS server URL (nats://host:4222); without it kf starts an embedded server",
    )
    p.add_argument("--token", help="NATS auth token (or KF_NATS_TOKEN)")
    p.add_argument("--user", help="NATS user (or KF_NATS_USER)")
    p.add_argument("--password", help="NATS password (or KF_NATS_PASSWORD)")
    p.add_argument("--tls-ca", help="CA bundle for a TLS NATS server")
    p.add_argument("--tls-cert", help="client certificate for TLS")
    p.add_argument("--tls-key", help="client key for TLS")
    from kf.shutdown import BUS_LOST_S

    p.add_argument(
        "--bus-timeout",
        type=float,
        default=BUS_LOST_S,
        metavar="SECONDS",
        help="with --nats: give up (exit 3) after this long without the server "
        f"(default {BUS_LOST_S:g})",
    )
    p.add_argument(
        "--allow-shared-token",
        action="store_true",
        help="start even though the server has no per-role users (a token or no "
        "credentials): any holder can then forge results (or KF_ALLOW_SHARED_TOKEN=1)",
    )


def _shared_login_refused(
    verb: str, args: argparse.Namespace, opts: Any, roles: Sequence[str]
) -> bool:
    """Print why ``kf <verb>`` refuses a bus without per-role users (kf.auth); True then."""
    from kf.auth import shared_login_refusal

    why = shared_login_refusal(verb, [opts.for_role(r) for r in roles], args.allow_shared_token)
    if why:
        print(f"kf {verb}: {why}", file=sys.stderr)
    return why is not None


def _bus_options(args: argparse.Namespace, url: str, name: str) -> Any:
    from kf.bus import BusOptions

    return BusOptions.from_env(
        url,
        token=args.token,
        user=args.user,
        password=args.password,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        name=name,
    )


def _parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"kf: --option expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


def _guarded(
    verb: str,
    args: argparse.Namespace,
    work: Coroutine[Any, Any, T],
    *,
    usage: tuple[type[Exception], ...] = (ValueError,),
    resume: bool = False,
) -> tuple[int, T | None]:
    """Run a command's coroutine through :mod:`kf.shutdown` (a stop kills its children),
    and say how it ended, as ``kf <verb>: …`` and an exit code (README, "Exit codes"):
    ``(0, its result)``, else ``(code, None)``. ``usage`` are the exceptions that mean bad
    input or settings (2); with ``resume`` an ending that keeps the log says how to resume."""
    from kf import shutdown
    from kf.app.orchestra import PartDied
    from kf.log import LogFull

    ended: BaseException
    try:
        return EXIT_OK, shutdown.run(work, reap=_own(args))
    except (KeyboardInterrupt, shutdown.Terminated) as exc:
        return _stopped(verb, exc, resume=resume), None
    except PartDied as exc:  # the embedded nats-server, an agent past its restarts, the bus
        why, ended = str(exc), exc
    except ExceptionGroup as group:  # the same, from a task group
        ended = first = group.exceptions[0]
        why = str(first) if isinstance(first, PartDied) else f"a part gave up: {first!r}"
    except usage as exc:
        print(f"kf {verb}: {exc}", file=sys.stderr)
        return EXIT_USAGE, None
    except ConnectionError as exc:  # no NATS at the start
        print(f"kf {verb}: {exc}", file=sys.stderr)
        return EXIT_FAILED, None
    print(f"kf {verb}: {why}", file=sys.stderr)
    if resume and not isinstance(ended.__cause__, LogFull):  # that line says how already
        print(RESUME_HINT, file=sys.stderr)
    return EXIT_PART_DIED, None


# -- kf agent ------------------------------------------------------------------------------


async def _agent_main(args: argparse.Namespace) -> int:
    from kf import bus
    from kf.agent import Agent, AgentContext, load_agent_type, make_agent_id
    from kf.app.orchestra import watch_bus
    from kf.runtime import AgentRunner, supervise

    cls = load_agent_type(args.kind)
    kind = getattr(cls, "kind", args.kind)
    agent_id = make_agent_id(kind, args.id)
    options = _parse_options(args.option)
    if args.db:
        from kf.log import check_writable

        check_writable(Path(args.db))  # one writer per log: LogLocked, one line, before all
        options["db"] = args.db
    opts = _bus_options(args, args.nats, agent_id)
    if _shared_login_refused("agent", args, opts, [kind]):
        return EXIT_USAGE
    nc = await bus.connect(opts)
    ctx = AgentContext(run_id=bus.valid_run_id(args.run), agent_id=agent_id, options=options)
    stop = asyncio.Event()  # never set: SIGINT and SIGTERM cancel (kf.shutdown)
    if isinstance(cls, type) and issubclass(cls, Agent):
        work = supervise(lambda: AgentRunner(cls(ctx), nc), stop, name=agent_id)
    else:
        hosted = [load_agent_type(k) for k in args.host]
        work = supervise(lambda: cls(ctx, nc=nc, hosted=hosted), stop, name=agent_id)
    try:
        async with asyncio.TaskGroup() as tg:
            agent = tg.create_task(work)
            watch = tg.create_task(watch_bus([nc], args.bus_timeout, args.nats))
            await asyncio.wait({agent, watch}, return_when=asyncio.FIRST_COMPLETED)
            watch.cancel()
    finally:
        await bus.close(nc)
    return EXIT_OK


def cmd_agent(args: argparse.Namespace) -> int:
    """Run one registered agent (entry-point group ``kf.agents``) against a run."""
    from kf.agent import AgentLoadError

    code, result = _guarded("agent", args, _agent_main(args), usage=(AgentLoadError, ValueError))
    return code if result is None else result  # _agent_main's own code (2 when refused)


# -- kf replay -----------------------------------------------------------------------------


def cmd_replay(args: argparse.Namespace) -> int:
    """Fold a log; with --check, recompute every decision and stop at the first difference."""
    from kf.app.report import config_line, recorded_config
    from kf.log import EventLog, LogError
    from kf.replay import check, deciding_agent_types, fold

    try:
        elog = EventLog(args.db, readonly=True)
    except LogError as exc:
        print(f"kf replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        types = deciding_agent_types(args.agent or None)
    except LookupError as exc:
        print(f"kf replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with elog:
            result = fold(elog, types)
            checked = check(elog, types) if args.check else None
            config = recorded_config(elog.read(1, 1))
    except LogError as exc:
        print(f"kf replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        out: dict[str, Any] = {
            "db": str(args.db),
            "run_id": result.run_id,
            "events": result.events,
            "head": result.head,
            "hash": result.hash,
            "config": config,
            "state": _jsonable(result.snapshots),
            "task_checks": _jsonable(result.task_checks),
        }
        if checked is not None:
            out["check"] = {
                "ok": checked.ok,
                "decisions_checked": checked.decisions_checked,
                "difference": None
                if checked.difference is None
                else {
                    "seq": checked.difference.seq,
                    "kind": checked.difference.kind,
                    "event_type": checked.difference.event_type,
                    "message": checked.difference.message,
                },
                "integrity": None if checked.integrity is None else checked.integrity.as_json(),
            }
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        run = result.run_id or "?"
        print(f"log {args.db}: run {run}, {result.events} events (head {result.head})")
        if config:
            print(config_line(config))
        for kind, snap in result.snapshots.items():
            print(f"[{kind}]")
            print(_summary(snap))
        for name, c in sorted(result.task_checks.items()):
            what = f"eager {c.info.eager_ms:.3f} ms" if c.info else (c.error or "passed")
            print(f"task check: {name} {'passed' if c.ok else 'FAILED'} on {c.device} ({what})")
        print(f"state hash: {result.hash}")
        if checked is not None:
            if checked.ok:
                if checked.integrity is not None:
                    print(checked.integrity.message())
                print(f"check: ok, {checked.decisions_checked} decisions recomputed and equal")
            else:
                d = checked.difference
                assert d is not None
                print(f"check: FAILED at seq {d.seq} ({d.kind}, {d.event_type}): {d.message}")
    if checked is not None and not checked.ok:
        return EXIT_FAILED
    return EXIT_OK


def _jsonable(obj: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(obj, str_keys=True)


def _summary(snap: Any) -> str:
    summary = getattr(snap, "summary", None)
    if callable(summary):
        return str(summary())
    text = json.dumps(_jsonable(snap), sort_keys=True)
    return text if len(text) < 2000 else text[:2000] + " …"


# -- kf run / worker / report / export -----------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    """Evolve kernels for the given tasks on this machine (the work is :mod:`kf.app`'s)."""
    from kf.app import RunRefused, prepare_run, search
    from kf.app.report import format_table

    request = _run_request(args)
    if isinstance(request, str):
        print(f"kf run: {request}", file=sys.stderr)
        return EXIT_USAGE
    try:
        plan = prepare_run(request)
    except RunRefused as exc:
        _say_skipped(exc.skipped)
        print(f"kf run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kf run: interrupted while checking the tasks; no run was started", file=sys.stderr)
        return EXIT_INTERRUPTED
    _say_skipped(plan.skipped)
    # SIGTERM stops the run as SIGINT does: agents, connections and the embedded
    # nats-server are stopped and temporary folders removed before the exit
    out = sys.stderr if args.json else sys.stdout
    code, result = _guarded("run", args, search(plan, out=out), resume=True)
    if result is None:
        return code
    report = result.report
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print()
        print(format_table(report))
        if not args.join:
            db = args.db or f"runs/{report['run_id']}.db"
            print(f"\nlog: {db}    (kf report {db} --json; kf replay {db} --check)")
    if result.unrunnable:
        print(f"kf run: no device could run any candidate: {result.unrunnable}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _run_request(args: argparse.Namespace) -> RunRequest | str:
    """``kf run``'s flags as a :class:`kf.app.RunRequest`, or what is wrong with them."""
    from kf.app import RunRequest
    from kf.evaluation.wire.tolerance import tolerance_from_args
    from kf.kernels.tuning import tuning_config
    from kf.llm.cli import llm_config

    llm = llm_config(args)
    if isinstance(llm, str):
        return llm
    tolerance = tolerance_from_args(args)
    if isinstance(tolerance, str):
        return tolerance
    tune = tuning_config(args)
    if isinstance(tune, str):
        return tune
    if args.shape_cap is not None and args.shape_cap < 1:
        return "--shape-cap must be at least 1"
    return RunRequest(
        tasks=args.tasks,
        shape_cap=args.shape_cap,
        select=args.select,
        budget=args.budget,
        seed=args.seed,
        db=args.db,
        resume=args.resume,
        device=args.device,
        islands=args.islands,
        max_in_flight=args.max_in_flight,
        timeout_s=args.timeout,
        build_timeout_s=args.build_timeout,
        tune_budget=tune["tune_budget"],
        lessons=args.lessons,
        llm_url=args.llm_url,
        llm=llm,
        tolerance=tolerance.config(),
        compile_mode=args.compile_mode,
        tf32=args.tf32,
        unsafe_no_sandbox=args.unsafe_no_sandbox,
        serve=(args.serve_host, args.serve_port) if args.serve else None,
        run_id=args.run,
        join=args.join,
        local_worker=not args.no_worker,
        heartbeat_s=args.heartbeat,
        heartbeat_timeout_s=args.heartbeat_timeout,
        assignment_timeout_s=args.assignment_timeout,
        trust=tuple(args.trust),
        nats_url=args.nats,
        bus_options=_bus_options(args, args.nats, "kf-run") if args.nats else None,
        allow_shared_token=args.allow_shared_token,
        bus_timeout_s=args.bus_timeout,
    )


def _say_skipped(skipped: Sequence[tuple[str, str]]) -> None:
    for where, why in skipped:
        print(f"kf run: skipping {where}: {why}", file=sys.stderr)


def _own(args: argparse.Namespace) -> bool:
    """Whether this command is its process's own (``kf …``, not a call from Python)."""
    return bool(getattr(args, "own_process", False))


RESUME_HINT = "kf run: the log keeps what was committed (rerun with the same --db to resume)"


def _stopped(verb: str, exc: BaseException, *, resume: bool = False) -> int:
    """The message and exit code of a command stopped by SIGINT (130) or SIGTERM (143)."""
    from kf import shutdown

    code = exc.exit_code if isinstance(exc, shutdown.Terminated) else EXIT_INTERRUPTED
    what = str(exc) if isinstance(exc, shutdown.Terminated) else "interrupted"
    tail = "; evaluations in flight were cut short and are redone on resume" if resume else ""
    print(f"kf {verb}: {what}{tail}", file=sys.stderr)
    if resume:
        print(RESUME_HINT, file=sys.stderr)
    return code


def cmd_worker(args: argparse.Namespace) -> int:
    """Serve a run started elsewhere with this machine's device."""
    from kf.app import require_sandbox
    from kf.app.orchestra import run_worker
    from kf.bus import valid_run_id

    refused = require_sandbox(args.unsafe_no_sandbox)
    if refused:
        print(f"kf worker: {refused}", file=sys.stderr)
        return EXIT_USAGE
    opts = _bus_options(args, args.nats, "kf-worker")
    if _shared_login_refused("worker", args, opts, ["worker"]):
        return EXIT_USAGE
    options: dict[str, Any] = {
        "timeout_s": args.timeout,
        "heartbeat_s": args.heartbeat,
        "build_timeout_s": args.build_timeout,
        "bus_timeout_s": args.bus_timeout,
        "measure": current().device_measure,
    }
    if args.name:
        options["device_id"] = args.name

    async def go() -> None:  # SIGINT and SIGTERM cancel it (kf.shutdown)
        await run_worker(valid_run_id(args.run), opts, device=args.device, options=options)

    code, _ = _guarded("worker", args, go())
    return code


def cmd_report(args: argparse.Namespace) -> int:
    """Print a run's results (or a ``kf check-model`` JSON's)."""
    from kf.app.check_model import format_check, is_check
    from kf.app.report import build_report, format_table
    from kf.log import LogError

    if is_check(args.db):
        check = json.loads(args.db.read_text())
        print(json.dumps(check, indent=2) if args.json else format_check(check))
        return EXIT_OK

    try:
        report = build_report(args.db, ignore_integrity=args.ignore_integrity)
    except LogError as exc:
        print(f"kf report: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.csv:
        from kf.app.kernelbench import rows_to_csv

        print(rows_to_csv(report["kernelbench"]["rows"]), end="")
    else:
        print(json.dumps(report, indent=2) if args.json else format_table(report))
    if args.html:
        from kf.app.dashboard import write_report

        out = write_report(args.db, args.html)
        print(f"kf report: wrote {out} (self-contained HTML)", file=sys.stderr)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the dashboard of a run's log (live while the run writes it)."""
    from kf.app.dashboard import DashboardError
    from kf.app.dashboard.app import serve

    async def go() -> None:
        stop = asyncio.Event()
        _install_signal_handlers(stop)
        await serve(
            args.db,
            host=args.host,
            port=args.port,
            stop=stop,
            out=sys.stdout,
            allowed_hosts=args.allow_host,
        )

    try:
        asyncio.run(go())
    except DashboardError as exc:
        print(f"kf serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Write the best kernel of a task as a module defining ``ModelNew``."""
    if args.model is not None:  # a patch for the user's model (issue 45)
        from kf.app.model_patch import cmd_export_model

        return cmd_export_model(args)
    if len(args.db) > 1:
        print("kf export: one run at a time; several only with --model", file=sys.stderr)
        return EXIT_USAGE
    from agents.archive import best_candidate
    from kf.app.report import best_baselines, fold_archive
    from kf.log import EventLog, LogError

    try:
        with EventLog(args.db[0], readonly=True) as elog:
            state = fold_archive(elog, ignore_integrity=args.ignore_integrity)
            integrity = elog.verify()
            envelopes = list(elog.read())
    except LogError as exc:
        print(f"kf export: {exc}", file=sys.stderr)
        return EXIT_USAGE
    names = sorted(state.tasks)
    task = args.task or (names[0] if len(names) == 1 else None)
    if task is None or task not in state.tasks:
        print(f"kf export: choose a task with --task (tasks: {', '.join(names)})", file=sys.stderr)
        return EXIT_USAGE
    best = best_candidate(state, task)
    if best is None:
        print(f"kf export: task {task} has no correct, profiled kernel", file=sys.stderr)
        return EXIT_FAILED
    vs = best_baselines(envelopes, task, best.id)
    compiled = (
        f"{vs['best_speedup_vs_compiled']:.2f}x over torch.compile ({vs['compiled_ms']:.4f} ms, "
        f"mode {vs.get('compile_mode') or 'default'}), {vs['best_speedup_vs_best']:.2f}x over "
        "the better of the two"
        if vs["best_speedup_vs_compiled"] is not None and vs["compiled_ms"]
        else "no torch.compile time"
    )
    header = (
        f"# kf export: best kernel for task {task} from run {state.run_id}\n"
        f"# candidate {best.id}: {best.speedup:.2f}x over PyTorch eager "
        f"({best.runtime_ms:.4f} ms vs {best.ref_ms:.4f} ms), config {best.config}\n"
        f"# {compiled}\n"
    )
    if not integrity.ok:
        header = (
            f"# WARNING: {integrity.message()}\n"
            "# exported with --ignore-integrity: this kernel and its figures prove nothing\n"
        ) + header
        print(f"kf export: WARNING: {integrity.message()}", file=sys.stderr)
    from kf.app.export import dispatch_module, tuned_choices
    from kf.kernels.params import family as param_family

    choices = tuned_choices(state, envelopes, task, param_family(best.source))
    text, left_out = dispatch_module(header, best.source, choices) if choices else ("", [])
    for why in left_out:
        print(f"kf export: a tuned configuration left out: {why}", file=sys.stderr)
    args.output.write_text(text or header + best.source)
    tuned = f"; {len(choices) - len(left_out)} shape(s) dispatched to tuned configurations"
    print(f"wrote {args.output} ({task}, {best.speedup:.2f}× over eager{tuned if text else ''})")
    return EXIT_OK


def cmd_eval(args: argparse.Namespace) -> int:
    """Verify and time one candidate against a task through the sandboxed protocol."""
    from kf.evaluation.grader.cli import main as eval_main

    return eval_main(list(args.rest))


# -- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every verb."""
    p = argparse.ArgumentParser(prog="kf", description=__doc__)
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (or KF_LOG_LEVEL)")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    for add in (_agent_parser, _replay_parser, _eval_parser, _run_parser, _worker_parser):
        add(sub)
    for add in (_report_parser, _export_parser, _serve_parser):
        add(sub)
    from kf.app.check_model import add_parser as _check_model_parser
    from kf.app.extract import add_parser as _extract_parser
    from kf.app.lessons_cmd import add_parser as _lessons_parser

    _extract_parser(sub)
    _lessons_parser(sub)
    _check_model_parser(sub)
    return p


def _add_sandbox_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--unsafe-no-sandbox",
        action="store_true",
        help="run candidates outside kf's bubblewrap box (they can read kf's environment "
        "and files); every result says so",
    )


def _agent_parser(sub: Any) -> None:
    """``kf agent``."""
    a = sub.add_parser("agent", help="run one registered agent type against a run")
    a.add_argument("kind", help="an agent type registered in the kf.agents entry-point group")
    _add_nats_options(a, required=True)
    a.add_argument("--run", required=True, metavar="RUN_ID", help="the run to join")
    a.add_argument("--db", help="log path (the archivist's)")
    a.add_argument("--id", help="instance id (default host.pid)")
    a.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="KIND",
        help="(archivist) decision agent to host; repeatable",
    )
    a.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="agent option (JSON values allowed); repeatable",
    )
    a.set_defaults(func=cmd_agent)


def _replay_parser(sub: Any) -> None:
    """``kf replay``."""
    r = sub.add_parser("replay", help="fold a run's log; --check proves the decisions")
    r.add_argument("db", type=Path)
    r.add_argument("--check", action="store_true", help="recompute every decision")
    r.add_argument("--json", action="store_true")
    r.add_argument("--agent", action="append", metavar="KIND", help="only these deciding agents")
    r.set_defaults(func=cmd_replay)


def _eval_parser(sub: Any) -> None:
    """``kf eval`` (its own parser takes the rest: kf.evaluation.grader.cli)."""
    e = sub.add_parser("eval", help="verify and time one candidate for a task", add_help=False)
    e.add_argument("rest", nargs=argparse.REMAINDER)
    e.set_defaults(func=cmd_eval)


def _run_parser(sub: Any) -> None:
    """``kf run``: the search's own options."""
    rn = sub.add_parser("run", help="evolve kernels for a task file or a folder of tasks")
    rn.add_argument(
        "tasks",
        type=Path,
        help="a KernelBench-format task file, a task package (task.py, kf.toml, tests/), a "
        "robust-kbench task folder, or a folder of any of these",
    )
    rn.add_argument(
        "--shape-cap",
        type=int,
        default=None,
        metavar="N",
        help="robust-kbench folders: set every integer of their configs above N to N (their "
        "shapes made small enough for a small machine); recorded in the run",
    )
    rn.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a TOML file of these options, keys named as the flags (budget = 8, "
        "max-in-flight = 4; examples/run.toml); flags given here win over it",
    )
    rn.add_argument("--budget", type=int, default=20, help="candidates per task (seeds included)")
    rn.add_argument(
        "--tasks",
        dest="select",
        metavar="SELECTION",
        help="of a folder, only these tasks: KernelBench ids, A-B ranges and name "
        "substrings, comma-separated (1,19,23-26,Softmax)",
    )
    rn.add_argument("--seed", type=int, default=0, help="the run's seed (selection, mutation)")
    rn.add_argument(
        "--db",
        type=Path,
        help="event log path (default runs/<run_id>.db); an existing log is resumed when "
        "its tasks, budget, seed and device are the ones given (else see --resume)",
    )
    rn.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --db as it was started, even if the settings given differ",
    )
    from kf.devices.slots import DEVICE_HELP

    rn.add_argument("--device", default="cpu", help=DEVICE_HELP)
    rn.add_argument("--islands", type=int, default=2)
    rn.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="candidates being evaluated at once, across tasks (default: 2 per local CPU, "
        "24 per local GPU)",
    )
    from kf.llm.cli import add_llm_options

    add_llm_options(rn)
    from kf.kernels.tuning import add_tuning_options

    add_tuning_options(rn)
    rn.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="seconds per verification or profiling stage before it is killed",
    )
    from kf.evaluation.wire.tolerance import add_options as add_check_options

    add_check_options(rn)
    rn.add_argument("--json", action="store_true", help="print the final report as JSON")
    rn.add_argument(
        "--lessons",
        type=Path,
        default=None,
        help="a lesson library (kf lessons): its lessons are recorded in the run and quoted "
        "to the model as data where they fit the task and the parent",
    )
    _run_deployment_options(rn)
    rn.set_defaults(func=cmd_run)


def _run_deployment_options(rn: argparse.ArgumentParser) -> None:
    """``kf run``: baselines, the box, the dashboard, and where the run's parts run."""
    from kf.evaluation.grader.baseline_settings import COMPILE_MODES, TF32_SETTINGS

    rn.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        help="torch.compile mode of the compiled baseline (default: default; or $KF_COMPILE_MODE)",
    )
    rn.add_argument(
        "--tf32",
        choices=TF32_SETTINGS,
        help="TF32 in every runner, the reference's included (default off; or $KF_TF32)",
    )
    _add_sandbox_option(rn)
    rn.add_argument("--serve", action="store_true", help="serve the dashboard while running")
    rn.add_argument("--serve-port", type=int, default=8765, help="dashboard port (0: any)")
    rn.add_argument("--serve-host", default="127.0.0.1", help="dashboard address (loopback)")
    rn.add_argument("--run", metavar="RUN_ID", help="the run's id (default: time + random)")
    rn.add_argument(
        "--join",
        action="store_true",
        help="only start the run on --nats and follow it: the archivist, mutator and "
        "workers already run there (compose.yaml)",
    )
    rn.add_argument(
        "--no-worker", action="store_true", help="no local worker: remote `kf worker`s do the work"
    )
    rn.add_argument("--heartbeat", type=float, default=10.0, help="worker heartbeat seconds")
    rn.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=30.0,
        help="seconds of silence before the archivist declares a device lost and re-dispatches",
    )
    rn.add_argument(
        "--assignment-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a device may hold candidates without answering any (while it "
        "heartbeats) before it is declared lost and they go to other devices; default: "
        "the longer of one build's and one stage's limit, plus 120; 0: never",
    )
    rn.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="DEVICE",
        help="take this remote device's results on its word (its id as the run prints it: "
        "a one-device `kf worker --name W` is W; repeatable; '*': every device): without "
        "it, a result "
        "from a device other than this run's own that would enter the archive is measured "
        "again on another device first, and stays unconfirmed if none can",
    )
    _add_nats_options(rn, required=False)


def _worker_parser(sub: Any) -> None:
    """``kf worker``."""
    w = sub.add_parser("worker", help="serve a run from this machine's device")
    from kf.devices.slots import DEVICE_HELP
    from kf.evaluation.wire.tolerance import add_options as add_check_options

    w.add_argument("--device", default="cpu", help=DEVICE_HELP)
    w.add_argument("--run", required=True, metavar="RUN_ID")
    w.add_argument("--timeout", type=float, default=180.0)
    add_check_options(w, tolerance=False)
    w.add_argument(
        "--name",
        help="device id to announce (default <host>/<device>); with several devices, the "
        "prefix of each one's id (<name>/<device>)",
    )
    w.add_argument("--heartbeat", type=float, default=10.0, help="heartbeat seconds")
    _add_sandbox_option(w)
    _add_nats_options(w, required=True)
    w.set_defaults(func=cmd_worker)


def _report_parser(sub: Any) -> None:
    """``kf report``."""
    rp = sub.add_parser("report", help="summarise a run from its log")
    rp.add_argument("db", type=Path)
    rp.add_argument("--json", action="store_true")
    rp.add_argument(
        "--csv",
        action="store_true",
        help="one row per task in KernelBench's terms (problem_id, compiled, correctness, "
        "runtime, ref_runtime, speedups against eager, torch.compile and the better)",
    )
    rp.add_argument(
        "--ignore-integrity",
        action="store_true",
        help="report a log that fails its hash-chain check anyway (marked as such)",
    )
    rp.add_argument(
        "--html", type=Path, metavar="OUT.html", help="also write a self-contained HTML report"
    )
    rp.set_defaults(func=cmd_report)


def _export_parser(sub: Any) -> None:
    """``kf export``."""
    ex = sub.add_parser("export", help="write a task's best kernel as a drop-in module")
    ex.add_argument("db", type=Path, nargs="+", help="a run's log (several with --model)")
    ex.add_argument("-o", "--output", type=Path, required=True)
    ex.add_argument(
        "--model",
        type=Path,
        metavar="MANIFEST",
        help="kf extract's manifest.json: write a patch with apply(model) that swaps the "
        "runs' verified kernels into your model (kf check-model checks it)",
    )
    ex.add_argument(
        "--min-speedup",
        type=float,
        default=1.0,
        metavar="X",
        help="with --model: a kernel enters the patch only above this verified speed-up over "
        "eager at its shapes (default 1.0)",
    )
    ex.add_argument("--task", help="which task (default: the only one)")
    ex.add_argument(
        "--ignore-integrity",
        action="store_true",
        help="export from a log that fails its hash-chain check anyway (marked as such)",
    )
    ex.set_defaults(func=cmd_export)


def _serve_parser(sub: Any) -> None:
    """``kf serve``."""
    sv = sub.add_parser("serve", help="dashboard for a run (live while it runs)")
    sv.add_argument("db", type=Path, help="the run's event log (runs/<run_id>.db)")
    sv.add_argument("--port", type=int, default=8765, help="TCP port (0: any free port)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    sv.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name the dashboard may be reached by besides localhost and IP addresses "
        "(DNS rebinding protection); repeatable",
    )
    sv.set_defaults(func=cmd_serve)


def _split_eval(argv: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """``kf [--log-level L] eval ARGS``: (the global options, ARGS), so that ARGS go to
    ``kf eval``'s own parser whole (argparse's REMAINDER drops a leading ``-h``)."""
    for i, token in enumerate(argv):
        if token == "eval":
            return list(argv[:i]), list(argv[i + 1 :])
        if not token.startswith("-") and argv[i - 1 : i] != ["--log-level"]:
            return None
    return None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``kf``'s command line, with ``kf run --config FILE``'s values under its flags
    (:mod:`kf.app.run_file`; a file it cannot take raises its ``ConfigFileError``, a
    ``ValueError`` of one line)."""
    split = _split_eval(argv)
    if split is not None:
        args = build_parser().parse_args([*split[0], "eval"])
        args.rest = split[1]
        return args
    args = build_parser().parse_args(argv)
    if getattr(args, "config", None) is not None:
        from kf.app.run_file import apply_file

        args = apply_file(build_parser, args.verb, argv, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kf`` console script."""
    # the process's own command (not a call from Python, e.g. a test's): a stop kills
    # its children and ends it at once (kf.shutdown)
    own_process = argv is None
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except ValueError as exc:  # a --config file kf run cannot take: nothing started
        print(f"kf run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    level = args.log_level
    if (
        level is None
        and args.verb in ("run", "eval", "report", "replay", "export")
        and not current().log_level
    ):
        level = "WARNING"  # interactive verbs show their own progress; agents' logs are noise
    configure(level)
    args.own_process = own_process
    code = int(args.func(args))
    from kf import shutdown

    if args.own_process and shutdown.abandoned():  # threads busy with moot work: not waited
        shutdown.exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
