"""ncu's output read back by the grader: a file in a folder the candidate's box could
write (issue 43, "read from the code"); a link, a FIFO or an oversized file there is
refused with one line, never followed, waited on or read whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kf.cuda import ncu


def test_ncu_output_oversized_file_is_refused(tmp_path: Path) -> None:
    """A log larger than the cap (sparse: nothing is written) is refused, not read."""
    log = tmp_path / "ncu-1.csv"
    with open(log, "wb") as f:
        f.truncate(ncu.LOG_MAX_BYTES + 1)
    with pytest.raises(ncu.LogRefused, match="larger than"):
        ncu.read_log(log)


def test_ncu_output_link_to_dev_zero_is_refused(tmp_path: Path) -> None:
    """A symbolic link put where the log goes (to ``/dev/zero``) is not followed."""
    log = tmp_path / "ncu-1.csv"
    log.symlink_to("/dev/zero")
    with pytest.raises(ncu.LogRefused, match="not a regular file"):
        ncu.read_log(log)


def test_ncu_output_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    """A FIFO with no writer put where the log goes is refused at once (opened without
    blocking), not waited on."""
    log = tmp_path / "ncu-1.csv"
    os.mkfifo(log)
    with pytest.raises(ncu.LogRefused, match="not a regular file"):
        ncu.read_log(log)


def test_ncu_output_regular_file_and_missing_file_are_read(tmp_path: Path) -> None:
    """ncu's own log is read as it is; a missing one reads as nothing."""
    log = tmp_path / "ncu-1.csv"
    assert ncu.read_log(log) == ""
    log.write_text('"ID","Kernel Name"\n')
    assert ncu.read_log(log) == '"ID","Kernel Name"\n'
