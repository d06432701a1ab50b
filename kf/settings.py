"""kf's settings: every ``KF_*`` environment variable kf reads, in one object.

:class:`Settings` is built from an environment (:meth:`Settings.from_env`) and says, for
each variable, what kf makes of it: its name, default and meaning are here and in
docs/settings.md, nowhere else. A process reads its settings through :func:`current`:
its own environment, read once and read again only when its ``KF_*`` variables change
(a test's ``monkeypatch.setenv``), with what its command line asked for on top
(:func:`apply`). A runner process reads its own settings the same way, from the
environment its pool started it with (:mod:`kf.evaluation.grader.sandbox`, whose boxed runners
see an allow-listed few, :mod:`kf.evaluation.grader.box`).

Values are parsed when asked for, as each reader did before: a malformed number fails the
stage that needs it, with a message that names the variable, and nothing else.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["OFF", "SettingError", "Settings", "applied", "apply", "current"]

#: the words that turn a default-on switch off (``KF_COMPILE_BASELINE``, ``KF_COMPILE_CACHE``)
OFF = frozenset({"0", "off", "false", "no"})


class SettingError(ValueError):
    """A ``KF_*`` variable holds a value kf cannot use; the message names it and the value."""


def _kf(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` settings are made of: ``KF_*``, and ``OPENAI_API_KEY``
    (the LLM key's fallback)."""
    names = [k for k in list(environ) if k.startswith("KF_") or k == "OPENAI_API_KEY"]
    # looked up one by one: another thread may change the environment meanwhile
    found = {k: environ.get(k) for k in names}
    return {k: v for k, v in found.items() if v is not None}


@dataclass(frozen=True)
class Settings:
    """kf's settings, read from the ``KF_*`` variables of one environment."""

    #: the variables as read (secrets among them: never printed)
    variables: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        """The settings ``environ`` gives (only its ``KF_*`` variables are kept)."""
        return cls(variables=_kf(environ))

    def with_values(self, values: Mapping[str, str]) -> Settings:
        """These settings with ``values`` (variable name → value) instead."""
        return Settings(variables={**self.variables, **values})

    def get(self, name: str, default: str | None = None) -> str | None:
        """The raw value of variable ``name`` (``default`` when unset)."""
        return self.variables.get(name, default)

    def _text(self, name: str, default: str = "") -> str:
        return self.variables.get(name, default)

    def _number(self, name: str, what: str = "a whole number") -> int | None:
        raw = self.variables.get(name, "").strip()
        if not raw:
            return None
        try:
            return int(raw)
        except ValueError as exc:
            raise SettingError(f"${name}={raw!r} is not {what}") from exc

    # -- caches and builds ---------------------------------------------------------------

    @property
    def cache_dir(self) -> Path:
        """``KF_CACHE_DIR``: the root of kf's build caches (default ``~/.cache/kf``)."""
        return Path(self._text("KF_CACHE_DIR") or Path.home() / ".cache" / "kf")

    @property
    def cache_shared(self) -> Path | None:
        """``KF_CACHE_SHARED``: in a runner's box, the grader's cache, bound read-only."""
        root = self._text("KF_CACHE_SHARED")
        return Path(root) if root else None

    @property
    def build_timeout_s(self) -> float | None:
        """``KF_BUILD_TIMEOUT_S``: one build's limit, when set and positive (default 600 s,
        :mod:`kf.buildlimits`)."""
        raw = self._text("KF_BUILD_TIMEOUT_S").strip()
        if not raw:
            return None
        try:
            value = float(raw)
        except ValueError as exc:
            raise SettingError(f"$KF_BUILD_TIMEOUT_S={raw!r} is not a number of seconds") from exc
        return value if value > 0 else None

    def _jobs(self, name: str) -> int | None:
        """A count of things at once: at least 1; None when unset."""
        jobs = self._number(name)
        return None if jobs is None else max(1, jobs)

    @property
    def build_jobs(self) -> int | None:
        """``KF_BUILD_JOBS``: builds at once in one process (default: its usable cores)."""
        return self._jobs("KF_BUILD_JOBS")

    @property
    def build_nice(self) -> int:
        """``KF_BUILD_NICE``: how much lower than grading a build runs (default 10)."""
        return max(0, int(self._text("KF_BUILD_NICE", "10")))

    @property
    def build_service(self) -> bool:
        """``KF_BUILD_SERVICE=1``: this runner is boxed; its builds are asked of the grader."""
        return self._text("KF_BUILD_SERVICE") == "1"

    @property
    def objcache(self) -> bool:
        """``KF_OBJCACHE``: the compiler-output cache of CUDA builds (default on; ``0``: off)."""
        return self._text("KF_OBJCACHE", "1") != "0"

    @property
    def pch(self) -> str:
        """``KF_PCH``: a precompiled ``torch/extension.h`` for ``load_inline``'s
        ``main.cpp``: ``cuda`` (default) for builds with CUDA sources, ``all`` for C++-only
        ones too, ``0`` never; needs the object cache."""
        value = self._text("KF_PCH", "cuda").strip().lower()
        if value in OFF:
            return "off"
        if value not in ("cuda", "all", "1", "on"):
            raise SettingError(f"KF_PCH={value!r}: expected cuda, all or 0")
        return "all" if value in ("all", "1", "on") else "cuda"

    @property
    def torchfree(self) -> bool:
        """``KF_TORCHFREE``: ``load_inline``'s ``cuda_sources`` that name nothing of torch
        are first compiled without the ``#include <torch/types.h>`` PyTorch puts in front
        (:mod:`kf.cuda.torchfree`; default on, ``0``: off)."""
        return self._text("KF_TORCHFREE", "1").strip().lower() not in OFF

    @property
    def device_measure(self) -> bool:
        """``KF_DEVICE_MEASURE``: a worker's hardware agent times its device for the
        capabilities it announces (a CPU: a 256 MiB copy and a matmul, about 3 s of a core
        before the device is announced; default on; ``0``: described, not measured)."""
        return self._text("KF_DEVICE_MEASURE", "1").strip().lower() not in OFF

    @property
    def pch_dir(self) -> str | None:
        """``KF_PCH_DIR``: where a build box looks for the precompiled header (set by the
        grader's build box, :mod:`kf.evaluation.grader.builds`)."""
        return self._text("KF_PCH_DIR") or None

    @property
    def pch_make(self) -> str | None:
        """``KF_PCH_MAKE``: where a build box may make a missing precompiled header."""
        return self._text("KF_PCH_MAKE") or None

    @property
    def objcache_log(self) -> str | None:
        """``KF_OBJCACHE_LOG``: a file that also gets each of the cache's verdicts."""
        return self._text("KF_OBJCACHE_LOG") or None

    @property
    def cuda_arch(self) -> str | None:
        """``KF_CUDA_ARCH``: NVRTC's target (default: the current device's, else sm_90)."""
        return self._text("KF_CUDA_ARCH") or None

    @property
    def cuda_report(self) -> bool:
        """``KF_CUDA_REPORT``: print each CUDA build's resources (set in GPU runners)."""
        return bool(self._text("KF_CUDA_REPORT"))

    @property
    def cuda_compile_jobs(self) -> int | None:
        """``KF_CUDA_COMPILE_JOBS``: compiles at once on a CUDA worker (default: all
        cores but one, at least 2)."""
        return self._jobs("KF_CUDA_COMPILE_JOBS")

    @property
    def cuda_verify_jobs(self) -> int | None:
        """``KF_CUDA_VERIFY_JOBS``: verifications at once on a GPU (default 4)."""
        return self._jobs("KF_CUDA_VERIFY_JOBS")

    @property
    def cuda_profile_jobs(self) -> int | None:
        """``KF_CUDA_PROFILE_JOBS``: profiles at once on a GPU, one per task (default 12)."""
        return self._jobs("KF_CUDA_PROFILE_JOBS")

    @property
    def counters_share(self) -> float:
        """``KF_COUNTERS_SHARE``: the most of a GPU's time the counter collector's turns
        may take, as a fraction (default 0.1; at least 0.01, at most 1)."""
        raw = self._text("KF_COUNTERS_SHARE").strip()
        try:
            share = float(raw) if raw else 0.1
        except ValueError:
            raise SettingError(f"$KF_COUNTERS_SHARE={raw!r} is not a fraction") from None
        return min(1.0, max(0.01, share))

    @property
    def ncu(self) -> str | None:
        """``KF_NCU``: Nsight Compute's path, or ``0`` for no counters (default: found)."""
        return self._text("KF_NCU") or None

    # -- the runner box and the runners --------------------------------------------------

    @property
    def unsafe_no_sandbox(self) -> bool:
        """``KF_UNSAFE_NO_SANDBOX=1``: runners without the box (every report marked)."""
        return self._text("KF_UNSAFE_NO_SANDBOX") == "1"

    @property
    def bwrap(self) -> str | None:
        """``KF_BWRAP``: the bubblewrap binary (default: ``bwrap`` on PATH)."""
        return self._text("KF_BWRAP") or None

    def megabytes(self, name: str) -> int | None:
        """``KF_SANDBOX_SCRATCH_MB`` or ``KF_SANDBOX_SHM_MB``: a box's tmpfs size in MiB,
        at least 1 (None: the box's default, 1024 and 64)."""
        mb = self._number(name, "a whole number of MiB")
        return None if mb is None else max(1, mb)

    @property
    def sandbox_env(self) -> tuple[str, ...]:
        """``KF_SANDBOX_ENV``: more variables a boxed runner gets (comma-separated; never
        one that looks like a secret)."""
        return tuple(n.strip() for n in self._text("KF_SANDBOX_ENV").split(",") if n.strip())

    @property
    def sandbox_ro_paths(self) -> tuple[Path, ...]:
        """``KF_SANDBOX_RO_PATHS``: more paths bound read-only into every box (``:``-separated)."""
        return tuple(Path(p) for p in self._text("KF_SANDBOX_RO_PATHS").split(":") if p)

    @property
    def box_cgroup(self) -> bool:
        """``KF_BOX_CGROUP``: a box's processes bounded by a ``pids`` cgroup of its own where
        kf may make one (default on; ``0``: never, as where ``/sys/fs/cgroup`` is read-only)."""
        return self._text("KF_BOX_CGROUP", "1").strip().lower() not in OFF

    @property
    def box_uid_mode(self) -> bool:
        """Whether root without a ``pids`` cgroup may run boxes as uids of their own
        (``KF_BOX_UIDS=off``: no, and boxes there have no process limit)."""
        return self._text("KF_BOX_UIDS", "").strip().lower() not in OFF

    @property
    def box_uids(self) -> tuple[int, int]:
        """``KF_BOX_UIDS``: ``FIRST-LAST``, the host uids (and gids, the same numbers) a box's
        processes run as, one per box in turn, where kf runs as root without a ``pids``
        cgroup (default ``2100000000-2100065535``, which no account uses)."""
        raw = self._text("KF_BOX_UIDS", "2100000000-2100065535").strip()
        first, sep, last = raw.partition("-")
        try:
            lo, hi = int(first), int(last if sep else first)
        except ValueError as exc:
            raise SettingError(f"$KF_BOX_UIDS={raw!r} is not FIRST-LAST (whole numbers)") from exc
        if not 0 < lo <= hi < 2**32 - 1:
            raise SettingError(f"$KF_BOX_UIDS={raw!r}: expected 0 < FIRST <= LAST < 4294967295")
        return lo, hi

    @property
    def runner_message_mb(self) -> int | None:
        """``KF_RUNNER_MESSAGE_MB``: the largest message the grader reads from a runner's
        socket, MiB (default: 1024; where tensors travel as bytes, a quarter of the host's
        memory): :mod:`kf.evaluation.grader.runner_handle`."""
        mb = self._number("KF_RUNNER_MESSAGE_MB", "a whole number of MiB")
        return None if mb is None else max(1, mb)

    @property
    def eval_netns(self) -> bool:
        """``KF_EVAL_NETNS``: unboxed runners in a fresh network namespace (default on; ``0``)."""
        return self._text("KF_EVAL_NETNS", "1") != "0"

    @property
    def eval_threads(self) -> int | None:
        """``KF_EVAL_THREADS``: torch and OpenMP threads per runner (default: usable cores)."""
        raw = self._text("KF_EVAL_THREADS")
        return max(1, int(raw)) if raw else None

    @property
    def eval_memory_mb(self) -> int:
        """``KF_EVAL_MEMORY_MB``: a runner's address-space limit where one applies (8192)."""
        return int(self._text("KF_EVAL_MEMORY_MB", "8192"))

    @property
    def eval_file_mb(self) -> int:
        """``KF_EVAL_FILE_MB``: the largest file a runner may write, its log included (256)."""
        return int(self._text("KF_EVAL_FILE_MB", "256"))

    @property
    def eval_pool(self) -> int | None:
        """``KF_EVAL_POOL``: idle runners a pool keeps (default 2; a GPU worker's own)."""
        raw = self._text("KF_EVAL_POOL")
        return int(raw) if raw else None

    @property
    def reference_runners(self) -> int | None:
        """``KF_REFERENCE_RUNNERS``: idle reference runners a pool keeps over all tasks
        (each keeps its task's inputs and compiled baseline; default 4, a GPU worker 16
        where they fit beside its other runners)."""
        count = self._number("KF_REFERENCE_RUNNERS")
        if count is not None and count < 1:
            raise SettingError(f"$KF_REFERENCE_RUNNERS={count} is not a positive number")
        return count

    @property
    def kept_runners(self) -> int:
        """``KF_KEPT_RUNNERS``: candidate runners a pool keeps between one candidate's
        stages (its build's runner for its verification, that one for its profile;
        0: a fresh runner for every stage). Default 8; a GPU worker's pool, where it is
        not set (:attr:`kept_runners_set`), keeps as many as its idle runners
        (:mod:`kf.app.orchestra`), so that its candidates in flight find theirs."""
        count = self._number("KF_KEPT_RUNNERS")
        if count is not None and count < 0:
            raise SettingError(f"$KF_KEPT_RUNNERS={count} is negative")
        return 8 if count is None else count

    @property
    def kept_runners_set(self) -> bool:
        """Whether ``KF_KEPT_RUNNERS`` is set (a GPU worker sizes it by its pool otherwise)."""
        return self._number("KF_KEPT_RUNNERS") is not None

    @property
    def runner_context_bytes(self) -> int:
        """``KF_RUNNER_CONTEXT_MB`` in bytes: the device memory one warm GPU runner holds
        (its CUDA context; 512), which sizes a GPU's pool from its free memory."""
        return int(float(self._text("KF_RUNNER_CONTEXT_MB", "512")) * (1 << 20))

    @property
    def runner_warm(self) -> str | None:
        """``KF_RUNNER_WARM``: the device idle runners do their start-up work for."""
        return self._text("KF_RUNNER_WARM") or None

    @property
    def tensor_transport(self) -> str:
        """``KF_TENSOR_TRANSPORT``: ``ipc``, ``bytes`` or ``seed`` (default: by the runners)."""
        return self._text("KF_TENSOR_TRANSPORT")

    @property
    def device_inputs(self) -> bool:
        """``KF_DEVICE_INPUTS``: on a GPU, the task's ``get_inputs()`` makes its tensors
        on the device (default on; ``0`` makes them on the host, as KernelBench does)."""
        return self._text("KF_DEVICE_INPUTS").strip().lower() not in OFF

    @property
    def shm_min_bytes(self) -> int | None:
        """``KF_SHM_MIN_BYTES``: from how many bytes a payload goes as a memory file (1 MiB)."""
        raw = self._text("KF_SHM_MIN_BYTES")
        return int(raw) if raw else None

    @property
    def reference_cache_bytes(self) -> int:
        """``KF_REFERENCE_CACHE_MB`` in bytes; -1 (unset): the runner's default for its device."""
        raw = self._text("KF_REFERENCE_CACHE_MB")
        return int(float(raw) * (1 << 20)) if raw else -1

    @property
    def big_task_bytes(self) -> int:
        """``KF_BIG_TASK_MB`` in bytes: tasks above it verify one at a time (2048)."""
        return int(float(self._text("KF_BIG_TASK_MB", "2048")) * (1 << 20))

    def over_big_task(self, peak_device_mb: float | None) -> bool:
        """Whether a stage that held ``peak_device_mb`` of device memory (MB of 10**6
        bytes, as stages report it; None: not measured) held more than a big task."""
        return (peak_device_mb or 0.0) * 1e6 > self.big_task_bytes

    # -- the baselines -------------------------------------------------------------------

    @property
    def compile_baseline(self) -> bool:
        """``KF_COMPILE_BASELINE``: profiles also time ``torch.compile`` (default on)."""
        return self._text("KF_COMPILE_BASELINE", "1").strip().lower() not in OFF

    @property
    def compile_baseline_timeout_s(self) -> float:
        """``KF_COMPILE_BASELINE_TIMEOUT_S``: one compile of a reference's limit (600 s)."""
        return float(self._text("KF_COMPILE_BASELINE_TIMEOUT_S") or 600.0)

    @property
    def compile_cache(self) -> bool:
        """``KF_COMPILE_CACHE``: unboxed reference runners share inductor's cache (on)."""
        return self._text("KF_COMPILE_CACHE", "1").strip().lower() not in OFF

    @property
    def compile_mode(self) -> str:
        """``KF_COMPILE_MODE`` (``kf run --compile-mode``), as given (default ``default``;
        checked by :func:`kf.evaluation.grader.baseline_settings.compile_mode`)."""
        return self._text("KF_COMPILE_MODE").strip() or "default"

    @property
    def tf32(self) -> str:
        """``KF_TF32`` (``kf run --tf32``), lower-cased (default ``off``; checked by
        :func:`kf.evaluation.grader.baseline_settings.tf32_setting`)."""
        return self._text("KF_TF32").strip().lower() or "off"

    # -- devices, the bus, logs, the LLM -------------------------------------------------

    @property
    def device_faults(self) -> str:
        """``KF_DEVICE_FAULTS``: faults injected for tests (``ID@N,…``, :mod:`kf.devices`)."""
        return self._text("KF_DEVICE_FAULTS")

    @property
    def nats_token(self) -> str | None:
        """``KF_NATS_TOKEN``: the bus's auth token."""
        return self.get("KF_NATS_TOKEN")

    @property
    def nats_user(self) -> str | None:
        """``KF_NATS_USER``: the bus's user."""
        return self.get("KF_NATS_USER")

    @property
    def nats_password(self) -> str | None:
        """``KF_NATS_PASSWORD``: the bus user's password."""
        return self.get("KF_NATS_PASSWORD")

    def nats_role(self, role: str) -> tuple[str, str] | None:
        """``KF_NATS_<ROLE>_USER`` and ``KF_NATS_<ROLE>_PASSWORD``: the user and password
        a process connects with as ``role``, when that user is set."""
        user = self.get(f"KF_NATS_{role.upper()}_USER")
        if not user:
            return None
        return user, self._text(f"KF_NATS_{role.upper()}_PASSWORD")

    @property
    def nats_restarts(self) -> int:
        """``KF_NATS_RESTARTS``: restarts allowed to the embedded nats-server (3)."""
        return int(self._text("KF_NATS_RESTARTS", "3"))

    @property
    def log_level(self) -> str | None:
        """``KF_LOG_LEVEL``: the log level (default INFO; interactive verbs WARNING)."""
        return self._text("KF_LOG_LEVEL") or None

    @property
    def version(self) -> str:
        """``KF_VERSION``: the version recorded when kf is not installed (``dev``)."""
        return self._text("KF_VERSION", "dev")

    @property
    def llm_api_key(self) -> str | None:
        """``KF_LLM_API_KEY``, else ``OPENAI_API_KEY``, else None."""
        return self.get("KF_LLM_API_KEY") or self.get("OPENAI_API_KEY") or None

    @property
    def agent_dir(self) -> str | None:
        """``KF_AGENT_DIR``: where coding-agent CLIs get their folders (default: a temporary
        one)."""
        return self._text("KF_AGENT_DIR") or None

    @property
    def agent_keep(self) -> bool:
        """``KF_AGENT_KEEP``: keep a coding agent's folder after its episode."""
        return bool(self._text("KF_AGENT_KEEP"))


_lock = threading.Lock()
_read: tuple[dict[str, str], Settings] | None = None
_applied: dict[str, str] = {}


def current() -> Settings:
    """This process's settings: its environment's ``KF_*`` variables (read again only
    when they changed) with :func:`apply`'s values on top."""
    global _read
    variables = _kf(os.environ)
    with _lock:
        if _read is None or _read[0] != variables:
            _read = (variables, Settings(variables={**variables, **_applied}))
        return _read[1]


def apply(values: Mapping[str, str]) -> Settings:
    """Set variables for this process's settings (a command's flags: ``--tf32`` sets
    ``KF_TF32``) without touching its environment; returns the settings now in force.
    The runners a pool starts get them in their environment
    (:mod:`kf.evaluation.grader.sandbox`)."""
    global _read
    with _lock:
        _applied.update(values)
        _read = None
    return current()


def applied() -> dict[str, str]:
    """The variables :func:`apply` set in this process (for a runner's environment)."""
    with _lock:
        return dict(_applied)
