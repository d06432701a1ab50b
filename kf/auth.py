"""Who may say what on a run's bus: roles, per-run credentials, and entitlements.

Two layers (``docs/authorization.md``):

1. **The server's permissions** decide who may publish on which subject. Roles:

   - ``archivist`` — the only one that publishes committed events (``kf.R.log``) and
     answers requests (``_INBOX.>``); it subscribes to every intake and to fetches.
   - ``proposer`` — mutators (offline or LLM), the run's starter, plugins: publish to the
     general intake ``kf.R.in`` and ask for ranges (``kf.R.fetch``).
   - ``worker`` for device ``D`` — the agents next to one device: publish only to that
     device's intake ``kf.R.in.dev.<D>`` and ask for ranges.

   Everyone may read the committed log. :class:`RunCredentials` makes one user per role
   (one per device for workers) with fresh random passwords for one run, and the
   nats-server configuration that grants exactly that; :func:`nats_config` writes the
   same for a deployment whose passwords come from the environment (``compose.yaml``).

2. **The archivist's entitlement check** (:class:`Entitlements`, a fold of the committed
   log): an observation that speaks for a device is accepted only on that device's
   intake subject, a stage result only for a candidate attempt the archive assigned
   to that device, a task's audit only from a device given some of that task's work, a
   tuning answer only from a device asked to tune, a failed reaction only to that
   device's own work (never to a proposal); decisions and ``device.lost`` are never
   accepted from outside. What it refuses goes to the log's ``rejected`` table with the
   reason, and is counted.

A token-only server (``--auth``) still works, but every token holder is every role:
nothing then stops a holder from publishing committed events or speaking for another
device's subject.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from nats.aio.client import Client

from kf import bus
from kf.events import (
    DEVICE_ID_SPACE,
    Decision,
    Envelope,
    Event,
    Observation,
    decode_event,
    device_id_prefix,
    event_class,
)
from kf.settings import current

__all__ = [
    "ROLES",
    "Credential",
    "Entitlements",
    "EnvRef",
    "RunBus",
    "RunCredentials",
    "deployment_config",
    "nats_config",
    "password_env",
    "permissions",
    "shared_login",
    "shared_login_refusal",
    "trusted_devices",
    "worker_user",
]

ROLES = ("archivist", "proposer", "worker")

# facts any agent may report about itself, on any intake
_LIFECYCLE = frozenset({"agent.started", "agent.stopped", "agent.reaction_failed"})
# device facts about a candidate that a device may report for any candidate (a tuner
# times elites found on other devices on its own device)
_ANY_CANDIDATE = frozenset({"tuning.config_tuned"})
_ARCHIVIST_ONLY = frozenset({"device.lost"})
# the archive's decisions that give a device work (what its results may then be about)
_GIVES_WORK = frozenset({"search.candidate_assigned", "search.tuning_requested"})


def permissions(run_id: str, role: str, device_id: str | None = None) -> dict[str, Any]:
    """The nats-server ``permissions`` block of ``role`` in run ``run_id``."""
    run_id = bus.valid_run_id(run_id)
    log, fetch = bus.log_subject(run_id), bus.fetch_subject(run_id)
    read = [log, "_INBOX.>"]
    if role == "archivist":
        return {
            "publish": {"allow": [log, "_INBOX.>", fetch]},  # fetch: kf run follows its own log
            "subscribe": {"allow": [*bus.intake_subjects(run_id), fetch, *read]},
        }
    if role == "proposer":
        # tool requests to any device, and their answers (agents.tool_server)
        return {
            "publish": {"allow": [bus.inbound_subject(run_id), fetch, f"kf.{run_id}.tool.*"]},
            "subscribe": {"allow": [*read, f"kf.{run_id}.toolreply.>"]},
        }
    if role == "worker":
        if device_id is None:
            raise ValueError("a worker's permissions are for one device: give its device id")
        answers = bus.tool_reply_subject(run_id, device_id, ">")
        return {
            "publish": {"allow": [bus.device_inbound_subject(run_id, device_id), fetch, answers]},
            "subscribe": {"allow": [*read, bus.tool_subject(run_id, device_id)]},
        }
    raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")


def worker_user(device_id: str) -> str:
    """The NATS user name of the worker for ``device_id``."""
    return f"worker-{bus.device_token(device_id)}"


@dataclass(frozen=True)
class EnvRef:
    """A configuration value the nats-server reads from its environment (``$NAME``)."""

    name: str


def _render(value: Any, indent: int = 0) -> str:
    pad = "  " * indent
    if isinstance(value, EnvRef):
        return f"${value.name}"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return "[" + ", ".join(json.dumps(v) for v in value) + "]"
        inner = "\n".join(f"{pad}  {_render(v, indent + 1)}" for v in value)
        return f"[\n{inner}\n{pad}]"
    if isinstance(value, dict):
        inner = "\n".join(f"{pad}  {k}: {_render(v, indent + 1)}" for k, v in value.items())
        return f"{{\n{inner}\n{pad}}}"
    raise TypeError(f"cannot render {value!r} in a nats-server configuration")


def nats_config(users: Sequence[tuple[str, str | EnvRef, dict[str, Any]]], header: str = "") -> str:
    """A nats-server configuration whose ``authorization`` holds ``users``
    (``(name, password or EnvRef, permissions)``)."""
    block = {
        "users": [
            {"user": name, "password": password, "permissions": perms}
            for name, password, perms in users
        ]
    }
    head = "".join(f"# {line}\n" for line in header.splitlines())
    return f"{head}authorization: {_render(block)}\n"


@dataclass(frozen=True)
class Credential:
    """A NATS user and its password."""

    user: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class RunCredentials:
    """One run's users: the archivist, the proposers, and a worker per device."""

    run_id: str
    archivist: Credential
    proposer: Credential
    workers: tuple[tuple[str, Credential], ...] = ()

    @classmethod
    def generate(cls, run_id: str, devices: Sequence[str] = ()) -> RunCredentials:
        """Fresh random passwords for every role of ``run_id`` (workers for ``devices``)."""

        def fresh(user: str) -> Credential:
            return Credential(user, secrets.token_urlsafe(24))

        return cls(
            run_id=bus.valid_run_id(run_id),
            archivist=fresh("archivist"),
            proposer=fresh("proposer"),
            workers=tuple((d, fresh(worker_user(d))) for d in dict.fromkeys(devices)),
        )

    def credential(self, role: str, device_id: str | None = None) -> Credential:
        """The credential of ``role`` (a worker's: of ``device_id``)."""
        if role == "archivist":
            return self.archivist
        if role == "proposer":
            return self.proposer
        if role == "worker":
            for device, cred in self.workers:
                if device == device_id:
                    return cred
            raise KeyError(f"run {self.run_id} has no worker credentials for device {device_id!r}")
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")

    def options(
        self, url: str, role: str, device_id: str | None = None, *, name: str = "kf"
    ) -> bus.BusOptions:
        """Connection options for ``role`` on the server at ``url``."""
        cred = self.credential(role, device_id)
        return bus.BusOptions(url=url, user=cred.user, password=cred.password, name=name)

    def server_config(self) -> str:
        """The nats-server configuration granting each role its permissions."""
        users: list[tuple[str, str | EnvRef, dict[str, Any]]] = [
            ("archivist", self.archivist.password, permissions(self.run_id, "archivist")),
            ("proposer", self.proposer.password, permissions(self.run_id, "proposer")),
        ]
        users += [
            (cred.user, cred.password, permissions(self.run_id, "worker", device))
            for device, cred in self.workers
        ]
        return nats_config(users, header=f"kf run {self.run_id}: per-role users (kf.auth)")


# -- the archivist's check ----------------------------------------------------------------


def _fields(tag: str) -> frozenset[str]:
    cls = event_class(tag)
    if cls is None:
        return frozenset()
    return frozenset(getattr(cls, "__struct_fields__", ()))


def _speaks_for_device(tag: str) -> bool:
    cls = event_class(tag)
    return cls is not None and issubclass(cls, Observation) and "device_id" in _fields(tag)


class Entitlements:
    """Which device may report what, folded from the committed log (so every refusal is
    a pure function of the log prefix and the subject a message came on)."""

    def __init__(self) -> None:
        # the types the check reasons about must be known in this process
        import kf.llm_facts
        import kf.search_facts  # noqa: F401

        self.assigned: dict[tuple[str, int], str] = {}  # (candidate, attempt) → device
        self.devices_of: dict[str, set[str]] = {}  # candidate → every device it went to
        self.event_device: dict[str, str] = {}  # event id → the device whose work it is
        self.task_devices: dict[str, set[str]] = {}  # task → devices given any of its work
        self.tuning_asked: set[tuple[str, str]] = set()  # (task, device) asked to tune
        self.proposals: set[str] = set()  # event ids of proposals (no device's work)

    def fold(self, env: Envelope, ev: Event | None = None) -> None:
        """Take one committed envelope into account."""
        tag = env.type
        if tag == "kernel.candidate_proposed":
            self.proposals.add(env.event_id)
            return
        if tag not in _GIVES_WORK and not (
            _speaks_for_device(tag) and "candidate_id" in _fields(tag)
        ):
            return
        if ev is None:
            ev = decode_event(env)
        device = getattr(ev, "device_id", None)
        candidate = getattr(ev, "candidate_id", None)
        if not isinstance(device, str) or not isinstance(candidate, str):
            return
        self.event_device[env.event_id] = device
        task = str(getattr(ev, "task", ""))
        if tag == "search.candidate_assigned":
            self.assigned[(candidate, int(getattr(ev, "attempt", 0)))] = device
            self.devices_of.setdefault(candidate, set()).add(device)
            self.task_devices.setdefault(task, set()).add(device)
        elif tag == "search.tuning_requested":
            self.tuning_asked.add((task, device))

    def check(self, device: str | None, env: Envelope, ev: Event) -> str | None:
        """Why ``env`` may not be accepted from the intake of ``device`` (None: the
        general intake), or None when it may: what it says, then its id."""
        return self._content(device, env, ev) or _id_space(device, env.event_id)

    def _content(self, device: str | None, env: Envelope, ev: Event) -> str | None:
        tag = env.type
        if isinstance(ev, Decision):
            return f"{tag} is a decision: only the archivist's hosted agents make decisions"
        if tag in _ARCHIVIST_ONLY:
            return f"{tag} is observed only by the archivist"
        if _speaks_for_device(tag):
            claimed = getattr(ev, "device_id", None)
            if device is None:
                return (
                    f"{tag} speaks for device {claimed!r}: it is accepted only on that "
                    "device's intake subject"
                )
            if claimed != device:
                return f"{tag} claims device {claimed!r} but came on the intake of {device!r}"
            work = self._work_given(tag, device, ev)
            if work is not None:
                return work
            candidate = getattr(ev, "candidate_id", None)
            if candidate is None or tag in _ANY_CANDIDATE:
                return None
            if "attempt" in _fields(tag):
                attempt = int(getattr(ev, "attempt", 0))
                owner = self.assigned.get((candidate, attempt))
                if owner != device:
                    where = f"assigned to {owner!r}" if owner else "never assigned"
                    return (
                        f"{tag}: candidate {candidate} attempt {attempt} was {where}, "
                        f"not to {device!r}"
                    )
            elif device not in self.devices_of.get(candidate, ()):
                return f"{tag}: candidate {candidate} was never assigned to {device!r}"
            return None
        if device is not None and event_class(tag) is not None and tag not in _LIFECYCLE:
            return f"{tag} is not a device's observation: the intake of {device!r} may not send it"
        if tag == "agent.reaction_failed" and env.caused_by:
            if device is not None and env.caused_by in self.proposals:
                return (
                    f"a failed reaction to the proposal {env.caused_by} (no device's work: a "
                    f"device's failure fails only what was given to it) may not come from "
                    f"the intake of {device!r}"
                )
            owner = self.event_device.get(env.caused_by)
            if owner is not None and owner != device:
                came = "the general intake" if device is None else f"the intake of {device!r}"
                return (
                    f"a failed reaction to {env.caused_by} (work of device {owner!r}) may come "
                    f"only from that device, not from {came}"
                )
        return None

    def _work_given(self, tag: str, device: str, ev: Event) -> str | None:
        """Why a device's result that names no attempt (an audit, a tuning answer) is not
        its work, or None: a task's audit only from a device given some of that task's
        candidates, a tuning answer only from a device asked to tune that task."""
        task = str(getattr(ev, "task", ""))
        if tag == "kernel.task_audited" and device not in self.task_devices.get(task, ()):
            return (
                f"{tag}: {device!r} was never assigned a candidate of task {task!r}, so "
                "auditing it is not its work"
            )
        if tag == "tuning.config_tuned" and (task, device) not in self.tuning_asked:
            return f"{tag}: {device!r} was never asked to tune task {task!r}"
        return None


def _id_space(device: str | None, event_id: str) -> str | None:
    """Why ``event_id`` may not come from the intake of ``device``: a device's events
    carry ids in its own space, and no other intake may use an id in a device's space
    (:func:`kf.events.device_id_prefix`: otherwise one worker could take the id of
    another's coming result, which the log would then drop as a duplicate)."""
    if device is not None:
        prefix = device_id_prefix(device)
        if event_id.startswith(prefix):
            return None
        return (
            f"event id {event_id[:64]!r} is not in the id space of device {device!r} "
            f"(ids sent on its intake begin with {prefix!r}: kf.events.device_event_id)"
        )
    if DEVICE_ID_SPACE.match(event_id):
        return f"event id {event_id[:64]!r} lies in a device's id space: not for the general intake"
    return None


# -- the connections of a local run -------------------------------------------------------


@dataclass
class RunBus:
    """The bus of a local ``kf run``: one connection per role (shared when the options
    are the same, as on a token-only server) and, without ``--nats``, the embedded
    server with fresh per-run credentials, watched and restarted if it dies."""

    proposer: Client
    archivist: Client | None = None
    worker: Client | None = None  # the (first) worker's connection
    workers: dict[str, Client] = field(default_factory=dict)  # device id → its connection
    server: bus.EmbeddedServer | None = None
    url: str = ""
    watcher: asyncio.Task[None] | None = None
    _clients: list[Client] = field(default_factory=list)

    @property
    def follower(self) -> Client:
        """The connection that follows the committed log."""
        return self.archivist or self.proposer

    def watched(self) -> list[asyncio.Task[None]]:
        """Tasks whose end means the run cannot go on (the embedded server's watcher)."""
        return [self.watcher] if self.watcher is not None else []

    @classmethod
    async def open(
        cls,
        run_id: str,
        *,
        url: str | None,
        options: bus.BusOptions | None = None,
        device_id: str | None = None,
        join: bool = False,
        notify: Callable[[str], None] | None = None,
        device_ids: Sequence[str] = (),
    ) -> RunBus:
        """Start the embedded server (``url`` None) or use ``url``, and connect the roles
        this process hosts: the proposer always, the archivist unless ``join``, the worker
        of ``device_id`` (or of each of ``device_ids``: one connection per device, each
        allowed only its device's intake) when given."""
        server: bus.EmbeddedServer | None = None
        clients: dict[bus.BusOptions, Client] = {}
        devices = list(dict.fromkeys([*([device_id] if device_id else []), *device_ids]))
        try:
            if url is None:
                creds = RunCredentials.generate(run_id, devices)
                server = bus.EmbeddedServer(
                    credentials=creds, max_restarts=current().nats_restarts
                ).start()
                url = server.url
                roles = {
                    "archivist": creds.options(url, "archivist"),
                    "proposer": creds.options(url, "proposer"),
                }
                for d in devices:
                    roles[f"worker:{d}"] = creds.options(url, "worker", d)
            else:
                base = options or bus.BusOptions.from_env(url)
                base = replace(base, url=url)
                roles = {r: base.for_role(r) for r in ROLES}
                for d in devices:
                    roles[f"worker:{d}"] = roles["worker"]
            wanted = ["proposer"] + ([] if join else ["archivist"])
            if not join:
                wanted += [f"worker:{d}" for d in devices]
            got: dict[str, Client] = {}
            for role in wanted:
                key = replace(roles[role], name="")
                if key not in clients:
                    label = role.partition(":")[0]
                    clients[key] = await bus.connect(replace(roles[role], name=f"kf-run-{label}"))
                got[role] = clients[key]
        except BaseException:
            for c in clients.values():
                await bus.close(c)
            if server is not None:
                server.stop()
            raise
        workers = {d: got[f"worker:{d}"] for d in devices if f"worker:{d}" in got}
        rb = cls(
            proposer=got["proposer"],
            archivist=got.get("archivist"),
            worker=next(iter(workers.values()), None),
            workers=workers,
            server=server,
            url=url,
            _clients=list(clients.values()),
        )
        if server is not None:
            rb.watcher = asyncio.create_task(server.watch(notify or _notify))
        return rb

    async def close(self) -> None:
        """Stop watching, close every connection, stop the embedded server."""
        if self.watcher is not None:
            self.watcher.cancel()
            with contextlib.suppress(BaseException):
                await self.watcher
        for c in self._clients:
            await bus.close(c)
        if self.server is not None:
            self.server.stop()


def _notify(message: str) -> None:
    print(f"kf run: {message}", file=sys.stderr, flush=True)


# -- a deployment's configuration (compose.yaml) -------------------------------------------


#: ``KF_ALLOW_SHARED_TOKEN=1``: as ``--allow-shared-token`` (tests, scripts)
ALLOW_SHARED_ENV = "KF_ALLOW_SHARED_TOKEN"


def shared_login(opts: bus.BusOptions) -> bool:
    """Whether ``opts`` logs in as no per-role user: with a token (``--token``,
    ``KF_NATS_TOKEN``, ``nats://TOKEN@host``) or with no credentials at all."""
    if opts.user:
        return False
    parsed = urlsplit(opts.url)
    return not (parsed.username and parsed.password is not None)


def shared_login_refusal(
    verb: str, logins: Sequence[bus.BusOptions], allowed: bool, out: Any = None
) -> str | None:
    """Why ``kf <verb>`` must not start on these logins (one line), or None: a run whose
    bus has no per-role users lets every holder of the shared login forge any result,
    decision or ``run.finished``. With ``allowed`` (``--allow-shared-token``, or
    ``KF_ALLOW_SHARED_TOKEN=1``) it starts, after one warning line on ``out`` (stderr)."""
    shared = [o for o in logins if shared_login(o)]
    if not shared:
        return None
    what = (
        f"NATS at {bus.redact(shared[0].url)} is reached without a per-role user (a shared "
        "token, or no credentials), so any holder of that login can forge results, "
        "decisions and run.finished (docs/authorization.md)"
    )
    if allowed or current().get(ALLOW_SHARED_ENV) == "1":
        print(f"kf {verb}: WARNING: {what}", file=out or sys.stderr)
        return None
    return (
        f"refusing to start: {what}; give each role its own user (python -m kf.auth "
        "nats-config, KF_NATS_<ROLE>_USER/_PASSWORD) or accept this with --allow-shared-token"
    )


def trusted_devices(local: Sequence[str], given: Sequence[str] = ()) -> list[str] | None:
    """The devices whose results a run takes on their word (its ``confirm_trusted``): its
    own local worker's, those ``given`` (``kf run --trust``) and those named in
    ``KF_TRUSTED_DEVICES`` (comma-separated); any other device's result that would enter
    the archive is measured again on another device first (agents/archive.py). ``*``
    trusts every device, as kf did before (None: the run records no list)."""
    named = [n.strip() for n in (current().get("KF_TRUSTED_DEVICES") or "").split(",")]
    named += [n.strip() for n in given]
    if "*" in named:
        return None
    return sorted({*local, *(n for n in named if n)})


def password_env(role: str, device_id: str | None = None) -> str:
    """The environment variable holding a deployment's password for ``role``."""
    if role == "worker":
        if device_id is None:
            raise ValueError("a worker's password is per device")
        return "KF_NATS_WORKER_" + re.sub(r"[^A-Z0-9]", "_", device_id.upper()) + "_PASSWORD"
    return f"KF_NATS_{role.upper()}_PASSWORD"


def deployment_config(run_id: str, workers: Sequence[str]) -> str:
    """The nats-server configuration of a deployment serving ``run_id`` with ``workers``
    (device names): passwords are ``$KF_NATS_…_PASSWORD`` references the server resolves
    from its own environment, so the file holds no secret."""
    envs = [password_env("worker", w) for w in workers]
    if len(set(envs)) != len(envs):
        raise ValueError(f"worker names {list(workers)} map to the same password variable")
    users: list[tuple[str, str | EnvRef, dict[str, Any]]] = [
        ("archivist", EnvRef(password_env("archivist")), permissions(run_id, "archivist")),
        ("proposer", EnvRef(password_env("proposer")), permissions(run_id, "proposer")),
    ]
    users += [
        (worker_user(w), EnvRef(env), permissions(run_id, "worker", w))
        for w, env in zip(workers, envs, strict=True)
    ]
    return nats_config(
        users,
        header=f"kf run {run_id}: per-role users, passwords from the environment\n"
        "(generated by `python -m kf.auth nats-config`; see docs/authorization.md)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kf.auth nats-config --run R --worker NAME… [-o FILE]``."""
    p = argparse.ArgumentParser(prog="python -m kf.auth", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("nats-config", help="write a deployment's nats-server authorization")
    c.add_argument("--run", required=True, metavar="RUN_ID")
    c.add_argument(
        "--worker", action="append", default=[], metavar="NAME", help="a device (kf worker --name)"
    )
    c.add_argument("-o", "--output", help="file to write (default stdout)")
    args = p.parse_args(argv)
    try:
        text = deployment_config(args.run, args.worker)
    except ValueError as exc:
        print(f"kf.auth: {exc}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
