"""Device backends: what differs between timing on a CPU and on a GPU.

The grader side only parses and validates the device string
(:func:`kf.devices.names.parse_device`); the runner builds a :class:`Backend` after torch is
imported. The CUDA backend
synchronises the whole device, flushes L2 between trials by overwriting a buffer twice
its size, and times with CUDA events bound before any candidate is loaded; the CPU
backend times with the runner's bound ``perf_counter_ns``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

from kf.devices.names import DeviceError, parse_device
from kf.evaluation.runner.device_state import DeviceState

__all__ = [
    "Backend",
    "CPUBackend",
    "CUDABackend",
    "install_inline",
    "make_backend",
]

_EXTENSIONS = "torch.utils.cpp_extension"


def install_inline() -> None:
    """kf's ``load_inline`` (:func:`kf.cuda.inline.install`) in place of PyTorch's, for
    any code that gets it from now on: now if ``torch.utils.cpp_extension`` is imported,
    else the moment it is. Importing it costs about 0.12 CPU-seconds (setuptools) that
    most runners never need: every reference runner, and candidates without
    ``load_inline``."""
    if _EXTENSIONS in sys.modules:
        from kf.cuda import inline

        inline.install()
    elif not any(isinstance(f, _InstallOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallOnImport())


class _InstallOnImport:
    """A finder for ``torch.utils.cpp_extension`` alone: the module as the path finder
    finds it, with :func:`kf.cuda.inline.install` run once it has been executed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _EXTENSIONS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenInstall(spec.loader)
        return spec


class _ThenInstall(importlib.abc.Loader):
    """A module's own loader (every attribute of it), which then installs kf's
    ``load_inline`` into the module it executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _InstallOnImport)]
        from kf.cuda import inline

        inline.install()


class Backend:
    """Device-specific operations used by the runner; the default suits a CPU."""

    name = "cpu"
    #: Whether an address-space limit (RLIMIT_AS) can apply: a CUDA context maps far more.
    address_space_limit = True

    def __init__(self, clock_ns: Callable[[], int]) -> None:
        self.clock_ns = clock_ns
        #: device state a call left that :meth:`flush_cache` reset since the last
        #: timing reply ("": none found)
        self.found = ""
        #: the torch device tensors are made on and moved to
        self.device: Any = "cpu"

    def synchronize(self) -> None:
        """Wait for queued work to finish (nothing is queued on a CPU)."""

    def flush_cache(self) -> None:
        """Evict caches between trials (a no-op on CPU: eager and candidate both run warm)."""

    def to_device(self, value: Any) -> Any:
        """Move a tensor (or anything else, unchanged) to this device."""
        return value

    def describe_timer(self) -> str:
        return (
            "time.perf_counter_ns bound at runner start-up before candidate import; "
            "one forward call per sample"
        )

    def reset_device_state(self) -> str:
        """Undo device state a candidate's call could leave for its next timed call
        (nothing on a CPU); what was found set, for the timing's record."""
        return ""

    def capture(self, fn: Callable[[], Any], calls: int) -> Any:
        """``calls`` calls of ``fn`` in one CUDA graph: a GPU's alone."""
        raise NotImplementedError("N calls in one CUDA graph need a GPU")

    def time_graph_ns(self, graph: Any, calls: int, replays: int) -> list[int]:
        """Per-call ns of each replay of a captured graph: a GPU's alone."""
        raise NotImplementedError("N calls in one CUDA graph need a GPU")

    def time_call_ns(self, fn: Callable[[], Any]) -> int:
        """Time one call of ``fn`` in nanoseconds, synchronised on both sides."""
        self.synchronize()
        start = self.clock_ns()
        fn()
        self.synchronize()
        return self.clock_ns() - start


class CPUBackend(Backend):
    """A CPU runner: ``load_inline`` is kf's content-addressed one here too
    (:mod:`kf.cuda.inline`), so that a C++ extension is built once (in the compile stage,
    under the build limit) and every later runner loads it from the cache; with PyTorch's
    own, each runner rebuilt it into its box's scratch, the verify stage's within its
    120 s construction timeout."""

    name = "cpu"

    def __init__(self, clock_ns: Callable[[], int]) -> None:
        super().__init__(clock_ns)
        install_inline()


class CUDABackend(Backend):
    """One NVIDIA GPU: device-wide synchronisation, CUDA events, L2 flush between trials.

    Made in the runner at set-up, before any candidate code is imported: the event
    methods and the flush buffer are bound here. ``load_inline`` is replaced by kf's
    content-addressed one (:mod:`kf.cuda.inline`), and kf.cuda reports each build's
    resources on the runner's log.
    """

    name = "cuda"
    address_space_limit = False

    def __init__(self, device: str, clock_ns: Callable[[], int]) -> None:
        super().__init__(clock_ns)
        import torch

        from kf.settings import apply

        apply({"KF_CUDA_REPORT": "1"})  # this runner's CUDA builds report their resources
        install_inline()
        self.device = torch.device(device)
        torch.cuda.set_device(self.device)
        self._sync = torch.cuda.synchronize
        event = torch.cuda.Event
        self._start = event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._end = event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._record = event.record
        self._event_sync = event.synchronize
        self._elapsed_ms = event.elapsed_time
        l2 = int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0))
        # twice L2 and at least 256 MiB: the write also keeps the GPU busy while the
        # host launches the timed call, so launch latency stays out of the measurement
        self._flush = torch.empty(max(2 * l2, 256 << 20) // 4, dtype=torch.int32, device=device)
        self._zero = self._flush.zero_
        self._module = torch.nn.Module
        self._tensor = torch.Tensor
        self._graphs = _GraphTools(torch)
        #: persisting-L2 state reset before every sample (None: the driver would not
        #: say, and ``state_error`` says why; the timing records it)
        self.state: DeviceState | None = None
        self.state_error = ""
        self.machine_state = ""
        try:
            self.state = DeviceState(int(torch.cuda.current_stream(self.device).cuda_stream))
        except (OSError, AttributeError) as exc:
            self.state_error = f"device state not reset: {exc}"
        else:
            # the machine's own setting (a driver default, $CUDA_DEVICE_DEFAULT_PERSISTING_
            # L2_CACHE_PERCENTAGE_LIMIT: an H100 came up with 9,830,400 bytes set aside) is
            # reset here, before any candidate is imported, and kept apart: what a reset
            # before a timed call finds after this, a candidate left
            self.machine_state = self.state.reset()

    def synchronize(self) -> None:
        """Wait for all work on the device, every stream (``torch.cuda.synchronize``)."""
        self._sync(self.device)

    def flush_cache(self) -> None:
        """Reset the device state a call could leave (:meth:`reset_device_state`; what
        was found is kept in ``found`` for the timing's reply), then overwrite a buffer
        twice L2's size, evicting what the last trial left cached."""
        found = self.reset_device_state()
        if found:
            self.found = found
        self._zero()

    def to_device(self, value: Any) -> Any:
        if isinstance(value, self._tensor | self._module):
            return value.to(self.device)
        return value

    def reset_device_state(self) -> str:
        """The persisting-L2 set-aside, lines and timing stream's window reset
        (:class:`~kf.evaluation.runner.device_state.DeviceState`)."""
        return self.state.reset() if self.state is not None else ""

    def capture(self, fn: Callable[[], Any], calls: int) -> Any:
        """``calls`` calls of ``fn`` captured in one CUDA graph, after a warm-up on a side
        stream as torch.cuda.graphs asks."""
        return self._graphs.capture(fn, calls)

    def time_graph_ns(self, graph: Any, calls: int, replays: int) -> list[int]:
        """``graph`` (of ``calls`` calls: :meth:`capture`) replayed ``replays`` times
        between the bound events, each replay after the state reset and the L2 flush:
        the calls run back to back, with no idle gap and no launch between them.
        Per-call ns of each replay."""
        samples = []
        for _ in range(replays):
            self.flush_cache()
            self._record(self._start)
            graph.replay()
            self._record(self._end)
            self._event_sync(self._end)
            samples.append(int(self._elapsed_ms(self._start, self._end) * 1e6 / calls))
        self._sync(self.device)
        return samples

    def describe_timer(self) -> str:
        return (
            "CUDA events bound at runner set-up before candidate import, around one "
            "forward call per sample; L2 flushed before each sample; device synchronised "
            "after each"
        )

    def time_call_ns(self, fn: Callable[[], Any]) -> int:
        """GPU time of one call between two events; the device is idle again on return.

        No synchronisation before the start event: the flush queued just before keeps
        the GPU busy while the host launches ``fn``, as Triton's ``do_bench`` does.
        """
        self._record(self._start)
        fn()
        self._record(self._end)
        self._event_sync(self._end)
        self._sync(self.device)
        return int(self._elapsed_ms(self._start, self._end) * 1e6)


class _GraphTools:
    """torch's CUDA-graph pieces, bound before any candidate code is imported."""

    def __init__(self, torch: Any) -> None:
        self.graph, self.capturing = torch.cuda.CUDAGraph, torch.cuda.graph
        self.stream, self.current = torch.cuda.Stream, torch.cuda.current_stream
        self.on, self.sync = torch.cuda.stream, torch.cuda.synchronize

    def capture(self, fn: Callable[[], Any], calls: int) -> Any:
        side, here = self.stream(), self.current()
        side.wait_stream(here)
        with self.on(side):
            for _ in range(2):
                fn()
        here.wait_stream(side)
        self.sync()
        graph = self.graph()
        with self.capturing(graph):
            for _ in range(calls):
                fn()
        self.sync()
        return graph


def make_backend(device: str, clock_ns: Callable[[], int]) -> Backend:
    """The backend for a canonical device name (see :func:`kf.devices.names.parse_device`)."""
    canonical = parse_device(device)
    if canonical == "cpu":
        return CPUBackend(clock_ns)
    if canonical.startswith("cuda"):
        return CUDABackend(canonical, clock_ns)
    raise DeviceError(f"no backend for device {device!r}")  # pragma: no cover
