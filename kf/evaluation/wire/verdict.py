"""The reference's judgement of one comparison, as the ``checked`` reply carries it.

Which rule decided (``rule``), and, where plain allclose failed and the task could run
in float64, both errors against that float64 run (:mod:`kf.evaluation.runner.float64`).
"""

from __future__ import annotations

from kf.reports import Float64Rule

__all__ = ["Verdict"]


class Verdict(Float64Rule, frozen=True, kw_only=True):
    """The reference's judgement of one trial (:func:`kf.evaluation.runner.compare.compare_outputs`,
    :func:`kf.evaluation.runner.compare.judge_float64`).

    ``rule``: ``allclose`` (decided at atol/rtol), ``float64`` (allclose failed; decided
    against a float64 run of the reference), ``""`` (a runner of an older kf).
    ``rmse_fp64``/``max_err_fp64``: the candidate's root-mean-square and largest absolute
    error against the float64 run, ``eager_rmse_fp64``/``eager_max_err_fp64`` eager fp32's
    (the output that decided; None: no float64 run). ``fp64_skipped``: why allclose
    alone decided although it failed (the task cannot run in float64, too large, the
    ``kernelbench`` presets), "" otherwise.
    """

    ok: bool
    kind: str | None = None
    reason: str | None = None
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    min_tol: float = 0.0
