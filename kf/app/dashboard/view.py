"""What the dashboard shows: a fold over the committed log, read incrementally.

:class:`RunView` feeds each committed record to the archive's own fold
(:class:`agents.archive.ArchiveAgent`, so the heatmap is exactly the archive) and keeps,
beside it, what the archive does not need but a person looking at the run does: every
candidate's compile, verification and timing reports, the devices with their
capabilities and last signs of life, the evaluations in log order with the producers'
wall-clock times, and any prompt-population events. Wall-clock times are displayed,
never folded into a decision: this view decides nothing.

Every method returning data returns JSON-ready builtins (the API serves them as they
are, and ``kf report --html`` embeds the same objects).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kf.agent import AgentContext
from kf.config import RunConfig
from kf.events import Record, UnknownEvent
from kf.facts import (
    DeviceAnnounced,
    DeviceHeartbeat,
    DeviceLeft,
    RunFinished,
    RunStarted,
)
from kf.fold import fold
from kf.kernels.behaviour import COMPUTE_LEVELS, MEMORY_LEVELS, PARALLEL_LEVELS
from kf.search_facts import (
    CandidateCompiled,
    CandidateProfiled,
    CandidateProposed,
    CandidateRejected,
    CandidateVerified,
    EliteAdmitted,
    MutationFailed,
    TaskAudited,
    TaskSkipped,
)

__all__ = ["PROMPT_PREFIXES", "RunView"]

PROMPT_PREFIXES = ("llm.", "prompt.")
"""Event types of the prompt population and recorded LLM calls (listed, never invented)."""

NO_PROMPTS = "no prompt population in this run (offline mutator)"
_MAX_TEXT = 20_000


def _builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj, str_keys=True)


def _clip(text: str | None, limit: int = _MAX_TEXT) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"\n… ({len(text) - limit} more characters)"


def _clip_tree(obj: Any, limit: int = 2000) -> Any:
    """``obj`` with every long string cut to ``limit`` characters (for display only)."""
    if isinstance(obj, str):
        return _clip(obj, limit)
    if isinstance(obj, dict):
        return {k: _clip_tree(v, limit) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clip_tree(v, limit) for v in obj]
    return obj


@dataclass
class _Device:
    device_id: str
    kind: str = ""
    agent_id: str = ""
    capabilities: dict[str, Any] = field(default_factory=dict)
    announced_at: float | None = None
    last_seen: float | None = None
    beats: int = 0
    busy: int = 0
    queued: int = 0
    left_at: float | None = None
    left_reason: str | None = None


@dataclass
class _Trace:
    """A candidate's own events, in log order, with what each report said."""

    events: list[dict[str, Any]] = field(default_factory=list)
    proposed: dict[str, Any] | None = None
    compile: dict[str, Any] | None = None
    verify: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    elite: list[dict[str, Any]] = field(default_factory=list)


class RunView:
    """The dashboard's state: the archive fold plus traces, devices, timeline, prompts."""

    def __init__(self) -> None:
        from agents.archive import ArchiveAgent

        self._agent = ArchiveAgent(AgentContext(run_id="", agent_id="archive@dashboard"))
        self.archive: Any = self._agent.initial_state()
        self.head = 0
        self.events = 0
        self.run_id = ""
        self.started_at: float | None = None
        self.last_time: float | None = None
        self.finished: str | None = None
        self.config: dict[str, Any] = {}  # shown as the log holds it
        self.run_config = RunConfig()
        self._audited: set[str] = set()  # tasks whose counted audit was seen (kf.app.report)
        self.kf_version = ""
        self.type_counts: dict[str, int] = {}
        self.traces: dict[str, _Trace] = {}
        self.devices: dict[str, _Device] = {}
        self.evaluations: list[dict[str, Any]] = []
        self.prompts: list[dict[str, Any]] = []
        self.prompt_members: dict[str, dict[str, Any]] = {}
        self.prompt_uses: dict[str, int] = {}
        self.prompt_of_selection: dict[tuple[str, int], str] = {}
        self.prompt_of_candidate: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        # tasks the audit marked degenerate, with its reason (left out of the headline)
        self.degenerate: dict[str, str] = {}
        self.mutation_failures = 0
        self.unsandboxed = 0  # stage reports of runners outside kf's box
        self.boxed = 0  # stage reports of runners in it (older logs say neither)

    # -- folding -----------------------------------------------------------------------

    def feed(self, rec: Record) -> None:
        """Fold one committed record (records must come in ``seq`` order)."""
        env, ev = rec.envelope, rec.event
        where = getattr(getattr(ev, "report", None), "sandbox", "")
        self.unsandboxed += where == "unsafe-no-sandbox"
        self.boxed += where == "bwrap"
        self.head = rec.seq
        self.events += 1
        self.run_id = self.run_id or env.run_id
        self.type_counts[env.type] = self.type_counts.get(env.type, 0) + 1
        t = env.time
        self.started_at = t if self.started_at is None else min(self.started_at, t)
        self.last_time = t if self.last_time is None else max(self.last_time, t)
        self.archive = fold([rec], self._agent, self.archive)
        meta = {"seq": rec.seq, "type": env.type, "time": t, "source": env.source}
        if isinstance(ev, RunStarted):
            self.config = dict(ev.config)
            self.run_config = ev.run_config()
            self.kf_version = ev.kf_version
        elif isinstance(ev, RunFinished):
            self.finished = ev.reason
        elif isinstance(ev, TaskSkipped):
            self.skipped[ev.task] = ev.reason
        elif isinstance(ev, TaskAudited) and ev.task not in self._audited:
            # as kf.app.report: the first audit of a trusted device
            if self.run_config.trusted(ev.device_id):
                self._audited.add(ev.task)
                if ev.audit.degenerate:
                    self.degenerate[ev.task] = ev.audit.reason
        elif isinstance(ev, MutationFailed):
            self.mutation_failures += 1
        elif isinstance(ev, CandidateProposed):
            tr = self._trace(ev.candidate_id)
            tr.proposed = {
                **meta,
                "operator": ev.operator,
                "mutator": ev.mutator,
                "note": ev.note,
                "second_parent_id": ev.second_parent_id,
                "backend": ev.backend,
            }
            tr.events.append(meta)
        elif isinstance(ev, CandidateCompiled):
            r = ev.report
            tr = self._trace(ev.candidate_id)
            tr.compile = {**meta, "device_id": ev.device_id, **_builtins(r)}
            tr.compile["log"] = _clip(r.log)
            tr.events.append(meta)
            if not r.ok:
                self._evaluated(ev.candidate_id, ev.task, t, rec.seq, ok=False)
        elif isinstance(ev, (CandidateVerified, CandidateRejected)):
            tr = self._trace(ev.candidate_id)
            tr.verify = {**meta, "device_id": ev.device_id, **_builtins(ev.report)}
            tr.events.append(meta)
            if isinstance(ev, CandidateRejected):
                self._evaluated(ev.candidate_id, ev.task, t, rec.seq, ok=False)
        elif isinstance(ev, CandidateProfiled):
            tr = self._trace(ev.candidate_id)
            tr.profile = {**meta, "device_id": ev.device_id, **_builtins(ev.report)}
            tr.events.append(meta)
            speedup = ev.report.speedup if ev.report.ok else None
            self._evaluated(ev.candidate_id, ev.task, t, rec.seq, ok=ev.report.ok, speedup=speedup)
            if ev.report.ok:  # the latency beside the speed-up (issue 47)
                self.evaluations[-1]["runtime_ms"] = ev.report.runtime_ms
        elif isinstance(ev, EliteAdmitted):
            tr = self._trace(ev.candidate_id)
            tr.elite.append({**meta, **_builtins(ev)})
            tr.events.append(meta)
        elif isinstance(ev, DeviceAnnounced | DeviceHeartbeat | DeviceLeft):
            self._device_event(ev, t)
        if isinstance(ev, CandidateProposed) and ev.selection is not None:
            pid = self.prompt_of_selection.get((ev.task, ev.selection))
            if pid is not None:
                self.prompt_of_candidate[ev.candidate_id] = pid
        if env.type.startswith(PROMPT_PREFIXES):
            data = ev.data if isinstance(ev, UnknownEvent) else _builtins(ev)
            self.prompts.append({**meta, "data": _clip_tree(data)})
            self._prompt(env.type, data, rec.seq)

    def _device_event(self, ev: DeviceAnnounced | DeviceHeartbeat | DeviceLeft, t: float) -> None:
        """A device joining, beating or leaving, at time ``t``."""
        d = self._device(ev.device_id)
        if isinstance(ev, DeviceAnnounced):
            d.kind, d.agent_id, d.capabilities = ev.kind, ev.agent_id, dict(ev.capabilities)
            d.announced_at, d.last_seen = t, t
            d.left_at, d.left_reason = None, None
        elif isinstance(ev, DeviceHeartbeat):
            d.last_seen = t if d.last_seen is None else max(d.last_seen, t)
            d.beats += 1
            d.busy, d.queued = ev.busy, ev.queued
        else:
            d.left_at, d.left_reason = t, ev.reason

    def _prompt(self, type_: str, data: dict[str, Any], seq: int) -> None:
        """Track the prompt population from whatever prompt events the run recorded."""
        pid = str(data.get("prompt_id") or "")
        if type_ in ("prompt.seeded", "prompt.rewritten") and pid:
            regions = data.get("regions")
            self.prompt_members.setdefault(
                pid,
                {
                    "prompt_id": pid,
                    "seq": seq,
                    "parent_prompt_id": data.get("parent_prompt_id"),
                    "operator": data.get("operator", "seed" if type_ == "prompt.seeded" else ""),
                    "region": data.get("region"),
                    "regions": sorted(regions) if isinstance(regions, dict) else [],
                },
            )
        elif type_ == "prompt.chosen" and pid:
            self.prompt_uses[pid] = self.prompt_uses.get(pid, 0) + 1
            task, selection = data.get("task"), data.get("selection")
            if isinstance(task, str) and isinstance(selection, int):
                self.prompt_of_selection[(task, selection)] = pid

    def _trace(self, cid: str) -> _Trace:
        tr = self.traces.get(cid)
        if tr is None:
            tr = self.traces[cid] = _Trace()
        return tr

    def _device(self, device_id: str) -> _Device:
        d = self.devices.get(device_id)
        if d is None:
            d = self.devices[device_id] = _Device(device_id=device_id)
        return d

    def _evaluated(
        self, cid: str, task: str, t: float, seq: int, *, ok: bool, speedup: float | None = None
    ) -> None:
        c = self.archive.candidates.get(cid)
        self.evaluations.append(
            {
                "candidate_id": cid,
                "task": task,
                "time": t,
                "seq": seq,
                "ok": ok,
                "speedup": speedup,
                "failure": None if ok or c is None else c.failure,
                "operator": c.operator if c is not None else "",
            }
        )

    # -- views -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """The run's identity, configuration and progress counters."""
        a = self.archive
        counts = {"proposed": 0, "compiled": 0, "correct": 0, "profiled": 0, "failed": 0}
        for t in a.tasks.values():
            for k in counts:
                counts[k] += getattr(t, k)
        return {
            "run_id": self.run_id,
            "seed": a.seed,
            "head": self.head,
            "events": self.events,
            "config": _builtins(self.config),
            "kf_version": self.kf_version,
            "started_at": self.started_at,
            "last_time": self.last_time,
            "finished": self.finished is not None,
            "finish_reason": self.finished,
            "counts": counts,
            "mutation_failures": self.mutation_failures,
            # stage reports whose runners ran outside kf's box (--unsafe-no-sandbox)
            "unsandboxed": self.unsandboxed,
            "boxed": self.boxed,
            "event_types": dict(sorted(self.type_counts.items())),
        }

    def archive_view(self) -> dict[str, Any]:
        """The MAP-Elites grid of every task and island, with each elite's speedup."""
        from agents.archive import best_candidate

        a = self.archive
        tasks = []
        for name, t in a.tasks.items():
            cells = []
            for key, cid in sorted(t.elites.items()):
                island, _, coords = key.partition(":")
                m, c, p = (int(x) for x in coords.split("."))
                cand = a.candidates.get(cid)
                cells.append(
                    {
                        "key": key,
                        "island": int(island),
                        "memory": m,
                        "compute": c,
                        "parallelism": p,
                        "candidate_id": cid,
                        "speedup": cand.speedup if cand is not None else None,
                        "runtime_ms": cand.runtime_ms if cand is not None else None,
                        "operator": cand.operator if cand is not None else "",
                    }
                )
            best = best_candidate(a, name)
            tasks.append(
                {
                    "task": name,
                    "skipped": t.skipped or self.skipped.get(name),
                    "proposed": t.proposed,
                    "correct": t.correct,
                    "failed": t.failed,
                    "best_speedup": best.speedup if best is not None else None,
                    "best_ms": best.runtime_ms if best is not None else None,
                    "best_candidate_id": best.id if best is not None else None,
                    "cells": cells,
                    "degenerate": self.degenerate.get(name),
                }
            )
        return {
            **self._headline(tasks),
            "islands": a.config.islands,
            "dims": {
                "memory": list(MEMORY_LEVELS),
                "compute": list(COMPUTE_LEVELS),
                "parallelism": list(PARALLEL_LEVELS),
            },
            "filled": sum(len(t["cells"]) for t in tasks),
            "tasks": tasks,
        }

    def _headline(self, tasks: list[dict[str, Any]]) -> dict[str, Any]:
        """The best speed-up and the geomean over the tasks the audit did not mark
        degenerate (kf.app.report.headline), and the degenerate tasks, shown on their own."""
        from agents.archive import geomean

        kept = [t["best_speedup"] for t in tasks if t["best_speedup"] and not t["degenerate"]]
        return {
            "headline_best": max(kept, default=None),
            "headline_geomean": geomean(kept) if kept else None,
            "headline_tasks": sum(1 for t in tasks if not t["degenerate"]),
            "degenerate_tasks": sorted(t["task"] for t in tasks if t["degenerate"]),
        }

    def progress(self) -> dict[str, Any]:
        """Evaluations in log order: outcome, speedup and the producer's wall-clock time."""
        ok = sum(1 for e in self.evaluations if e["ok"])
        times = [e["time"] for e in self.evaluations]
        span = (max(times) - min(times)) if len(times) > 1 else 0.0
        return {
            "evaluations": self.evaluations,
            "correct": ok,
            "failed": len(self.evaluations) - ok,
            "span_s": span,
            "per_minute": (len(times) - 1) * 60.0 / span if span > 0 else None,
        }

    def devices_view(self) -> list[dict[str, Any]]:
        """Every device seen, with its announced capabilities and last signs of life."""
        out = []
        for d in sorted(self.devices.values(), key=lambda d: d.device_id):
            out.append(
                {
                    "device_id": d.device_id,
                    "kind": d.kind,
                    "agent_id": d.agent_id,
                    "capabilities": _builtins(d.capabilities),
                    "announced": d.announced_at is not None,
                    "announced_at": d.announced_at,
                    "last_seen": d.last_seen,
                    "heartbeats": d.beats,
                    "busy": d.busy,
                    "queued": d.queued,
                    "left_at": d.left_at,
                    "left_reason": d.left_reason,
                }
            )
        return out

    def prompts_view(self) -> dict[str, Any]:
        """The prompt population (fitness from the kernels each prompt produced) and the
        run's prompt/LLM events, as recorded (possibly none)."""
        population = []
        ids = list(self.prompt_members) + sorted(set(self.prompt_uses) - set(self.prompt_members))
        for pid in ids:
            cands = [
                self.archive.candidates[cid]
                for cid, p in self.prompt_of_candidate.items()
                if p == pid and cid in self.archive.candidates
            ]
            speedups = [c.speedup for c in cands if c.status == "profiled" and c.speedup]
            population.append(
                {
                    **self.prompt_members.get(pid, {"prompt_id": pid}),
                    "uses": self.prompt_uses.get(pid, 0),
                    "candidates": len(cands),
                    "correct": len(speedups),
                    "failed": sum(1 for c in cands if c.status == "failed"),
                    "best_speedup": max(speedups) if speedups else None,
                }
            )
        return {
            "population": population,
            "events": self.prompts,
            "message": None if self.prompts else NO_PROMPTS,
        }

    def tuning_view(self) -> dict[str, Any]:
        """Per task, the configuration tuned per elite, shape set and device, and how it
        fared (search versions 3 and 4; from the archive's own fold)."""
        from agents.archive_tuning import summary

        tasks = {name: summary(self.archive, name) for name in self.archive.tasks}
        tasks = {name: rows for name, rows in tasks.items() if rows}
        return {
            "tasks": _builtins(tasks),
            "message": None if tasks else "no template tuning in this run",
        }

    def lessons_view(self) -> dict[str, Any]:
        """Per lesson the run quoted or loaded, its counts (its library's and this run's:
        prompts, controlled comparisons, gains beyond the noise, what it bought over its
        control) and status (search version 7, issue 48; from the archive's own fold)."""
        tally = self.archive.trust.tally
        rows = {
            lesson_id: {
                "status": t.status,
                "uses": t.uses,
                "comparisons": t.comparisons,
                "wins": t.wins,
                "bought": t.gain_sum / t.timed if t.timed else None,
            }
            for lesson_id, t in sorted(tally.items())
        }
        return {"lessons": rows, "message": None if rows else "no lessons in this run"}

    def candidates(self) -> list[dict[str, Any]]:
        """Every candidate in proposal order, one line each."""
        return [self._line(c) for c in self.archive.candidates.values()]

    def _line(self, c: Any) -> dict[str, Any]:
        return {
            "id": c.id,
            "task": c.task,
            "island": c.island,
            "operator": c.operator,
            "mutator": c.mutator,
            "parent_id": c.parent_id,
            "status": c.status,
            "failure": c.failure,
            "speedup": c.speedup,
            "runtime_ms": c.runtime_ms,
            "cell": list(c.cell) if c.cell is not None else None,
        }

    def candidate(self, cid: str) -> dict[str, Any] | None:
        """One candidate in full: source, diff to its parent, reports, lineage to its seed."""
        a = self.archive
        c = a.candidates.get(cid)
        if c is None:
            return None
        tr = self.traces.get(cid, _Trace())
        parent = a.candidates.get(c.parent_id or "")
        diff = None
        if parent is not None:
            diff = "".join(
                difflib.unified_diff(
                    parent.source.splitlines(keepends=True),
                    c.source.splitlines(keepends=True),
                    fromfile=f"parent {parent.id}",
                    tofile=f"candidate {c.id}",
                )
            )
        lineage = []
        seen = {cid}
        cur = parent
        while cur is not None and cur.id not in seen:
            seen.add(cur.id)
            lineage.append(self._line(cur))
            cur = a.candidates.get(cur.parent_id or "")
        second = (tr.proposed or {}).get("second_parent_id")
        return {
            **self._line(c),
            "family": c.family,
            "config": _builtins(c.config),
            "selection": c.selection,
            "error": c.error,
            "runtime_ms": c.runtime_ms,
            "runtime_std_ms": c.runtime_std_ms,
            "ref_ms": c.ref_ms,
            "source": c.source,
            "diff": diff,
            "lineage": lineage,
            "second_parent_id": second,
            "proposed": tr.proposed,
            "compile": tr.compile,
            "verify": tr.verify,
            "profile": tr.profile,
            "elite": tr.elite,
            "events": tr.events,
        }

    def state(self) -> dict[str, Any]:
        """Everything the overview shows, in one object (the page's single fetch)."""
        return {
            "run": self.run(),
            "archive": self.archive_view(),
            "progress": self.progress(),
            "devices": self.devices_view(),
            "prompts": self.prompts_view(),
            "tuning": self.tuning_view(),
            "lessons": self.lessons_view(),
            "candidates": self.candidates(),
        }
