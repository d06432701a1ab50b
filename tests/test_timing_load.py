"""``timer_disagreement`` holds up under host load: an honest kernel is not suspect
because the machine is busy (here: busy processes spinning on every core besides the
evaluation), and the in-process timing cheat is still flagged under the same load
(kf.evaluation.grader.timing_checks: a disagreement is measured again, the batch by the minimum
of repeats, the samples in pairs each right after an empty call). The GPU side-stream
cheat under load is in ``tests/test_adversarial_gpu.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kf.evaluation import RunnerPool, evaluate
from kf.evaluation.grader.timing_checks import confirmed, paired_disagreement, timer_disagreement
from tests.runner_cases import gelu_task

FIXTURES = Path(__file__).parent / "fixtures" / "adversarial"
#: gelu(x + b) on 4 x 64: a kernel of a few µs, where the timing loop's own cost is most
#: of what the wall clock sees (under load, the old rule flagged it 1 time in 3 here)
TINY = gelu_task(4, 64, name="tiny_gelu")
#: the same at 64 x 1024 (about 1 ms a call): forged samples (1 ns) are far beyond the
#: wall clock's slack of 0.05 ms a call; at a few µs they are within it, and only the
#: introspection flags name the cheat
TASK = gelu_task()
QUICK = {"min_time_s": 0.1, "warmup": 2, "min_trials": 20}


@contextmanager
def busy(processes: int) -> Iterator[None]:
    """Real load: ``processes`` Python processes spinning until the block ends."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)
    ]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait()


def _load() -> int:
    """Twice as many spinning processes as cores (at least 4)."""
    return max(4, 2 * (os.cpu_count() or 1))


def test_under_load_honest_kernel_not_suspect_and_cheat_flagged(pool: RunnerPool) -> None:
    """Under the same load: the honest few-µs kernel is not suspect; the cheat that
    rewrites its runner's samples is flagged (its samples are forged in every
    measurement, the re-measured ones included)."""
    with busy(_load()):
        honest = evaluate(
            TINY, (FIXTURES / "honest_cpp.py").read_text(), pool=pool, timeout_s=300,
            profile_options=QUICK,
        )  # fmt: skip
        cheat = evaluate(
            TASK, (FIXTURES / "grader_stack.py").read_text(), pool=pool, timeout_s=300,
            profile_options=QUICK,
        )  # fmt: skip
    assert honest.passed, honest.error
    assert not any(f.startswith("timer_disagreement") for f in honest.flags), honest.flags
    assert any(f.startswith("timer_disagreement") for f in cheat.flags), cheat.flags
    assert cheat.suspect


def test_rules_on_measurements() -> None:
    """Pure rules: a disagreement confirmed only while every re-measurement disagrees; the
    paired rule subtracts each pair's own empty call, so load that slows the empty call
    as much as the candidate's loop cancels out, and hidden work does not."""
    assert confirmed("x", lambda: None) is None
    again = iter(["y", "z", None])
    assert confirmed("x", lambda: next(again)) is None
    assert confirmed("x", lambda: "w") == "w"
    assert confirmed(None, lambda: "w") is None
    # an honest 17 µs kernel on a loaded host: each request's loop costs 0.4 ms a call,
    # the empty call measured later, unloaded, 0.09 ms: the unpaired rule flags it
    loaded = [(100, 100 * 0.4, 100 * 0.017)] * 3
    assert timer_disagreement(loaded, 0.09) is not None
    # measured again, each beside an empty call under the same load (0.38 ms a call)
    assert paired_disagreement([(*row, 0.38) for row in loaded]) is None
    # hidden work of 0.8 ms a call stays: its samples say 0.12 ms
    hidden = [(100, 100 * (0.38 + 0.8), 100 * 0.12, 0.38)] * 3
    assert paired_disagreement(hidden) is not None
