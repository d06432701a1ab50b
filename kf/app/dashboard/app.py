"""``kf serve``: an aiohttp app over a run's log — JSON API, server-sent events, the page.

The app opens the log read-only (WAL lets it read while the archivist writes), folds it
into a :class:`~kf.app.dashboard.view.RunView`, then polls the file for newly committed
events. Each time the head moves, every open ``/api/stream`` gets an SSE message and
the page fetches the state again. The poller is a background task owned by the app's
``cleanup_ctx``; nothing runs after the app is cleaned up.

Routes (all ``GET``; every view of the page has its JSON behind it):

=============================  ===========================================================
``/``                          the dashboard page
``/static/{name}``             its CSS and JavaScript
``/api/state``                 everything the overview shows, in one object
``/api/run``                   run id, config, counters, event types
``/api/archive``               MAP-Elites cells per task and island, with speedups
``/api/progress``              evaluations in log order (for the speedup and rate plots)
``/api/devices``               devices: capabilities, heartbeats, departure
``/api/prompts``               prompt-population / LLM events (none without an LLM)
``/api/candidates``            one line per candidate
``/api/candidates/{id}``       one candidate: source, diff, reports, lineage
``/api/stream``                server-sent events: ``head`` whenever the log grows
=============================  ===========================================================

The feed verifies the log's hash chain as it reads (:meth:`kf.log.EventLog.verify`); a log
that fails it is still shown, under a banner naming the first bad ``seq``
(``state["integrity"]``).

Requests whose ``Host`` header names anything but the bound address, ``localhost``, an IP
literal or a name passed in ``allowed_hosts`` get 421: a page on another site that
rebinds its own name to 127.0.0.1 (DNS rebinding) cannot read the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

import msgspec
import structlog
from aiohttp import web

from kf.app.dashboard.feed import DashboardError, Feed, integrity_state, open_log
from kf.app.dashboard.page import live_page
from kf.app.dashboard.view import RunView
from kf.log import LogError

__all__ = [
    "FEED_KEY",
    "DashboardError",
    "Feed",
    "host_allowed",
    "make_app",
    "open_log",
    "serve",
    "start_dashboard",
]

STATIC = Path(__file__).parent / "static"
_KEEPALIVE_S = 15.0
_log = structlog.get_logger("kf.app.dashboard")


FEED_KEY = web.AppKey("kf_feed", Feed)
DB_KEY = web.AppKey("kf_db", Path)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json"
    )


def _feed(request: web.Request) -> Feed:
    return request.app[FEED_KEY]


async def _index(request: web.Request) -> web.Response:
    return web.Response(text=live_page(), content_type="text/html")


async def _state(request: web.Request) -> web.Response:
    feed = _feed(request)
    state = feed.view.state()
    state["server_time"] = time.time()
    state["db"] = str(request.app[DB_KEY])
    state["undecodable"] = feed.undecodable
    state["integrity"] = integrity_state(feed.integrity)
    return _json(state)


def _view(fn: Callable[[RunView], Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return _json(fn(_feed(request).view))

    return handler


async def _candidate(request: web.Request) -> web.Response:
    cid = request.match_info["cid"]
    detail = _feed(request).view.candidate(cid)
    if detail is None:
        return _json({"error": f"no candidate {cid!r} in this run"}, status=404)
    return _json(detail)


async def _stream(request: web.Request) -> web.StreamResponse:
    feed = _feed(request)
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    q = feed.subscribe()
    try:
        head: int | None = feed.view.head
        while head is not None:
            await resp.write(f"event: head\ndata: {head}\n\n".encode())
            try:
                head = await asyncio.wait_for(q.get(), _KEEPALIVE_S)
            except TimeoutError:
                await resp.write(b": keepalive\n\n")
                head = feed.view.head
    except ConnectionResetError:
        pass
    finally:
        feed.unsubscribe(q)
    return resp


async def _follow_ctx(app: web.Application) -> AsyncIterator[None]:
    feed = app[FEED_KEY]
    task = asyncio.create_task(feed.follow(), name="kf-dashboard-follow")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        feed.elog.close()


async def _on_shutdown(app: web.Application) -> None:
    app[FEED_KEY].close()


LOCAL_NAMES = ("localhost", "localhost.localdomain")
HOSTS_KEY: web.AppKey[frozenset[str]] = web.AppKey("kf_allowed_hosts")


def _host_name(header: str) -> str:
    """The name part of a Host header (``[::1]:8765`` → ``::1``, ``a:1`` → ``a``)."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    name, sep, port = h.rpartition(":")
    return name if sep and port.isdigit() else h


def host_allowed(header: str | None, allowed: Iterable[str]) -> bool:
    """Whether a request's Host header may be served (see the module doc)."""
    if header is None:  # browsers always send one; a client without it is not a web page
        return True
    name = _host_name(header).rstrip(".")
    if name in LOCAL_NAMES or name in {a.strip("[]").lower() for a in allowed}:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True  # an address typed into the browser cannot have been rebound


@web.middleware
async def _check_host(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    header = request.headers.get("Host")
    allowed: frozenset[str] = request.app[HOSTS_KEY]
    if not host_allowed(header, allowed):
        _log.warning("dashboard.host_refused", host=header)
        return web.Response(
            status=421,
            text=f"kf dashboard: Host {header!r} is not allowed (DNS rebinding protection); "
            f"to reach the dashboard under this name, start it with --allow-host "
            f"{_host_name(header or '')}\n",
        )
    return await handler(request)


def make_app(
    db: str | Path, *, poll_s: float = 0.25, allowed_hosts: Iterable[str] = ()
) -> web.Application:
    """The dashboard app for one run's log (raises :class:`DashboardError` for a bad file).

    ``allowed_hosts``: names besides localhost and IP literals that the Host header may
    carry (the name the dashboard was bound to, a machine's DNS name).
    """
    elog = open_log(db)
    try:
        feed = Feed(elog, poll_s=poll_s)
        feed.catch_up()
    except LogError as exc:  # damage SQLite found while reading
        elog.close()
        raise DashboardError(str(exc)) from None
    except BaseException:
        elog.close()
        raise
    app = web.Application(middlewares=[_check_host])
    app[HOSTS_KEY] = frozenset(allowed_hosts)
    app[FEED_KEY] = feed
    app[DB_KEY] = Path(db)
    app.cleanup_ctx.append(_follow_ctx)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_get("/", _index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/state", _state)
    app.router.add_get("/api/run", _view(RunView.run))
    app.router.add_get("/api/archive", _view(RunView.archive_view))
    app.router.add_get("/api/progress", _view(RunView.progress))
    app.router.add_get("/api/devices", _view(RunView.devices_view))
    app.router.add_get("/api/prompts", _view(RunView.prompts_view))
    app.router.add_get("/api/tuning", _view(RunView.tuning_view))
    app.router.add_get("/api/candidates", _view(RunView.candidates))
    app.router.add_get("/api/candidates/{cid}", _candidate)
    app.router.add_get("/api/stream", _stream)
    return app


async def start_dashboard(
    db: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    poll_s: float = 0.25,
    allowed_hosts: Iterable[str] = (),
) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Serve the dashboard in the running loop; return its URL and an async ``stop``.

    The Host header may name ``host`` itself, localhost, an IP literal or ``allowed_hosts``.
    """
    app = make_app(db, poll_s=poll_s, allowed_hosts=[host, *allowed_hosts])
    runner = web.AppRunner(app, shutdown_timeout=2.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise DashboardError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound = port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            bound = int(addr[1])
            break
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{bound}/", runner.cleanup


async def serve(
    db: str | Path,
    *,
    host: str,
    port: int,
    stop: asyncio.Event,
    out: TextIO,
    allowed_hosts: Iterable[str] = (),
) -> None:
    """Serve the dashboard until ``stop`` is set, printing its URL to ``out``."""
    url, close = await start_dashboard(db, host=host, port=port, allowed_hosts=allowed_hosts)
    print(f"kf serve: dashboard at {url} (log {db}); Ctrl-C stops it", file=out, flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"kf serve: listening on {host}: anyone who can reach it can read the run "
            "(sources included); there is no authentication",
            file=out,
            flush=True,
        )
    try:
        await stop.wait()
    finally:
        await close()
