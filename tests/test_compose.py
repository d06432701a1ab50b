"""compose.yaml only uses kf commands that exist, with arguments they accept."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kf.agent import agent_types
from kf.cli import build_parser

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


def test_compose_nats_has_jetstream_and_auth_and_gpu_is_reserved() -> None:
    """The NATS server runs JetStream behind a token; the GPU worker reserves a GPU."""
    svcs = _services()
    nats_cmd = [str(a) for a in svcs["nats"]["command"]]
    assert "-js" in nats_cmd and "--auth" in nats_cmd
    devices = svcs["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert {"archivist", "mutator", "worker-cpu", "worker-gpu"} <= set(svcs)
