"""A µs kernel timed as N calls with no idle gap (issue 47): N calls captured in one
CUDA graph, replayed, the replay's time divided by N (pytorch #196413: one replay costs
5-7 µs, so a graph of one call would time the replay, not the kernel).

A call captured in a graph is not the call verification checked: code can ask whether
its stream is capturing (``torch.cuda.is_current_stream_capturing``) and capture less
work. So after timing, the graph is replayed once more on other inputs (each input's
values rolled by one place, written into the tensors the graph reads) and its output is
compared with the same call's outside a graph on those inputs; where they differ, the
graph's figure is not used and the reply says why.
"""

from __future__ import annotations

from typing import Any

from kf.evaluation.wire import protocol as p

__all__ = ["CHECK_ATOL", "CHECK_RTOL", "MAX_CHECKED_BYTES", "time_in_graph"]

#: the inputs a graph's check copies (a kernel under 100 µs reads far less)
MAX_CHECKED_BYTES = 2 << 30
#: graph against outside a graph: the same kernels on the same data; loose enough for
#: atomics' order, far tighter than skipped work
CHECK_RTOL, CHECK_ATOL = 1e-3, 1e-4


def time_in_graph(torch: Any, backend: Any, model: Any, inputs: list[Any], msg: p.Time) -> p.Timed:
    """``msg.graph`` calls of ``model(*inputs)`` in one graph, replayed ``msg.n`` times,
    then checked (see the module's doc). A graph that cannot be captured, or whose check
    fails, gives no samples and the reason in ``graph_error``."""
    calls = msg.graph
    method = f"graph-{calls}"
    tensors = [v for v in inputs if isinstance(v, torch.Tensor)]
    if sum(v.numel() * v.element_size() for v in tensors) > MAX_CHECKED_BYTES:
        return p.Timed(samples_ns=[], method=method, graph_error="inputs too large to check")
    last: list[Any] = [None]

    def call() -> None:
        last[0] = model(*inputs)

    try:
        with torch.no_grad():
            graph = backend.capture(call, calls)
            samples = backend.time_graph_ns(graph, calls, msg.n)
            mismatch = _check(torch, backend, graph, model, inputs, last)
    except Exception as exc:  # a call a graph cannot hold (a sync, a host read, ...)
        backend.synchronize()
        why = f"not captured in a CUDA graph: {type(exc).__name__}: {str(exc)[:1000]}"
        return p.Timed(samples_ns=[], method=method, graph_error=why, state_found=_found(backend))
    found = _found(backend)
    if mismatch:
        return p.Timed(samples_ns=[], method=method, graph_error=mismatch, state_found=found)
    return p.Timed(samples_ns=samples, method=method, state_found=found)


def _found(backend: Any) -> str:
    found, backend.found = backend.found, ""
    return str(found)


def _check(
    torch: Any, backend: Any, graph: Any, model: Any, inputs: list[Any], last: list[Any]
) -> str:
    """ "" when the graph, replayed on rolled inputs, gives what the call outside a graph
    gives on them; else why not. The inputs are restored either way."""
    saved = [v.clone() if isinstance(v, torch.Tensor) else None for v in inputs]
    try:
        for v in inputs:
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                v.copy_(v.reshape(-1).roll(1).reshape(v.shape))
        graph.replay()
        backend.synchronize()
        got = [t.clone() for t in _tensors(torch, last[0])]
        want = _tensors(torch, model(*inputs))
        backend.synchronize()
    finally:
        for v, s in zip(inputs, saved, strict=True):
            if s is not None:
                v.copy_(s)
    return _differs(torch, got, want)


def _tensors(torch: Any, out: Any) -> list[Any]:
    """A call's output as a list of tensors (anything else: none, which the comparison
    then reports)."""
    items = [out] if isinstance(out, torch.Tensor) else out
    if not isinstance(items, list | tuple):
        return []
    return [t for t in items if isinstance(t, torch.Tensor)]


def _differs(torch: Any, got: list[Any], want: list[Any]) -> str:
    why = "the graph's output on other inputs differs from the same call's outside a graph"
    if len(got) != len(want):
        return f"{why}: {len(got)} outputs against {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape or g.dtype != w.dtype:
            was, want_is = f"{tuple(g.shape)} {g.dtype}", f"{tuple(w.shape)} {w.dtype}"
            return f"{why}: output {i} is {was}, not {want_is}"
        close = torch.allclose
        if not close(g.double(), w.double(), rtol=CHECK_RTOL, atol=CHECK_ATOL, equal_nan=True):
            worst = float((g.double() - w.double()).abs().nan_to_num(0.0).max())
            return f"{why}: output {i} differs by up to {worst:.3g}"
    return ""
