"""Large tensors between runners as sealed memory files (kf.evaluation.wire.shared_memory).

The file is written once by its sender, sealed, and its descriptor forwarded by the
grader; the receiver refuses anything that is not a sealed memory file of the size its
description needs. Tested here: the payload itself (values, privacy of writes, every
refusal), descriptors over a real socket from another real process that lies about
them, the runner's protocol with shared memory on, and whole boxed evaluations whose
verdicts must be those of the ``torch.save`` path.
"""

from __future__ import annotations

import fcntl
import mmap
import multiprocessing
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kf.evaluation import RunnerPool
from kf.evaluation.runner.loop import Runner
from kf.evaluation.wire import file_maker, shared_memory
from kf.evaluation.wire.protocol import Check, MakeInputs, Ran, Run, decode_from_runner, encode
from tests.runner_cases import FIXTURES, check_default_verdict, pool_under, runner_pair

pytestmark = pytest.mark.skipif(not shared_memory.available(), reason="needs memfd seals")


def _values() -> list[object]:
    return [
        torch.randn(512, 1024),
        torch.arange(10),
        3,
        torch.tensor(True),
        torch.empty(0, 3),
        torch.randn(4, 4).t(),  # not contiguous: travels as torch.save bytes, strides kept
        torch.zeros((), dtype=torch.float16),
        torch.randint(0, 255, (7,), dtype=torch.uint8),
    ]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and torch.equal(a, b)
        )
    return a == b


def test_a_payload_gives_back_every_value_and_writes_stay_private() -> None:
    values = _values()
    payload = shared_memory.pack(torch, values)
    assert payload is not None and payload.nbytes >= 512 * 1024 * 4
    first = shared_memory.unpack(torch, payload)
    assert all(_same(a, b) for a, b in zip(values, first, strict=True))
    first[0][0, 0] = 99.0  # copy-on-write: neither the file nor another reader sees it
    again = shared_memory.unpack(torch, payload)
    assert again[0][0, 0].item() == values[0][0, 0].item()  # type: ignore[index]


def test_small_payloads_stay_bytes() -> None:
    assert shared_memory.pack(torch, [torch.ones(8), 1]) is None
    assert shared_memory.pack(torch, [torch.empty(0, 4)], min_bytes=0) is None  # nothing to hold
    assert shared_memory.pack(torch, [torch.ones(8), 1], min_bytes=0) is not None


def test_a_sealed_file_cannot_be_changed_by_anyone() -> None:
    payload = shared_memory.pack(torch, [torch.ones(1 << 18)])
    assert payload is not None
    with pytest.raises(PermissionError):
        os.pwrite(payload.fd, b"x", 0)
    with pytest.raises(PermissionError):
        mmap.mmap(payload.fd, payload.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
    with pytest.raises(PermissionError):
        os.ftruncate(payload.fd, 0)


def test_the_receiver_refuses_what_is_not_a_sealed_file_of_the_stated_size(
    tmp_path: Path,
) -> None:
    good = shared_memory.pack(torch, [torch.ones(1 << 18)])
    assert good is not None
    header = good.header
    unsealed = os.memfd_create("kf-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, good.nbytes)
    read_end, write_end = os.pipe()
    disk = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
    os.ftruncate(disk, good.nbytes)
    short = os.memfd_create("kf-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(short, 1024)
    fcntl.fcntl(short, fcntl.F_ADD_SEALS, shared_memory._seals())
    try:
        for fd, why in (
            (unsealed, "not sealed"),
            (read_end, "not a memory file"),
            (disk, "not a sealable memory file"),
            (short, "holds 1024 bytes"),
        ):
            with pytest.raises(ValueError, match=why):
                shared_memory.unpack(torch, shared_memory.Payload(header, os.dup(fd)))
        spec = shared_memory._decoder.decode(header[len(shared_memory.MAGIC) :])
        changes = [{"offset": 3}, {"offset": 256}, {"nbytes": 12}, {"dtype": "Tensor"}]
        changes.append({"size": [-1]})
        for change in changes:
            forged = [{"t": {**spec[0]["t"], **change}}]
            forged_header = shared_memory.MAGIC + shared_memory._encoder.encode(forged)
            with pytest.raises(ValueError, match=r"malformed|unknown dtype|negative size|holds"):
                shared_memory.unpack(torch, shared_memory.Payload(forged_header, os.dup(good.fd)))
    finally:
        for fd in (unsealed, read_end, write_end, disk, short):
            os.close(fd)


def _liar(sock: socket.socket, payload: shared_memory.Payload, how: str) -> None:
    """Another process on the grading socket (forked: no torch here, which may hang
    after a fork): a message naming a payload, then its descriptor, or not."""
    wire, fds = shared_memory.detach(Ran(outputs=payload))
    data = encode(wire)
    sock.sendall(len(data).to_bytes(4, "big") + data)
    if how == "none":
        time.sleep(5)
    elif how == "bytes":
        sock.sendall(b"\0")
    elif how == "unsealed":
        fd = os.memfd_create("kf-liar", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, payload.nbytes)
        socket.send_fds(sock, [b"\0"], [fd])
    else:
        shared_memory.send_fds(sock, fds)
    time.sleep(1)
    os._exit(0)


@pytest.mark.parametrize("how", ["honest", "none", "bytes", "unsealed"])
def test_descriptors_from_another_process_are_checked(how: str) -> None:
    from multiprocessing.connection import Connection

    payload = shared_memory.pack(torch, [torch.ones(1 << 18)])
    assert payload is not None
    mine, theirs = socket.socketpair()
    proc = multiprocessing.get_context("fork").Process(target=_liar, args=(theirs, payload, how))
    proc.start()
    theirs.close()
    conn = Connection(os.dup(mine.fileno()))
    try:
        assert conn.poll(20), "the other process sent nothing"
        msg = decode_from_runner(conn.recv_bytes())
        assert isinstance(msg, Ran)
        assert msg.fds == 1
        if how in ("none", "bytes"):
            with pytest.raises(ValueError, match=r"did not come|0 descriptors came"):
                shared_memory.receive_fds(mine, msg.fds, conn.poll, 2.0)
            return
        fds = shared_memory.receive_fds(mine, msg.fds, conn.poll, 10.0)
        got = shared_memory.attach(msg, fds)
        assert isinstance(got.outputs, shared_memory.Payload)
        if how == "unsealed":
            with pytest.raises(ValueError, match="not sealed"):
                shared_memory.unpack(torch, got.outputs)
        else:
            assert torch.equal(shared_memory.unpack(torch, got.outputs)[0], torch.ones(1 << 18))
    finally:
        proc.join(10)
        conn.close()
        mine.close()


def test_a_description_without_its_descriptor_is_refused() -> None:
    payload = shared_memory.pack(torch, [torch.ones(1 << 18)])
    assert payload is not None
    wire, _ = shared_memory.detach(Ran(outputs=payload))
    with pytest.raises(ValueError, match="names no descriptor"):
        shared_memory.attach(wire, [])


def _pair(candidate: str) -> tuple[Runner, Runner]:
    every_payload_a_file = {"shm": 0}
    return runner_pair(candidate, every_payload_a_file, every_payload_a_file)


def test_runners_move_inputs_and_outputs_as_files() -> None:
    ref, cand = _pair((FIXTURES / "honest_cpp.py").read_text())
    made = ref.op_make_inputs(MakeInputs(seed=11, send=True))
    assert isinstance(made.inputs, shared_memory.Payload)
    ran = cand.op_run(Run(inputs=made.inputs))
    assert isinstance(ran.outputs, shared_memory.Payload)
    assert isinstance(ran.inputs_after, shared_memory.Payload)
    assert ref.op_check(Check.of(ran, 11)).verdict.ok
    wrong = cand.op_run(Run(inputs=ref.op_make_inputs(MakeInputs(seed=12, send=True)).inputs))
    assert not ref.op_check(Check.of(wrong, 11)).verdict.ok


@pytest.fixture(scope="module")
def shm_pool() -> Iterator[RunnerPool]:
    yield from pool_under({"KF_SHM_MIN_BYTES": "0"})  # every payload as a file, even this task's


@pytest.mark.parametrize(
    "name", ["honest_cpp", "input_write", "hide_mutation", "stale", "cache_outputs", "forge_reply"]
)
def test_boxed_evaluations_with_files_give_the_bytes_verdicts(
    name: str, shm_pool: RunnerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KF_SHM_MIN_BYTES", "0")
    check_default_verdict(name, shm_pool)


def _pack_under_file_limit(limit: int, nbytes: int, maker: bool, out: Any) -> None:
    import resource

    if maker:
        file_maker.start_file_maker()
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    values = [torch.arange(nbytes, dtype=torch.uint8), torch.randn(3)]
    payload = shared_memory.pack(torch, values, min_bytes=0)
    if payload is None:
        out.put(None)
        return
    back = shared_memory.unpack(torch, payload)
    out.put((payload.nbytes, all(_same(a, b) for a, b in zip(values, back, strict=True))))
    file_maker.stop_file_maker()


@pytest.mark.parametrize(
    ("nbytes", "maker", "as_file"),
    [(2 << 20, False, False), (256 << 10, False, True), (2 << 20, True, True)],
)
def test_a_payload_over_the_runners_file_limit(nbytes: int, maker: bool, as_file: bool) -> None:
    """A runner's file limit (which guards its log on the host's disk) counts memory
    files too (on the H200, a 256 MB task's gate inputs hit it): a payload larger than
    the limit is a file made by the runner's file maker, started before the limit; with
    no maker it goes as bytes; under the limit the runner makes the file itself."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_pack_under_file_limit, args=(1 << 20, nbytes, maker, out))
    child.start()
    got = out.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0
    assert (got is not None) is as_file, got
    if got is not None:
        assert got[0] >= nbytes and got[1], got


def test_a_file_maker_that_is_gone_means_bytes() -> None:
    maker = file_maker.FileMaker()
    assert maker.make(4096) is not None
    maker.proc.kill()
    maker.proc.wait(10)
    assert maker.make(4096) is None
    maker.close()


def test_memory_files_come_with_their_pages() -> None:
    """Files from the maker and the runner's own are allocated when made (filling pages
    faulted in one at a time was twice as slow), except what would take over half the
    host's available memory: anything in a candidate's process may ask the maker."""
    maker = file_maker.FileMaker()
    try:
        fd = maker.make(8 << 20)
        assert fd is not None
        assert os.fstat(fd).st_blocks * 512 >= 8 << 20
        os.close(fd)
        huge = maker.make(1 << 50)  # a petabyte: the file exists, its pages do not
        assert huge is not None
        assert os.fstat(huge).st_size == 1 << 50 and os.fstat(huge).st_blocks == 0
        os.close(huge)
    finally:
        maker.close()
    own = file_maker.new_file(4 << 20)
    assert own is not None and os.fstat(own).st_blocks * 512 >= 4 << 20
    os.close(own)


def test_the_reference_runner_has_no_file_limit() -> None:
    """No candidate code runs in a reference runner: its large inputs and outputs go as
    memory files whatever the candidates' file limit."""
    from kf.evaluation.grader.baseline_settings import Conditions
    from kf.evaluation.grader.grading import Deadline, setup_request
    from kf.evaluation.grader.sandbox import Limits
    from kf.settings import Settings

    class _Handle:
        threads, warm = 1, None

    limits = Limits(file_bytes=1 << 20)
    under = (Conditions(), Settings())
    ref = setup_request(_Handle(), "cpu", limits, Deadline(10), *under, reference=True)  # type: ignore[arg-type]
    cand = setup_request(_Handle(), "cpu", limits, Deadline(10), *under)  # type: ignore[arg-type]
    assert ref.file_bytes == 0 and cand.file_bytes == 1 << 20


def test_descriptors_received_are_close_on_exec() -> None:
    """A payload's descriptor, from the file maker or over a runner socket, is not
    inherited by a program the receiver starts (a build tool)."""
    maker = file_maker.FileMaker()
    try:
        fd = maker.make(4096)
        assert fd is not None and os.get_inheritable(fd) is False
        os.close(fd)
    finally:
        maker.close()
    a, b = socket.socketpair()
    with a, b:
        payload = shared_memory.pack(torch, [torch.zeros(1024)], min_bytes=0)
        assert payload is not None
        shared_memory.send_fds(a, [payload.fd])
        (got,) = shared_memory.receive_fds(b, 1, lambda _t: True, 5)
        assert os.get_inheritable(got) is False
        os.close(got)
