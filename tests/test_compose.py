"""compose.yaml only uses kf commands that exist, with arguments they accept."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kf.agent import agent_types
from kf.app.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _expand(text: str) -> str:
    """Compose-style ${VAR:-default} / ${VAR:?message} with defaults or a placeholder."""
    return re.sub(
        r"\$\{(\w+)(?::-([^}]*)|:\?[^}]*)?\}", lambda m: m.group(2) or f"<{m.group(1)}>", text
    )


def _services() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def test_compose_kf_commands_parse() -> None:
    """Every kf service's command is accepted by kf's own argument parser."""
    parser = build_parser()
    kf_services = 0
    for name, svc in _services().items():
        cmd = [_expand(str(a)) for a in svc.get("command", [])]
        if not cmd or cmd[0] != "kf":
            continue
        kf_services += 1
        args = parser.parse_args(cmd[1:])
        assert callable(args.func), name
    assert kf_services >= 5


def test_compose_agents_and_hosted_agents_are_registered() -> None:
    """`kf agent KIND` and `--host KIND` name registered agent types."""
    known = set(agent_types())
    for svc in _services().values():
        cmd = [str(a) for a in svc.get("command", [])]
        if cmd[:2] == ["kf", "agent"]:
            assert cmd[2] in known
        hosted = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--host"]
        assert set(hosted) <= known


def test_compose_nats_has_jetstream_and_a_config_and_gpu_is_reserved() -> None:
    """The NATS server runs JetStream with the generated configuration; the GPU worker
    reserves a GPU."""
    svcs = _services()
    nats_cmd = [str(a) for a in svcs["nats"]["command"]]
    assert "-js" in nats_cmd and nats_cmd[nats_cmd.index("-c") + 1] == "/conf/nats.conf"
    assert "--auth" not in nats_cmd  # a token would make every holder every role
    devices = svcs["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert {"archivist", "mutator", "worker-cpu", "worker-gpu"} <= set(svcs)


def _role_of(cmd: list[str]) -> str:
    if cmd[:3] == ["kf", "agent", "archivist"]:
        return "archivist"
    if cmd[:2] == ["kf", "worker"]:
        return "worker"
    return "proposer"


def test_compose_every_kf_service_connects_as_its_role(tmp_path: Path) -> None:
    """nats-config's command writes a configuration with a user for every kf service's
    KF_NATS_USER (a worker's named after its --name), and a real nats-server with the
    services' passwords lets the archivist, and no worker, publish committed events."""
    import asyncio
    import os
    import subprocess
    import sys

    import nats

    from kf import bus
    from kf.auth import password_env, worker_user

    svcs = _services()
    gen = [_expand(str(a)) for a in svcs["nats-config"]["command"]]
    conf = tmp_path / "nats.conf"
    gen[gen.index("-o") + 1] = str(conf)
    subprocess.run([sys.executable, *gen[1:]], cwd=ROOT, check=True)
    text = conf.read_text()
    run = gen[gen.index("--run") + 1]
    passwords = {v: os.urandom(8).hex() for v in svcs["nats"]["environment"]}
    logins: dict[str, tuple[str, str]] = {}
    for name, svc in svcs.items():
        cmd = [str(a) for a in svc.get("command", [])]
        if not cmd or cmd[0] != "kf":
            continue
        env = {k: str(v) for k, v in svc["environment"].items()}
        role, user = _role_of(cmd), env["KF_NATS_USER"]
        device = cmd[cmd.index("--name") + 1] if role == "worker" else None
        assert user == (worker_user(device) if device else role), name
        assert f'user: "{user}"' in text, name
        assert env["KF_NATS_PASSWORD"].startswith("${" + password_env(role, device)), name
        logins[name] = (user, passwords[password_env(role, device)])
    server = subprocess.Popen(
        [bus.nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", "-1"],
        env={**os.environ, **passwords},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        port = next(
            int(line.rsplit(":", 1)[1])
            for line in server.stderr
            if "Listening for client connections on" in line
        )

        async def committed_by(names: list[str]) -> list[bytes]:
            url = f"nats://127.0.0.1:{port}"
            conns = {
                n: await nats.connect(url, user=logins[n][0], password=logins[n][1])
                for n in ["archivist", *names]
            }
            got: list[bytes] = []
            real = asyncio.Event()

            async def on_msg(msg: Any) -> None:
                got.append(msg.data)
                if msg.data == b"archivist":
                    real.set()

            await conns["archivist"].subscribe(bus.log_subject(run), cb=on_msg)
            await conns["archivist"].flush()
            for n in [*names, "archivist"]:
                await conns[n].publish(bus.log_subject(run), n.encode())
                await conns[n].flush()
            await real.wait()  # the others' publications came first, and were dropped
            for nc in conns.values():
                await nc.close()
            return got

        others = ["mutator", "worker-cpu", "worker-gpu", "starter"]
        assert asyncio.run(asyncio.wait_for(committed_by(others), 20)) == [b"archivist"]
    finally:
        server.terminate()
        server.wait(10)
        server.stderr.close() if server.stderr else None
