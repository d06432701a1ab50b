"""A GPU's runner pool sized from its free memory (kf.evaluation.grader.pools.gpu_pool_size): a GPU
worker keeps compile jobs + 4 warm runners, each holding a CUDA context; on a small GPU
that many contexts would take the memory the tasks' tensors need. ``nvidia-smi`` here is
a real executable on PATH that answers as the driver's would (no GPU on CI)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kf.devices.smi import free_device_memory
from kf.evaluation.grader.pools import gpu_pool_size, kept_runners, runners_that_fit

MIB = 1 << 20


@pytest.mark.parametrize(
    ("requested", "free", "expected"),
    [
        (19, None, 19),  # cannot tell: as asked
        (19, 139 * 1024 * MIB, 19),  # an H200: a quarter of its memory holds 69 contexts
        (19, 24 * 1024 * MIB, 12),  # a 24 GB card: 6 GB for contexts of 512 MiB
        (19, 1024 * MIB, 2),  # nearly full: still a reference and a candidate
    ],
)
def test_runners_fit_in_a_quarter_of_the_free_memory(
    requested: int, free: int | None, expected: int
) -> None:
    assert runners_that_fit(requested, free, 512 * MIB) == expected


def _fake_smi(folder: Path, free_mib: str, rc: int = 0) -> Path:
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "$@" > "{folder}/args"\necho "{free_mib}"\nexit {rc}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder / "args"


def test_free_memory_asks_nvidia_smi_for_the_visible_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _fake_smi(tmp_path, "20480")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert free_device_memory("cuda:1") == 20480 * MIB
    assert "--id=5" in args.read_text()  # PyTorch's cuda:1 is the second visible GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    free_device_memory("cuda:1")
    assert "--id=1" in args.read_text()


@pytest.mark.parametrize(("answer", "rc"), [("20480", 9), ("No devices were found", 0)])
def test_free_memory_is_unknown_when_nvidia_smi_fails(
    answer: str, rc: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_smi(tmp_path, answer, rc)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert free_device_memory("cuda:0") is None
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert free_device_memory("cuda:0") is None


def test_a_small_gpu_gets_a_smaller_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, "4096")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("KF_RUNNER_CONTEXT_MB", "256")
    assert gpu_pool_size("cuda:0", 19) == 4  # 1 GiB of 4 for contexts of 256 MiB


def test_a_gpu_keeps_as_many_candidate_runners_as_idle_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, ``$KF_KEPT_RUNNERS`` on a GPU is its pool's size, at least 8 (so that the
    candidates in flight each find the runner their last stage kept); set, it wins."""
    monkeypatch.delenv("KF_KEPT_RUNNERS", raising=False)
    assert kept_runners(19) == 19 and kept_runners(4) == 8
    monkeypatch.setenv("KF_KEPT_RUNNERS", "0")
    assert kept_runners(19) == 0
    monkeypatch.setenv("KF_KEPT_RUNNERS", "3")
    assert kept_runners(19) == 3


def test_the_utilisation_sampler_gives_the_mean_since_its_last_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``UtilisationSampler`` reads one long-lived ``nvidia-smi -lms`` (here a script that
    answers as it does, then waits) for the visible device's id, gives the mean of what
    it read since the last take, None when nothing new came, and stops it; without
    ``nvidia-smi`` it gives None."""
    import time

    from kf.devices.smi import UtilisationSampler

    script = tmp_path / "nvidia-smi"
    answers = 'printf "10\\n20\\n[N/A]\\n30\\n"'  # then it waits, as -lms does
    script.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/args"\n{answers}\nexec sleep 60\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,7")
    sampler = UtilisationSampler("cuda:1", interval_ms=250)
    sampler.start()
    try:
        deadline = time.monotonic() + 30
        while sampler._samples != [10.0, 20.0, 30.0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sampler.take() == 20.0  # the unusable line skipped
        assert sampler.take() is None
        args = (tmp_path / "args").read_text()
        assert "--id=7" in args and "-lms 250" in args and "utilization.gpu" in args
    finally:
        proc = sampler._proc
        sampler.stop()
    assert proc is not None and proc.poll() is not None
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    missing = UtilisationSampler("cuda:0")
    missing.start()
    assert missing.take() is None
    missing.stop()


def test_a_gpu_profiles_more_candidates_at_once_than_it_verifies() -> None:
    """Profiles at once (``$KF_CUDA_PROFILE_JOBS``, 12) are set apart from verifications
    (``$KF_CUDA_VERIFY_JOBS``, 4): at four, a profile stage of 8.4 s held the H200 to 28
    timings a minute. Each is at least one."""
    from agents.worker import profile_concurrency, verify_concurrency
    from kf.settings import Settings

    plain = Settings.from_env({})
    assert (profile_concurrency(plain), verify_concurrency(plain)) == (12, 4)
    both = Settings.from_env({"KF_CUDA_PROFILE_JOBS": "6", "KF_CUDA_VERIFY_JOBS": "2"})
    assert (profile_concurrency(both), verify_concurrency(both)) == (6, 2)
    assert profile_concurrency(Settings.from_env({"KF_CUDA_PROFILE_JOBS": "0"})) == 1


def test_a_run_keeps_a_gpus_pipeline_full_unless_told() -> None:
    """Without ``--max-in-flight`` a run keeps two candidates in flight per local CPU and
    24 per local GPU (what the H200's throughput runs used: two left its builds, checks
    and timings mostly idle), two with no local worker."""
    from kf.devices.slots import default_in_flight

    assert default_in_flight(["cpu"]) == 2
    assert default_in_flight(["cuda:0"]) == 24
    assert default_in_flight(["cuda:0", "cuda:1"]) == 48
    assert default_in_flight([]) == 2
