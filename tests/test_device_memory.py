"""Admission by device memory: a task whose inputs and outputs cannot fit twice on the
GPU is refused before any trial, with the estimate and the reason
(kf.evaluation.grader.admission)."""

from __future__ import annotations

from kf.evaluation.grader.admission import too_large
from kf.evaluation.wire.protocol import InputsMade

# KernelBench level1/23_Softmax: one 4096 x 393216 fp32 input, one output like it
SOFTMAX = {
    "input_shapes": [[4096, 393216]],
    "input_dtypes": ["float32"],
    "output_shapes": [[4096, 393216]],
    "output_dtypes": ["float32"],
}


def test_a_task_that_fits_twice_is_admitted() -> None:
    assert too_large(InputsMade(**SOFTMAX, device_total_bytes=150_109_880_320), "cuda:0") is None


def test_a_task_that_cannot_fit_is_refused_with_the_estimate() -> None:
    why = too_large(InputsMade(**SOFTMAX, device_total_bytes=24 * 10**9), "cuda:0")
    assert why is not None
    assert "about 25.8 GB" in why and "12.9 GB" in why and "cuda:0 has 24.0 GB" in why


def test_cpu_and_unknown_devices_are_not_judged() -> None:
    assert too_large(InputsMade(**SOFTMAX, device_total_bytes=10), "cpu") is None
    assert too_large(InputsMade(**SOFTMAX), "cuda:0") is None  # the runner said nothing
