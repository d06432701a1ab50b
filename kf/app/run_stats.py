"""Where a run's time went: the model's answers against the evaluators' work.

Computed from the producers' wall-clock times recorded in the log (``Envelope.time``;
never used by a fold): an LLM call spans ``[time - latency_s, time]`` of its
``llm.called``; a device is busy with a candidate from its ``search.candidate_assigned``
to the first stage event that ends that attempt (a failed build, a rejection, or a
profile). Over the span from the first device's announcement to the run's end:

- ``busy_fraction`` per device: the share of that span with at least one candidate of
  the device in evaluation;
- ``waiting_for_model_s``: seconds in which no device had work while a model call was
  in flight (the evaluators starved for candidates);
- the calls' count, summed and mean latency, the seconds with at least one call in
  flight, and the most calls in flight at once;
- per GPU, its mean utilisation as its hardware agent's heartbeats carry it
  (``nvidia-smi``'s ``utilization.gpu``: the share of the time a kernel ran);
- per device, where its time went: the seconds with at least one of its candidates
  building (assigned to compiled), verifying (compiled to verified or rejected) and being
  timed (verified to profiled or rejected, the wait for the device's timing turn
  included), each stage's mean seconds per candidate, and the seconds with none (idle).
  Stages overlap (candidates are evaluated side by side), so they do not add up to busy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kf.events import Envelope, decode_event

__all__ = ["format_run_stats", "run_stats"]

_TERMINAL = ("kernel.candidate_profiled", "kernel.candidate_rejected", "kernel.candidate_compiled")
#: the stage a candidate enters when an event ends the one before
_NEXT_STAGE = {"kernel.candidate_compiled": "verifying", "kernel.candidate_verified": "timing"}


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by ``a`` and not by ``b`` (both unions)."""
    total = 0.0
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                total += bs - cur
            cur = max(cur, be)
            if cur >= e:
                break
        if cur < e:
            total += e - cur
    return total


def _max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = cur = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best


def run_stats(envelopes: Sequence[Envelope]) -> dict[str, Any]:
    """LLM time, evaluator busy fractions and time spent waiting for the model."""
    calls: list[tuple[float, float]] = []
    queued = 0.0
    assigned: dict[tuple[str, int], tuple[str, float]] = {}
    stage_at: dict[tuple[str, int], tuple[str, float]] = {}
    stages: dict[str, dict[str, list[tuple[float, float]]]] = {}
    busy: dict[str, list[tuple[float, float]]] = {}
    utilisation: dict[str, list[float]] = {}  # a GPU's, per heartbeat (nvidia-smi's mean)
    start = end = None
    for env in envelopes:
        t = env.type
        if t == "device.announced" and start is None:
            start = env.time
        elif t == "run.finished":
            end = env.time
        elif t == "device.heartbeat":
            ev = decode_event(env)
            if (pct := getattr(ev, "utilisation_pct", None)) is not None:
                utilisation.setdefault(ev.device_id, []).append(float(pct))  # type: ignore[attr-defined]
        elif t == "llm.called":
            ev = decode_event(env)
            calls.append((env.time - float(getattr(ev, "latency_s", 0.0)), env.time))
            queued += float(getattr(ev, "queued_s", 0.0))
        elif t == "search.candidate_assigned":
            ev = decode_event(env)
            key = (ev.candidate_id, ev.attempt)  # type: ignore[attr-defined]
            assigned[key] = (ev.device_id, env.time)  # type: ignore[attr-defined]
            stage_at[key] = ("building", env.time)
        elif t in _TERMINAL or t == "kernel.candidate_verified":
            ev = decode_event(env)
            key = (ev.candidate_id, getattr(ev, "attempt", 1))  # type: ignore[attr-defined]
            if key in stage_at and key in assigned:
                stage, t0 = stage_at.pop(key)
                stages.setdefault(assigned[key][0], {}).setdefault(stage, []).append((t0, env.time))
                following = _NEXT_STAGE.get(t)
                ok = t != "kernel.candidate_compiled" or ev.report.ok  # type: ignore[attr-defined]
                if following and ok:
                    stage_at[key] = (following, env.time)
            if t == "kernel.candidate_verified":
                continue
            if t == "kernel.candidate_compiled" and ev.report.ok:  # type: ignore[attr-defined]
                continue
            if key in assigned:
                device, t0 = assigned.pop(key)
                busy.setdefault(device, []).append((t0, env.time))
    if envelopes and end is None:
        end = envelopes[-1].time
    span = (end - start) if start is not None and end is not None else 0.0
    for device, t0 in assigned.values():  # still in evaluation at the end of the log
        if end is not None:
            busy.setdefault(device, []).append((t0, end))
    llm_union = _union(calls)
    all_busy = _union(iv for ivs in busy.values() for iv in ivs)
    return {
        "span_s": round(span, 3),
        "llm_calls": len(calls),
        "llm_latency_s": round(sum(b - a for a, b in calls), 3),
        "llm_mean_latency_s": round(sum(b - a for a, b in calls) / len(calls), 3)
        if calls
        else None,
        "llm_in_flight_s": round(_length(llm_union), 3),
        "llm_max_concurrent": _max_overlap(calls),
        "llm_queued_s": round(queued, 3),
        "waiting_for_model_s": round(_minus(llm_union, all_busy), 3),
        "devices": {
            d: {
                "busy_s": round(_length(_union(ivs)), 3),
                "busy_fraction": round(_length(_union(ivs)) / span, 3) if span > 0 else None,
                "candidates": len(ivs),
            }
            | _where(stages.get(d, {}), _union(ivs), span)
            | _utilisation(utilisation.get(d, []))
            for d, ivs in sorted(busy.items())
        },
    }


def _utilisation(samples: list[float]) -> dict[str, Any]:
    """A GPU's mean utilisation over its heartbeats (each the mean of ``nvidia-smi``'s
    samples since the one before), where it sent any."""
    return {"gpu_utilisation_pct": round(sum(samples) / len(samples), 1)} if samples else {}


def _where(
    stages: dict[str, list[tuple[float, float]]], busy: list[tuple[float, float]], span: float
) -> dict[str, Any]:
    """A device's seconds with at least one candidate building, verifying or being timed,
    idle (no candidate at all), and each stage's seconds per candidate summed over them."""
    out: dict[str, Any] = {}
    for stage in ("building", "verifying", "timing"):
        ivs = stages.get(stage, [])
        out[f"{stage}_s"] = round(_length(_union(ivs)), 3)
        out[f"{stage}_per_candidate_s"] = (
            round(sum(b - a for a, b in ivs) / len(ivs), 3) if ivs else None
        )
    out["idle_s"] = round(max(0.0, span - _length(busy)), 3)
    return out


def format_run_stats(stats: dict[str, Any]) -> list[str]:
    """Lines for the run summary."""
    lines = []
    if stats.get("llm_calls"):
        lines.append(
            f"model: {stats['llm_calls']} calls, mean {stats['llm_mean_latency_s']:.1f} s, "
            f"up to {stats['llm_max_concurrent']} at once, a call in flight for "
            f"{stats['llm_in_flight_s']:.1f} s of {stats['span_s']:.1f} s; calls queued for a "
            f"--llm-concurrency slot {stats.get('llm_queued_s', 0.0):.1f} s in all; "
            f"evaluators idle waiting for the model: {stats['waiting_for_model_s']:.1f} s"
        )
    for d, s in stats.get("devices", {}).items():
        frac = s["busy_fraction"]
        lines.append(
            f"evaluator {d}: busy {s['busy_s']:.1f} s"
            + (f" ({100 * frac:.0f}% of the run)" if frac is not None else "")
            + f", {s['candidates']} candidate evaluations"
            + (
                f"; GPU utilisation {s['gpu_utilisation_pct']:.1f}% (nvidia-smi, mean)"
                if s.get("gpu_utilisation_pct") is not None
                else ""
            )
        )
        if "building_s" in s:
            per = [
                f"{stage} {s[f'{stage}_s']:.1f} s"
                + (
                    f" ({s[f'{stage}_per_candidate_s']:.1f} s a candidate)"
                    if s.get(f"{stage}_per_candidate_s") is not None
                    else ""
                )
                for stage in ("building", "verifying", "timing")
            ]
            lines.append(
                f"  where its time went (seconds with at least one candidate in the stage): "
                f"{', '.join(per)}; idle {s['idle_s']:.1f} s"
            )
    return lines
