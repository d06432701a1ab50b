"""Hardware counters: the profiled call run once more under Nsight Compute."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from kf.cuda import ncu
from kf.evaluation.grader import box
from kf.evaluation.grader.baseline import holds_no_baseline
from kf.evaluation.grader.grading import CandidateFailed
from kf.evaluation.grader.sandbox import Limits, RunnerError, RunnerHandle, RunnerPool
from kf.evaluation.grader.session import GradingSession, Stage
from kf.evaluation.wire.protocol import Counters
from kf.kernels.tasks import Task
from kf.reports import CountersReport

#: how long the counters of one candidate may take by default (ncu replays each kernel)
COUNTERS_TIMEOUT_S = 300.0


def collect_counters(
    task: Task,
    source: str,
    *,
    device: str,
    seed: int = 0,
    timeout_s: float = COUNTERS_TIMEOUT_S,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
) -> CountersReport:
    """Nsight Compute's counters for one forward call of a (verified) candidate.

    The candidate runs in a runner started under ``ncu`` (:mod:`kf.cuda.ncu`), inside
    the runner's box, after a forward call checked against the reference as in every
    stage. ncu is never run outside the box: where the driver lets only administrators
    read counters, the report says so. Unboxed runners (``--unsafe-no-sandbox``) try
    once outside their network namespace instead, and the report says that. Call it
    with the device to itself: ncu replays each kernel.
    """
    session = GradingSession(
        task, source, device=device, seed=seed, pool=pool, limits=limits or Limits(),
        timeout_s=timeout_s,
    )  # fmt: skip
    return counters_session(session)


def counters_session(session: GradingSession) -> CountersReport:
    """:func:`collect_counters` of the session's candidate."""
    stage = Stage(session)
    return stage.sandboxed(_counters(stage))


def _measured(stage: Stage, cand: RunnerHandle) -> str | None:
    """The runner under ncu started holding no share of the device (Python, torch and
    the CUDA context, made before it says it is ready: host work, as a pooled runner's
    start is), and the reference runner leased; the candidate loaded and checked sharing
    the device; the one measured call made with the device alone. What is wrong with the
    candidate's output, or None."""
    cand.wait_ready()
    # never the runner holding the task's compiled baseline: this stage holds its
    # reference through a turn that lets every timing go first, and a profile that
    # waited for that runner in vain compiled the baseline again, holding its share of
    # the device for 11 s, while every timing waited (twice in the H200's run r3)
    lease = stage.reference_lease(prefer=holds_no_baseline, only_preferred=True)
    with lease, stage.session.shared():
        _, _, problem = stage.loaded_and_checked()
        if problem is not None:
            return problem[1]
        with stage.session.exclusively():
            stage.candidate(Counters(), what="the profiled call")
    cand.finish(stage.deadline.left())
    return None


def _failed(error: str, tool: str, device: str, start: float) -> CountersReport:
    """No counters, and why."""
    return CountersReport(
        ok=False, error=error, tool=tool, device=device, duration_s=time.monotonic() - start
    )


def _counters(stage: Stage) -> CountersReport:
    """:func:`counters_session` in ``stage``."""
    device, pool = stage.device, stage.session.runners
    start = time.monotonic()
    tool = ncu.find_ncu(stage.session.grader)  # the grading process's, as the session has them
    if not device.startswith("cuda") or tool is None:
        why = "not a CUDA device" if tool else "ncu (Nsight Compute) was not found"
        return CountersReport(ok=False, error=why, device=device)
    version = ncu.version(tool)
    folder = Path(tempfile.mkdtemp(prefix="kf-ncu-"))
    try:
        for isolate in (True, False):
            log_file = folder / f"ncu-{int(isolate)}.csv"
            # the file alone is bound writable into the box, not its folder: the box can
            # write ncu's rows into it, never put a link or a FIFO in its place
            log_file.touch()
            stage.restart_clock()
            cand = RunnerHandle(
                pool.python,
                pool.threads,
                wrapper=ncu.command(tool, str(log_file)),
                warm=device,  # the CUDA context under ncu before it is ready
                isolate=isolate,
                ro_paths=tuple(ncu.install_paths(tool)),
                rw_paths=(str(log_file),),
            )
            stage.use(cand=cand)
            boxed = cand.sandbox == box.MODE_BWRAP
            isolated = cand.isolated_network
            try:
                problem = _measured(stage, cand)
                if problem is not None:
                    return _failed(f"wrong output under ncu: {problem}", version, device, start)
            except CandidateFailed as exc:
                return _failed(f"{exc.kind}: {exc.error}", version, device, start)
            except RunnerError as exc:  # the runner under ncu did not start or answer
                if isolated and not boxed:
                    continue  # ncu may not work inside the namespace: once more outside
                return CountersReport(
                    ok=False, error=f"the runner under ncu failed: {exc}; log: "
                    f"{exc.log_tail[-1500:]}", tool=version, device=device,
                    duration_s=time.monotonic() - start,
                    unusable=not cand.ready,  # before any candidate code: the tool's fault
                )  # fmt: skip
            finally:
                tail = cand.log_tail()
                cand.kill()
            try:
                text = ncu.read_log(log_file)  # bounded, never a link or a FIFO
            except ncu.LogRefused as exc:
                return _failed(str(exc), version, device, start)
            kernels = ncu.parse(text)
            if kernels:
                return CountersReport(
                    ok=True, tool=version, device=device, kernels=tuple(kernels),
                    summary=ncu.summarise(kernels), network_isolated=isolated,
                    duration_s=time.monotonic() - start,
                )  # fmt: skip
            if boxed and ncu.permission_refused(text + tail):
                return CountersReport(
                    ok=False, error="ncu may not read the GPU's counters inside kf's box (the "
                    "driver lets only administrators: NVreg_RestrictProfilingToAdminUsers=0 "
                    "allows everyone)", tool=version, device=device,
                    duration_s=time.monotonic() - start,
                )  # fmt: skip
            if boxed or not (isolated and ncu.permission_refused(text + tail)):
                break
        detail = (text.strip() or tail.strip())[-1500:]
        return CountersReport(
            ok=False, error=f"ncu measured no kernel: {detail}", tool=version, device=device,
            duration_s=time.monotonic() - start,
        )  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
