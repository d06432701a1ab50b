"""The ``kf`` command: run, eval, agent, worker, replay, report, serve, export."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kf.logs import configure

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


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


# -- kf agent ------------------------------------------------------------------------------


async def _agent_main(args: argparse.Namespace) -> int:
    from kf import bus
    from kf.agent import Agent, AgentContext, load_agent_type, make_agent_id
    from kf.runtime import AgentRunner, supervise

    cls = load_agent_type(args.kind)
    kind = getattr(cls, "kind", args.kind)
    agent_id = make_agent_id(kind, args.id)
    options = _parse_options(args.option)
    if args.db:
        options["db"] = args.db
    opts = _bus_options(args, args.nats, agent_id)
    nc = await bus.connect(opts)
    ctx = AgentContext(run_id=bus.valid_run_id(args.run), agent_id=agent_id, options=options)
    stop = asyncio.Event()
    _install_signal_handlers(stop)
    try:
        if isinstance(cls, type) and issubclass(cls, Agent):
            await supervise(lambda: AgentRunner(cls(ctx), nc), stop, name=agent_id)
        else:
            hosted = [load_agent_type(k) for k in args.host]
            await supervise(lambda: cls(ctx, nc=nc, hosted=hosted), stop, name=agent_id)
    finally:
        await bus.close(nc)
    return EXIT_OK


def cmd_agent(args: argparse.Namespace) -> int:
    """Run one registered agent (entry-point group ``kf.agents``) against a run."""
    from kf.agent import AgentLoadError

    try:
        return asyncio.run(_agent_main(args))
    except (AgentLoadError, ValueError) as exc:
        print(f"kf agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ConnectionError as exc:
        print(f"kf agent: {exc}", file=sys.stderr)
        return EXIT_FAILED


# -- kf replay -----------------------------------------------------------------------------


def cmd_replay(args: argparse.Namespace) -> int:
    """Fold a log; with --check, recompute every decision and stop at the first difference."""
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
    with elog:
        result = fold(elog, types)
        checked = check(elog, types) if args.check else None
    if args.json:
        out: dict[str, Any] = {
            "db": str(args.db),
            "run_id": result.run_id,
            "events": result.events,
            "head": result.head,
            "hash": result.hash,
            "state": _jsonable(result.snapshots),
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
            }
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(f"log {args.db}: run {result.run_id or '?'}, {result.events} events (head {result.head})")
        for kind, snap in result.snapshots.items():
            print(f"[{kind}]")
            print(_summary(snap))
        print(f"state hash: {result.hash}")
        if checked is not None:
            if checked.ok:
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


# -- placeholders ----------------------------------------------------------------------------


def _not_yet(verb: str, issue: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        print(f"kf {verb}: not available yet ({issue})", file=sys.stderr)
        return EXIT_USAGE

    return run


def cmd_eval(args: argparse.Namespace) -> int:
    """Verify and time one candidate against a task through the sandboxed protocol."""
    try:
        from kf.evaluation.cli import main as eval_main
    except ImportError:
        return _not_yet("eval", "the evaluation harness is not installed")(args)
    return int(eval_main(list(args.rest)))


# -- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every verb."""
    p = argparse.ArgumentParser(prog="kf", description=__doc__)
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (or KF_LOG_LEVEL)")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    a = sub.add_parser("agent", help="run one registered agent type against a run")
    a.add_argument("kind", help="an agent type registered in the kf.agents entry-point group")
    _add_nats_options(a, required=True)
    a.add_argument("--run", required=True, metavar="RUN_ID", help="the run to join")
    a.add_argument("--db", help="log path (the archivist's)")
    a.add_argument("--id", help="instance id (default host.pid)")
    a.add_argument("--host", action="append", default=[], metavar="KIND",
                   help="(archivist) decision agent to host; repeatable")
    a.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="agent option (JSON values allowed); repeatable")
    a.set_defaults(func=cmd_agent)

    r = sub.add_parser("replay", help="fold a run's log; --check proves the decisions")
    r.add_argument("db", type=Path)
    r.add_argument("--check", action="store_true", help="recompute every decision")
    r.add_argument("--json", action="store_true")
    r.add_argument("--agent", action="append", metavar="KIND", help="only these deciding agents")
    r.set_defaults(func=cmd_replay)

    e = sub.add_parser("eval", help="verify and time one candidate for a task", add_help=False)
    e.add_argument("rest", nargs=argparse.REMAINDER)
    e.set_defaults(func=cmd_eval)

    for verb, issue, text in [
        ("run", "the search loop", "evolve kernels for a task or folder of tasks"),
        ("worker", "the worker", "serve a run from this machine's device"),
        ("report", "reports", "summarise a run"),
        ("serve", "the dashboard", "dashboard for a run"),
        ("export", "export", "best kernel as a drop-in module"),
    ]:
        q = sub.add_parser(verb, help=text)
        q.add_argument("rest", nargs=argparse.REMAINDER)
        q.set_defaults(func=_not_yet(verb, f"{issue} is not built yet"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kf`` console script."""
    args = build_parser().parse_args(argv)
    configure(args.log_level)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
