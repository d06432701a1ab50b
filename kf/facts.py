"""The run-level facts every agent may see: a run starting and ending, agents and devices
coming and going, a reaction failing. Kernel-search facts live in :mod:`kf.search_facts`.
"""

from __future__ import annotations

from typing import Any

from kf.config import RunConfig
from kf.events import Decision, Observation, event

__all__ = [
    "AgentStarted",
    "AgentStopped",
    "DeviceAnnounced",
    "DeviceHeartbeat",
    "DeviceLeft",
    "DeviceLost",
    "ReactionFailed",
    "RunFinished",
    "RunStarted",
    "TaskSpec",
]

import msgspec


class TaskSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A task as it travels in the log: its source text, so no shared filesystem is needed."""

    name: str
    source: str
    sha256: str
    path: str | None = None
    seeds: tuple[tuple[str, str], ...] = ()
    #: a package's user tests, (path in the package, text): every candidate must pass them
    tests: tuple[tuple[str, str], ...] = ()
    #: a package's settings (its kf.toml, as checked)
    settings: dict[str, Any] = {}
    #: where the task was read from and how kf made it (a package, a robust-kbench folder)
    origin: dict[str, Any] = {}


@event("run.started")
class RunStarted(Observation, frozen=True, kw_only=True):
    """A run began with this configuration, seed and set of tasks."""

    run_id: str
    seed: int
    config: dict[str, Any] = {}  # the wire form of a RunConfig (kf.config): every kf's
    tasks: tuple[TaskSpec, ...] = ()
    kf_version: str = ""

    def run_config(self) -> RunConfig:
        """The run's configuration, typed (:meth:`kf.config.RunConfig.decode`: a log of
        any kf reads)."""
        return RunConfig.decode(self.config)


@event("run.finished")
class RunFinished(Decision, frozen=True, kw_only=True):
    """The run reached its end (budget spent, or nothing left to do), for the stated reason."""

    reason: str


@event("agent.started")
class AgentStarted(Observation, frozen=True, kw_only=True):
    """An agent process joined the run."""

    kind: str
    agent_id: str
    host: str = ""
    pid: int = 0


@event("agent.stopped")
class AgentStopped(Observation, frozen=True, kw_only=True):
    """An agent left the run, cleanly or not, for the stated reason."""

    kind: str
    agent_id: str
    reason: str = "drained"


@event("agent.reaction_failed")
class ReactionFailed(Observation, frozen=True, kw_only=True):
    """An agent's handler raised while reacting to an event; the agent carried on."""

    kind: str
    agent_id: str
    event_type: str
    error: str
    traceback: str = ""


@event("device.announced")
class DeviceAnnounced(Observation, frozen=True, kw_only=True):
    """A hardware agent connected and described what its device can do."""

    device_id: str
    kind: str
    agent_id: str
    capabilities: dict[str, Any] = {}


@event("device.heartbeat")
class DeviceHeartbeat(Observation, frozen=True, kw_only=True):
    """A hardware agent is alive, with its current load; ``utilisation_pct``: a GPU's mean
    utilisation since its last heartbeat as ``nvidia-smi`` sampled it (the share of the
    time a kernel ran; None where not sampled)."""

    device_id: str
    busy: int = 0
    queued: int = 0
    utilisation_pct: float | None = None


@event("device.lost")
class DeviceLost(Observation, frozen=True, kw_only=True):
    """The archivist heard nothing from a device for longer than the heartbeat timeout."""

    device_id: str
    silent_s: float
    reason: str = "no heartbeat"


@event("device.left")
class DeviceLeft(Observation, frozen=True, kw_only=True):
    """A hardware agent disconnected from the run."""

    device_id: str
    reason: str = "stopped"
