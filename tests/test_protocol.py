"""The grader ↔ runner protocol (kf.evaluation.wire.protocol): every message survives the
wire as itself; a malformed or unknown one is a clear error where it is decoded; and a
runner that writes garbage, a foreign message or a forged descriptor onto its socket
gets a clear verdict, not a grader that fails later."""

from __future__ import annotations

import os
import socket
import typing
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kf.evaluation import RunnerPool, compile_candidate
from kf.evaluation.wire import protocol as p
from kf.evaluation.wire import shared_memory
from kf.evaluation.wire.tolerance import Tolerance
from kf.kernels.tasks import load_task
from tests.runner_cases import cheat_then_torch

FIXTURES = Path(__file__).parent / "fixtures"
TASK = load_task(FIXTURES / "eval" / "task_gelu.py")
BLOB = b"torch.save bytes"
PIECES = [b"first piece", b"second"]
SHARED = shared_memory.Payload(b"KFSHM1\nheader", 0, 4096)

EXAMPLES: list[p.Message] = [
    p.Ping(id=1),
    p.Setup(
        id=2,
        device="cuda:0",
        threads=4,
        memory_bytes=1 << 30,
        cpu_s=60,
        file_bytes=1 << 20,
        ipc=True,
        shm=1 << 20,
        own_inputs=True,
        reference_cache_bytes=-1,
        tf32="off",
        nice=10,
    ),
    p.LoadTask(id=3, source="class Model: ...", name="gelu", seed=7),
    p.LoadCandidate(
        id=4, source="class ModelNew: ...", seed=7, task_source="t", task_name="n", init=PIECES
    ),
    p.MakeInputs(id=5, seed=11, variant=2, scale=-1.0, send=False),
    p.Run(id=6, inputs=SHARED, seed=None, trace=True),
    p.Check(
        id=7,
        seed=11,
        outputs=BLOB,
        inputs_after=PIECES,
        inputs_problem="input 0 changed",
        tol=Tolerance(atol=1e-3, rtol=1e-3, preset="loose"),
    ),
    p.Time(id=8, n=20, compiled=True),
    p.TimeInputs(id=9, inputs=[BLOB, PIECES, SHARED], paired=True),
    p.Batch(id=10, n=1000),
    p.Settle(id=10, warm=True, compiled=True),
    p.Counters(id=11),
    p.Trim(id=12, keep_bytes=0),
    p.Audit(id=13, seeds=[1, 2, 3], scales=[3.0, 0.01], tol=None),
    p.CompileBaseline(id=14, cache_dir="/tmp/inductor", mode="max-autotune"),
    p.UserTests(id=14, tests=[("tests/test_a.py", "def test_a(candidate): pass")], seed=3),
    p.Exit(),
    p.Built(ok=False, error="g++ failed", log="error: expected ';'"),
    p.Failed(id=15, kind="compile_error", error="C++ compilation failed", log="…", took_ns=5),
    p.Pong(id=16, took_ns=100, findings=("network: socket.connect",)),
    p.SetUp(id=17, threads=4, precision={"tf32": "off", "matmul_allow_tf32": False}),
    p.TaskLoaded(id=18, init=BLOB),
    p.CandidateLoaded(id=19),
    p.InputsMade(
        id=20,
        input_shapes=[[4, 8], []],
        input_dtypes=["float32", "int"],
        output_shapes=[[4, 8]],
        output_dtypes=["float32"],
        eager_ms=0.25,
        variant="x",
        inputs=SHARED,
        reused=True,
        device_free_bytes=1,
        device_total_bytes=2,
    ),
    p.InputsMade(id=21, missing="the task has no floating-point inputs"),
    p.Ran(
        id=22,
        outputs=PIECES,
        inputs_after=None,
        inputs_problem=None,
        torch_ops=["add"],
        phases_ns={"inputs": 1, "forward": 2, "outputs": 3},
    ),
    p.Checked(
        id=23,
        verdict=p.Verdict(
            ok=False,
            kind="mismatch",
            reason="max abs 1",
            max_abs_err=1.0,
            max_rel_err=0.5,
            min_tol=2.0,
        ),
    ),
    p.Timed(id=24, samples_ns=[1, 2, 3]),
    p.InputsTimed(id=25, samples_ns=[4], repeated_ns=[5]),
    p.BatchRan(id=26, total_ns=9),
    p.CountersRan(id=27),
    p.Trimmed(id=28, dropped_bytes=1 << 31),
    p.Audited(
        id=29, degenerate=True, reason="all zeros pass", input_sets=7, spread=0.0, constant_passes=7
    ),
    p.BaselineCompiled(id=30, baseline="torch.compile", mode="default", compile_s=3.5, graphs=1),
    p.UserTestsRan(id=31, passed=["tests/test_a.py::test_a"], failed="t::b", message="no"),
    p.Ready(pid=42, torch="2.13.0"),
    p.BuildNative(source="int f();", flags=["-O3"], defines={"N": "4"}, timeout_s=60.0),
    p.BuildInline(arguments={"name": "ext", "cpp_sources": ["..."]}, environment={"torch": "2"}),
]


def _decoder(message: p.Message) -> Any:
    to_runner = typing.get_args(p.ToRunner)
    return p.decode_from_grader if isinstance(message, to_runner) else p.decode_from_runner


def test_protocol_examples_cover_every_message_of_both_directions() -> None:
    """Each message type of either direction has an example here (a new one needs one)."""
    kinds = {type(m) for m in EXAMPLES}
    assert kinds == set(typing.get_args(p.ToRunner)) | set(typing.get_args(p.ToGrader))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.op)
def test_protocol_message_round_trips_as_itself(message: p.Message) -> None:
    """Encoded once and decoded by its direction's decoder, a message is equal to itself."""
    assert _decoder(message)(p.encode(message)) == message


def test_protocol_every_request_names_its_reply() -> None:
    """Each request type's reply type is a reply of the runner's direction."""
    replies = set(typing.get_args(p.ToGrader))
    for cls in typing.get_args(p.ToRunner):
        if issubclass(cls, p.Request) and cls is not p.Exit:  # exit has no reply
            assert p.reply_type(_example(cls)) in replies
    assert p.reply_type(p.Run()) is p.Ran
    assert p.reply_type(p.Check(seed=1, outputs=b"")) is p.Checked


def _example(cls: type[p.Message]) -> Any:
    return next(m for m in EXAMPLES if type(m) is cls)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"op": "verdict", "ok": True}, "Invalid value 'verdict' - at `$.op`"),
        ({"ok": True, "samples_ns": [1]}, "missing required field `op`"),
        ({"op": "timed", "samples_ns": ["1"]}, "Expected `int`, got `str` - at `$.samples_ns[0]`"),
        ({"op": "ran"}, "missing required field `outputs`"),
        ({"op": "run", "inputs": b""}, "Invalid value 'run' - at `$.op`"),  # the other way
        ([1, 2, 3], "Expected `object`, got `array`"),
    ],
)
def test_protocol_foreign_message_from_a_runner_is_a_clear_error(data: object, where: str) -> None:
    """A well-formed map that is no message a runner sends says what and where."""
    with pytest.raises(p.ForeignMessage, match="not a message from a kf runner") as caught:
        p.decode_from_runner(msgspec.msgpack.encode(data))
    assert where in str(caught.value)


def test_protocol_foreign_message_to_a_runner_and_garbage_are_clear_errors() -> None:
    """A reply sent to a runner is foreign there; bytes that are not MessagePack are a
    ProtocolError that says so (and not a ForeignMessage)."""
    with pytest.raises(p.ForeignMessage, match=r"Invalid value 'pong' - at `\$\.op`"):
        p.decode_from_grader(p.encode(p.Pong()))
    with pytest.raises(p.ProtocolError, match="not MessagePack") as caught:
        p.decode_from_runner(b"\xc1\xc1")
    assert not isinstance(caught.value, p.ForeignMessage)


def _nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [33, 600, 100_000])
def test_protocol_deeply_nested_build_request_is_a_foreign_message(depth: int) -> None:
    """A build request whose free-form arguments nest deeper than the protocol's bound
    (33 levels, 600, or 100,000: deeper than the decoder itself can go) is one
    ForeignMessage saying so, never a RecursionError, here or later in the grader; 32
    levels still decode."""
    env = {"torch": "2", "python": "3.11"}
    if depth < 1000:
        data = msgspec.msgpack.encode(
            {"op": "build_inline", "arguments": {"name": "x", "cpp_sources": _nested(depth)},
             "environment": env}
        )  # fmt: skip
    else:  # deeper than an encoder goes: the bytes as a forger would write them
        data = (
            b"\x83\xa2op\xacbuild_inline\xa9arguments\x81\xa4name"
            + b"\x91" * depth
            + b"\xa1x\xabenvironment\x80"
        )
    with pytest.raises(p.ForeignMessage, match="nested more than 32 levels deep") as caught:
        p.decode_from_runner(data)
    assert len(str(caught.value).splitlines()) == 1 and len(str(caught.value)) < 300
    ok = {"op": "build_inline", "arguments": {"name": "x", "v": _nested(31)}, "environment": {}}
    assert isinstance(p.decode_from_runner(msgspec.msgpack.encode(ok)), p.BuildInline)


def test_protocol_forged_descriptor_is_refused_before_anything_is_passed_on() -> None:
    """A payload naming a descriptor its message did not bring (here fd 0 of the
    receiver's own) is refused where it arrives, so the receiver never forwards a
    descriptor of its own; descriptors that did come are closed."""
    forged = p.encode(p.Ran(outputs=shared_memory.Payload(b"KFSHM1\n", 0, 4096)))
    mine, theirs = socket.socketpair()
    conn = Connection(os.dup(mine.fileno()))
    try:
        theirs.sendall(len(forged).to_bytes(4, "big") + forged)
        with pytest.raises(ValueError, match="names no descriptor"):
            shared_memory.receive_message(
                conn.recv_bytes, mine, conn.poll, p.decode_from_runner, 2.0
            )
    finally:
        conn.close()
        mine.close()
        theirs.close()


def test_protocol_payload_descriptors_attach_in_field_order() -> None:
    """Payloads anywhere in a message (a field, a list) travel as positions and come back
    owning the descriptors sent beside the message, in order."""
    first = shared_memory.pack(torch, [torch.ones(1 << 18)])
    second = shared_memory.pack(torch, [torch.zeros(1 << 18)])
    assert first is not None and second is not None
    wire, fds = shared_memory.detach(p.TimeInputs(inputs=[first, BLOB, second]))
    assert wire.fds == 2 and fds == [first.fd, second.fd]
    assert wire.inputs is not None and [getattr(v, "fd", None) for v in wire.inputs] == [0, None, 1]
    back = p.decode_from_grader(p.encode(wire))
    got = shared_memory.attach(back, [os.dup(fd) for fd in fds])
    assert isinstance(got, p.TimeInputs) and got.inputs is not None
    a, b = got.inputs[0], got.inputs[2]
    assert isinstance(a, shared_memory.Payload) and isinstance(b, shared_memory.Payload)
    assert torch.equal(shared_memory.unpack(torch, a)[0], torch.ones(1 << 18))
    assert torch.equal(shared_memory.unpack(torch, b)[0], torch.zeros(1 << 18))
    a.close()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(a.fd)


@pytest.mark.parametrize(
    ("name", "kind", "says"),
    [
        ("foreign_reply", "tampering", "not one of kf's runner protocol"),
        ("garble_reply", "crash", "garbled reply during import and construction of ModelNew"),
        ("borrow_descriptor", "crash", "names no descriptor"),
        ("huge_message", "tampering", "announced 17179869184 bytes, over the 1024 MiB"),
        ("deep_build", "tampering", "nested more than 32 levels deep"),
        ("deep_load_inline", "compile_error", "its arguments nest more than 32 levels deep"),
    ],
)
def test_protocol_runner_writing_garbage_gets_a_clear_verdict(
    name: str, kind: str, says: str, pool: RunnerPool
) -> None:
    """A candidate that writes onto the grading socket itself is refused with what it did."""
    report = compile_candidate(
        TASK, cheat_then_torch(FIXTURES / "protocol" / f"{name}.py"), pool=pool
    )
    assert not report.ok
    assert report.failure_kind == kind, report.error
    assert says in (report.error or ""), report.error


def test_protocol_runner_exits_clearly_on_a_message_it_cannot_read(pool: RunnerPool) -> None:
    """A runner sent bytes that are no request exits, saying why in its log, and the
    grader sees it exit."""
    from kf.evaluation.grader.sandbox import RunnerCrashed

    with pool.lease() as handle:
        handle.conn.send_bytes(msgspec.msgpack.encode({"op": "format_disk"}))
        with pytest.raises(RunnerCrashed) as crashed:
            handle.request(p.Ping(), 30.0)
    assert crashed.value.returncode == 2, crashed.value
    assert "kf runner: exiting on a message it cannot read" in crashed.value.log_tail
    assert "Invalid value 'format_disk' - at `$.op`" in crashed.value.log_tail


def test_protocol_grader_reads_no_message_over_its_limit() -> None:
    """The grader reads a runner's message only up to its limit: the length is read, one
    over it is refused before any of its bytes (both length forms), one at the limit is
    read whole, one that stops part-way and one whose socket closes end at once."""
    import socket
    import struct

    from kf.evaluation.grader.runner_socket import (
        MessageStalled,
        MessageTooLarge,
        message_limit,
        read_message,
    )

    assert message_limit() == 1 << 30  # the default, with tensors as memory files
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(struct.pack("!i", 8) + b"12345678")
        assert bytes(read_message(ours.fileno(), 8)) == b"12345678"
        theirs.sendall(struct.pack("!i", 9) + b"123456789")
        with pytest.raises(MessageTooLarge) as small:
            read_message(ours.fileno(), 8)
        assert (small.value.size, small.value.limit) == (9, 8)
        assert ours.recv(9) == b"123456789"  # not one byte of it was read
        theirs.sendall(struct.pack("!i", -1) + struct.pack("!Q", 1 << 40))
        with pytest.raises(MessageTooLarge, match=str(1 << 40)):
            read_message(ours.fileno(), 1 << 30)
        theirs.sendall(struct.pack("!i", 100) + b"only part")
        with pytest.raises(MessageStalled, match="9 of 100 bytes came"):
            read_message(ours.fileno(), 1 << 30, idle_s=0.2)
        theirs.close()
        with pytest.raises(EOFError):
            read_message(ours.fileno(), 1 << 30)
    finally:
        ours.close()
        theirs.close()


def test_protocol_tensors_of_any_layout_travel_beside_the_message() -> None:
    """What keeps kf's own messages far below the grader's limit: a transposed and a sliced
    tensor travel in the memory file too (the description stays small; the transpose keeps
    its strides, the slice comes back as its values), and a description whose strides
    would overlap is refused."""
    big = torch.randn(64, 1 << 14)  # 4 MiB
    values = [big.t(), big[:, ::2], torch.randn(4, 1).expand(4, 1 << 10)]
    payload = shared_memory.pack(torch, values)
    assert payload is not None and payload.nbytes >= 6 << 20
    assert len(payload.header) < 64 << 10  # the expanded view's 16 bytes of storage included
    back = shared_memory.unpack(torch, payload)
    assert all(torch.equal(a, b) for a, b in zip(values, back, strict=True))
    assert back[0].stride() == big.t().stride() and back[1].is_contiguous()
    entries = msgspec.msgpack.decode(payload.header[len(shared_memory.MAGIC) :])
    entries[0]["t"]["stride"] = [0, 1]  # every row the same memory
    bad = msgspec.structs.replace(
        payload, header=shared_memory.MAGIC + msgspec.msgpack.encode(entries)
    )
    with pytest.raises(ValueError, match="malformed tensor description"):
        shared_memory.unpack(torch, bad)
    payload.close()
