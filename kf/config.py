"""A run's configuration, typed: :class:`RunConfig`, made once by the application (``kf
run``'s flags, or a ``--config`` file under them) and recorded in the run's first event.

The log keeps the wire form every kf has written, one flat map of keys
(``RunStarted.config``: ``{"budget": 20, "islands": 2, "tf32": "off", ...}``), so that
every log stays readable. :meth:`RunConfig.decode` reads that map once, into nested
sections (as openevolve's ``Config``); each field is named by its key, and its default is
what a log without the key meant (an older log: ``search_version`` 1, no tolerance, every
device trusted). A key this kf does not know is kept (:attr:`RunConfig.other`) and written
back, never refused; a known key with a value of another type is kept there too, its
field left at the default. :meth:`RunConfig.wire` writes the map back: the keys the run
recorded, as ``kf run`` has always recorded them.

The agents read the sections (``config.search.islands``, ``config.llm.llm_url``); no
reader looks a key up in the map. The process's own facts (its cache folder, its
sandbox, its GPU pools) are :mod:`kf.settings`, never part of a run's config
(docs/decisions.md, "Configuration").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = [
    "SEARCH_VERSION",
    "Agents",
    "Evaluation",
    "Llm",
    "RunConfig",
    "Search",
    "Tasks",
    "Trust",
    "Tuning",
]

#: the search version ``kf run`` records for a new run (agents/archive.py says what each
#: version decides; a log without the key is version 1 and replays as it was decided)
SEARCH_VERSION = 5


class Search(msgspec.Struct, frozen=True, kw_only=True):
    """How the archive searches: budget, islands, what is in flight."""

    budget: int = 20
    islands: int = 2
    max_in_flight: int = 2
    crossover_rate: float = 0.3
    migrate_every: int = 8
    max_attempts: int = 3  # assignments of one candidate before it fails as lost
    search_version: int = 1
    mutator: str = ""  # who proposes: "offline", "llm: MODEL via URL", ...


class Tuning(msgspec.Struct, frozen=True, kw_only=True):
    """The tuning of a task's best kernels once its search budget is spent."""

    tune_budget: int = 0  # configurations per task and device (0: no tuning)
    tune_shapes: int = 4  # shape sets a tuner times


class Evaluation(msgspec.Struct, frozen=True, kw_only=True):
    """Where and under which conditions candidates are measured and judged; the grader's
    ``Conditions.of`` and ``Tolerance.of`` interpret them."""

    device: str = "cpu"  # the run's target (the first of --device)
    devices: tuple[str, ...] = ()  # several local devices ((): ``device`` alone)
    compile_baseline: bool = True
    compile_mode: str = ""  # "": not recorded (read as "default")
    tf32: str = ""  # "": not recorded (read as "off")
    device_inputs: bool = True
    atol: float | None = None
    rtol: float | None = None
    tolerance: str = ""  # a preset's name ("": the default)


class Trust(msgspec.Struct, frozen=True, kw_only=True):
    """Whose measurements are taken as given (issue 34)."""

    # devices whose archive-bound results are not measured again (None: every device's)
    confirm_trusted: tuple[str, ...] | None = None
    confirm_above: float = 10.0  # a speed-up above this is confirmed even if not an elite


class Llm(msgspec.Struct, frozen=True, kw_only=True):
    """The model: where it answers, what it may spend, what it writes first."""

    llm: bool = False  # an LLM-driven run
    llm_url: str = ""
    llm_models: tuple[tuple[str, float], ...] = ()
    llm_timeout_s: float = 120.0
    llm_max_retries: int = 4
    llm_backoff_s: float = 1.0
    llm_concurrency: int = 4
    llm_lookahead: int = 0  # selections beyond max_in_flight while the model answers
    llm_temperature: float = 0.7
    llm_max_context: int = 32768
    llm_max_tokens: int = 4096
    llm_usd_per_mtok_in: float = 0.0
    llm_usd_per_mtok_out: float = 0.0
    llm_budget_tokens: int | None = None
    llm_budget_calls: int | None = None
    llm_budget_usd: float | None = None
    init: int = 0  # first-generation candidates the model writes per task
    init_with_seeds: bool = False  # also for tasks that have seeds
    languages: tuple[str, ...] = ()  # languages asked for (): every one the device runs
    prompt_evolve_every: int = 2
    max_prompts: int = 6
    prompt_explore: float = 0.25


class Agents(msgspec.Struct, frozen=True, kw_only=True):
    """Which mutators answer a selection, and what a tool episode or agent may spend."""

    mutator_weights: tuple[tuple[str, float], ...] = ()  # (): single-shot only
    tool_turns: int = 8
    tool_calls: int = 12
    tool_tokens: int = 200_000
    tool_seconds: float = 900.0
    tool_timeout_s: float = 300.0
    agent_cmd: str = ""
    agent_timeout_s: float = 600.0


class Tasks(msgspec.Struct, frozen=True, kw_only=True):
    """What was asked of the tasks beyond their sources (kept in ``RunStarted.tasks``)."""

    skipped_tasks: dict[str, str] = {}  # file or task -> why it was left out
    task_selection: str | None = None  # --tasks
    shape_cap: int | None = None  # --shape-cap


_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "search": Search,
    "tuning": Tuning,
    "evaluation": Evaluation,
    "trust": Trust,
    "llm": Llm,
    "agents": Agents,
    "tasks": Tasks,
}

#: keys every run since the first has recorded, whatever their value
_ALWAYS = {
    "budget", "islands", "max_in_flight", "device", "llm", "mutator", "search_version",
    "tune_budget", "compile_baseline", "compile_mode", "tf32", "device_inputs",
}  # fmt: skip
#: keys recorded with a model (``--llm-url``), whatever their value
_WITH_LLM = {
    "llm_url", "llm_models", "llm_timeout_s", "llm_max_retries", "llm_concurrency",
    "llm_lookahead", "llm_max_context", "llm_max_tokens", "init", "init_with_seeds",
    "llm_usd_per_mtok_in", "llm_usd_per_mtok_out", "languages",
}  # fmt: skip
#: keys recorded with ``--mutators``, and with ``--agent-cmd``
_WITH_MUTATORS = {"mutator_weights", "tool_turns", "tool_calls", "tool_tokens", "tool_seconds"}
_WITH_AGENT = {"agent_timeout_s"}


class RunConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One run's configuration, in sections (see the module doc)."""

    search: Search = Search()
    tuning: Tuning = Tuning()
    evaluation: Evaluation = Evaluation()
    trust: Trust = Trust()
    llm: Llm = Llm()
    agents: Agents = Agents()
    tasks: Tasks = Tasks()
    other: dict[str, Any] = {}  # keys this kf does not know, as the log holds them

    @classmethod
    def decode(cls, config: Mapping[str, Any]) -> RunConfig:
        """The config a run recorded (``RunStarted.config``), from any kf's log: a missing
        key takes its default, an unknown one is kept in :attr:`other`. Never raises."""
        other = {k: v for k, v in config.items() if k not in _OWNER}
        sections: dict[str, msgspec.Struct] = {}
        for name, section in _SECTIONS.items():
            values: dict[str, Any] = {}
            for field in msgspec.structs.fields(section):
                if field.name not in config:
                    continue
                try:
                    values[field.name] = msgspec.convert(
                        config[field.name], field.type, strict=False
                    )
                except msgspec.ValidationError:  # kept as it was, the field's default used
                    other[field.name] = config[field.name]
            sections[name] = section(**values)
        return cls(**sections, other=other)  # type: ignore[arg-type]

    def wire(self) -> dict[str, Any]:
        """The flat map the log records (``RunStarted.config``): the keys ``kf run`` has
        always recorded (those of every run; the model's with a model; the others where
        they differ from their default), and :attr:`other`."""
        out: dict[str, Any] = {}
        for name, section in _SECTIONS.items():
            values = getattr(self, name)
            default = section()
            for field in msgspec.structs.fields(section):
                value = getattr(values, field.name)
                if value != getattr(default, field.name) or self._always(field.name):
                    out[field.name] = _plain(value)
        out.update(self.other)
        return out

    def overridden(self, values: Mapping[str, Any]) -> RunConfig:
        """This config with ``values`` over it (an agent's ``--option KEY=VALUE``: text is
        converted to the key's type); a key of no section is ignored, a value that does
        not convert raises ValueError naming the key."""
        changed: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            name = _OWNER.get(key)
            if name is None:
                continue
            field = _FIELDS[key]
            try:
                changed.setdefault(name, {})[key] = msgspec.convert(value, field, strict=False)
            except msgspec.ValidationError as exc:
                raise ValueError(f"{key}={value!r}: {exc}") from None
        sections = {
            name: msgspec.structs.replace(getattr(self, name), **fields)
            for name, fields in changed.items()
        }
        return msgspec.structs.replace(self, **sections)

    def _always(self, key: str) -> bool:
        return (
            key in _ALWAYS
            or (key in _WITH_LLM and bool(self.llm.llm_url))
            or (key in _WITH_MUTATORS and bool(self.agents.mutator_weights))
            or (key in _WITH_AGENT and bool(self.agents.agent_cmd))
        )

    def trusted(self, device_id: str) -> bool:
        """Whether ``device_id``'s archive-bound results are taken as given."""
        trusted = self.trust.confirm_trusted
        return trusted is None or device_id in trusted


def _plain(value: Any) -> Any:
    """``value`` as the log's map holds it (tuples as lists)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


#: each key and the section that holds it
_OWNER = {f.name: name for name, s in _SECTIONS.items() for f in msgspec.structs.fields(s)}
#: each key's type
_FIELDS = {f.name: f.type for s in _SECTIONS.values() for f in msgspec.structs.fields(s)}
