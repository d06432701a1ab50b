"""Logs recorded by earlier kf versions (bench/results/*.db) still replay and check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the two smallest recorded runs: an LLM run of 2 Dec and a throughput run of 4 Dec
OLD_LOGS = [
    ROOT / "bench/results/llm_kernelbench_19_ReLU_h200_2026-12-02.db",
    ROOT / "bench/results/throughput_gpu_split_h200_2026-12-04e.db",
]


@pytest.mark.parametrize("log", OLD_LOGS, ids=lambda p: p.stem)
def test_old_logs_replay_check_recomputes_every_decision(log: Path, tmp_path: Path) -> None:
    """kf replay --check on a log written before today's new default-valued fields passes."""
    copy = tmp_path / log.name
    copy.write_bytes(log.read_bytes())
    out = subprocess.run(
        [sys.executable, "-m", "kf.app.cli", "replay", "--check", str(copy)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "check: ok" in out.stdout
