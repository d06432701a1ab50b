"""Shared fixtures: a real nats-server on a random loopback port, temporary logs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kf.bus import EmbeddedServer
from kf.logs import configure

# a task package's own user tests (tests/fixtures/packages/*/tests/) are candidates' gates,
# run by kf inside a box with the arguments kf gives them, not tests of kf
collect_ignore_glob = ["fixtures/*"]

if TYPE_CHECKING:
    from kf.evaluation import RunnerPool

configure("WARNING", json=True)

# Profiles time the reference under torch.compile too, which costs seconds of compiling on
# CI's 2 cores per fresh reference runner: off for the suite, on in the tests of it
# (tests/test_compile_baseline.py), which set $KF_COMPILE_BASELINE themselves.
os.environ.setdefault("KF_COMPILE_BASELINE", "0")
# Many tests run kf on a plain embedded nats-server (no per-role users), which kf refuses
# unless told (kf.auth.shared_login_refusal); the tests of that refusal unset it.
os.environ.setdefault("KF_ALLOW_SHARED_TOKEN", "1")
# Runs whose workers are remote (--no-worker and kf worker) would have each archive-bound
# result measured again on another device (agents/archive.py, confirm_trusted); the suite
# keeps its runs as they were, and the tests of that check unset it.
os.environ.setdefault("KF_TRUSTED_DEVICES", "*")
# A worker's hardware agent times its device before announcing it (on a CPU a 256 MiB copy
# and a matmul: about 3 s of a core in every kf run and kf worker, some 60 in the suite);
# the suite's runs do not look at those figures. The shared search run measures
# (tests/shared_runs.py; tests/test_loop.py asserts the figure), as do the probe's own tests.
os.environ.setdefault("KF_DEVICE_MEASURE", "0")
# Each kf process keeps idle runners warm (default 2), and most of the suite's whole runs
# evaluate one to four candidates: the runners that only imported torch (about 1.35 CPU-s
# each) were a large share of the suite's CPU (test_faults started 72 runners at 2, 52 at
# 1: docs/decisions.md). One idle runner keeps the warm path production takes (an idle
# runner taken, a replacement started, a CPU timing waiting for it); the tests of the
# default size unset it.
os.environ.setdefault("KF_EVAL_POOL", "1")


def _box_unavailable() -> str | None:
    """Why runners cannot be boxed on this machine (None: they can)."""
    from kf.evaluation.grader import box

    return None if os.environ.get("KF_UNSAFE_NO_SANDBOX") == "1" else box.probe()


# Where bubblewrap cannot start a box (no user namespaces in a container, say), the suite
# still tests everything else: evaluations run unboxed and marked (as --unsafe-no-sandbox
# would), the box's own tests skip with the reason, and the header says so.
_NO_BOX = _box_unavailable()
if _NO_BOX is not None:
    os.environ["KF_UNSAFE_NO_SANDBOX"] = "1"


def pytest_report_header() -> str | None:
    """Say when the suite runs without the runner box, and why."""
    if _NO_BOX is None:
        return None
    return f"runner box unavailable here ({_NO_BOX}): evaluations run unboxed and marked"


#: The slowest test files (their whole runs and real builds), slowest first, by their seconds
#: in a whole-suite run on the 2-core machine (2026-12-07, docs/benchmarks.md). They
#: are collected first, so that under pytest-xdist (scripts/test: --dist loadfile,
#: --no-loadscope-reorder) the two workers start on them and the run ends on short files:
#: xdist's own order (files with the most tests first) left these few-test files for the
#: end, where one worker could still be on one of them, with the next queued behind it,
#: while the other had finished. A file not listed (all under about 15 s) runs after
#: these, in name order; a new file of whole runs or real builds belongs here, by its time.
#: The files of :data:`COMPILE_LANE` among them are one unit of work, handed out where
#: the first of them stands (first: the lane is the longest unit). Order only; no test
#: depends on it.
SLOW_FILES = (
    "test_cuda_torchsplit.py",
    "test_pch.py",
    "test_build_hostile.py",
    "test_cuda_objcache.py",
    "test_cuda_torchfree.py",
    "test_faults.py",
    "test_tuning.py",
    "test_sandbox_box.py",
    "test_compile_baseline.py",
    "test_build_timeout.py",
    "test_recovery.py",
    "test_extract.py",
    "test_adversarial.py",
    "test_stop.py",
    "test_hostile.py",
    "test_tool_mutator.py",
    "test_dashboard.py",
    "test_forgery.py",
    "test_worker_trust.py",
    "test_llm_first_generation.py",
    "test_evaluation.py",
    "test_kernelbench.py",
    "test_multi_device.py",
    "test_trust.py",
    "test_inline_build_box.py",
    "test_cli_refusals.py",
    "test_baseline_settings.py",
    "test_log_integrity.py",
    "test_llm_run.py",
    "test_numerics.py",
    "test_robust_kbench.py",
    "test_lesson_trust.py",
    "test_eval_memory.py",
    "test_shared_memory.py",
    "test_loop.py",
    "test_timing_load.py",
    "test_runner_reuse.py",
    "test_bench_seeds.py",
    "test_runtime.py",
    "test_task_packages.py",
    "test_duplicates.py",
)


#: The files whose time is mostly compiling (nvcc and g++ over torch's headers, each build
#: on both cores): under pytest-xdist they form one unit of work, run one after another by
#: one worker, so that two of them never compile side by side (each then took about twice
#: as long) and the other workers run the files that wait on whole runs meanwhile.
COMPILE_LANE = {
    "test_cuda_torchsplit.py",
    "test_pch.py",
    "test_build_hostile.py",
    "test_cuda_objcache.py",
    "test_cuda_torchfree.py",
    "test_tuning.py",
    "test_compile_baseline.py",
    "test_build_timeout.py",
    "test_inline_build_box.py",
    "test_pch_prewarm.py",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``--dist loadfile``: each file is a unit of work, as xdist's own, except the
    files of :data:`COMPILE_LANE`, which are one unit (at the place of the first of them
    in the collection order)."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class CompileLane(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "compile-lane" if Path(path).name in COMPILE_LANE else path

    return CompileLane(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """With $KF_TEST_PROFILE set (a path prefix), one JSON line per test to
    ``<prefix>.<worker>.jsonl``: its file, wall seconds (setup, call and teardown) and
    the CPU seconds of the test process and the children it reaped meanwhile, so that
    bench/suite_profile.py can tell tests that compute from tests that wait."""
    prefix = os.environ.get("KF_TEST_PROFILE")
    if not prefix:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    wall0, cpu0 = time.monotonic(), cpu()
    yield
    line = {
        "test": item.nodeid,
        "file": item.path.name,
        "wall_s": round(time.monotonic() - wall0, 3),
        "cpu_s": round(cpu() - cpu0, 3),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with open(f"{prefix}.{line['worker']}.jsonl", "a") as out:
        out.write(json.dumps(line) + "\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of SLOW_FILES first, in its order; each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def nats_server() -> Iterator[EmbeddedServer]:
    """A real nats-server listening on a random loopback port, stopped afterwards."""
    server = EmbeddedServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """Where a test's event log lives."""
    return tmp_path / "run.db"


@pytest.fixture(scope="module")
def pool() -> Iterator[RunnerPool]:
    """Two single-threaded warm runners shared by a module's tests (a module that needs
    other runners defines its own ``pool``)."""
    from tests.runner_cases import pool_under

    yield from pool_under({})
