"""The device gate's turns: a stage shares the device while it prepares and has it alone
only while it times (kf.devices.gate.Turns), from its grading thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kf.devices.gate import DeviceGate, GateClosed, Turns


def _state(gate: DeviceGate) -> tuple[int, bool]:
    return gate._shared, gate._exclusive


def test_a_stage_shares_the_device_until_it_times_then_has_it_alone() -> None:
    """Outside its timing a profile's hold lets verifications in beside it; inside, a
    verification waits until the timing is over, and the stage is shared again after."""

    async def main() -> list[str]:
        gate = DeviceGate()
        seen: list[str] = []
        timing = threading.Event()
        release = threading.Event()

        def grade(turns: Turns) -> None:
            seen.append(f"prepare {_state(gate)}")
            with turns.alone():
                seen.append(f"time {_state(gate)}")
                timing.set()
                release.wait(10)
            seen.append(f"after {_state(gate)}")

        async def verify() -> None:
            async with await gate.shared():
                seen.append("verified")

        async with Turns(gate) as turns:
            await verify()  # beside the stage's shared hold
            thread = asyncio.create_task(asyncio.to_thread(grade, turns))
            await asyncio.to_thread(timing.wait, 10)
            waiting = asyncio.create_task(verify())
            await asyncio.sleep(0.2)
            assert not waiting.done()  # the device is the timing's alone
            release.set()
            await thread
            await waiting
        assert _state(gate) == (0, False)
        return seen

    seen = asyncio.run(main())
    assert seen[0] == "verified"
    assert seen[1:3] == ["prepare (1, False)", "time (0, True)"]
    # then the waiting verification and the stage's own share again, in either order
    assert sorted(seen[3:]) == ["after (1, False)", "verified"] or sorted(seen[3:]) == [
        "after (2, False)",
        "verified",
    ]


def test_two_stages_turning_at_once_take_turns() -> None:
    """Two stages holding a share each both ask for the device alone: neither waits for
    the other's share (they are given back first), and each times alone."""

    async def main() -> list[tuple[int, bool]]:
        gate = DeviceGate()
        inside: list[tuple[int, bool]] = []

        def grade(turns: Turns) -> None:
            for _ in range(3):
                with turns.alone():
                    inside.append(_state(gate))
                    time.sleep(0.05)

        async def stage() -> None:
            async with Turns(gate) as turns:
                await asyncio.to_thread(grade, turns)

        await asyncio.wait_for(asyncio.gather(stage(), stage()), 30)
        assert _state(gate) == (0, False)
        return inside

    assert asyncio.run(main()) == [(0, True)] * 6


def test_a_stage_that_ends_while_its_thread_waits_leaves_the_gate_free() -> None:
    """kf stopping cancels a profile whose thread waits for its turn (behind a
    verification still sharing the device): the thread gets GateClosed, and nothing of
    the gate stays held."""

    async def main() -> None:
        gate = DeviceGate()
        errors: list[BaseException] = []
        asked = threading.Event()

        def waits(turns: Turns) -> None:
            asked.set()
            try:
                with turns.alone():
                    errors.append(AssertionError("timed while a verification shared it"))
            except GateClosed as exc:
                errors.append(exc)

        turns = Turns(gate)
        await turns.__aenter__()
        verification = await gate.shared()
        thread = asyncio.create_task(asyncio.to_thread(waits, turns))
        await asyncio.to_thread(asked.wait, 10)
        await asyncio.sleep(0.2)
        assert not thread.done() and gate._waiting_exclusive == 1
        await asyncio.wait_for(turns.__aexit__(None, None, None), 10)  # cancelled
        await asyncio.wait_for(thread, 10)
        await verification.__aexit__()
        assert len(errors) == 1 and isinstance(errors[0], GateClosed), errors
        assert _state(gate) == (0, False) and gate._waiting_exclusive == 0
        async with await gate.exclusive():  # free for the next
            pass

    asyncio.run(main())


def test_a_turn_asked_for_after_the_stage_ended_is_refused() -> None:
    async def main() -> None:
        gate = DeviceGate()
        async with Turns(gate) as turns:
            pass
        with pytest.raises(GateClosed):
            await asyncio.to_thread(lambda: turns.alone().__enter__())
        assert _state(gate) == (0, False)

    asyncio.run(main())


def test_a_stage_that_starts_holding_nothing_shares_then_times_then_lets_go() -> None:
    """Counters start their runner under ncu holding no share of the device (a runner's
    start is host work, as a pooled runner's is), share it to load and check, have it
    alone for the one measured call, and hold nothing again after."""

    async def main() -> list[tuple[int, bool]]:
        gate = DeviceGate()
        seen: list[tuple[int, bool]] = []

        def grade(turns: Turns) -> None:
            seen.append(_state(gate))
            with turns.sharing():
                seen.append(_state(gate))
                with turns.alone():
                    seen.append(_state(gate))
                seen.append(_state(gate))
            seen.append(_state(gate))

        async with Turns(gate, shared=False) as turns:
            await asyncio.to_thread(grade, turns)
        return seen

    assert asyncio.run(main()) == [(0, False), (1, False), (0, True), (1, False), (0, False)]


def test_a_turn_logs_what_it_waited_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exclusive hold ends with a ``device_turn`` log line: its label, its wait and
    hold, the shared holders by label when it asked, and whether it queued behind another
    exclusive hold; a shared hold leaves no count behind when it ends."""
    from kf.devices import gate as device_gate

    logs: list[dict[str, object]] = []

    class Recorder:  # whatever level the process logs at
        def info(self, event: str, **fields: object) -> None:
            logs.append({"event": event, **fields})

    monkeypatch.setattr(device_gate, "log", Recorder())

    async def main() -> None:
        gate = DeviceGate()
        verify = await gate.shared("verify")
        counters = await gate.shared("counters")
        first = asyncio.create_task(gate.exclusive("profile"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(gate.exclusive("tuner"))
        await asyncio.sleep(0.05)
        await verify.__aexit__()
        await counters.__aexit__()
        async with await first:
            pass
        async with await second:
            pass
        assert gate._holders == {} or all(v == 0 for v in gate._holders.values())

    asyncio.run(main())
    turns = [e for e in logs if e["event"] == "device_turn"]
    assert [t["label"] for t in turns] == ["profile", "tuner"]
    profile, tuner = turns
    assert profile["waited_on"] == {"verify": 1, "counters": 1} and not profile["behind_a_turn"]
    assert profile["waited_s"] > 0 and profile["held_s"] >= 0
    # asked while both shares were still held, and queued behind the profile
    assert tuner["waited_on"] == {"verify": 1, "counters": 1} and tuner["behind_a_turn"]


def test_a_yielding_turn_lets_every_other_turn_go_first() -> None:
    """The counters' turn (``yielding``) asked for first still goes after the timings
    asked for later, while they wait; no share is given while it waits; with no other
    turn asked for, it is taken as any turn is."""

    async def main() -> list[str]:
        gate = DeviceGate()
        order: list[str] = []
        verify = await gate.shared("verify")

        async def turn(label: str, yielding: bool = False) -> None:
            async with await gate.exclusive(label, yielding=yielding):
                order.append(label)
                await asyncio.sleep(0.02)

        async def share() -> None:
            async with await gate.shared("verify"):
                order.append("shared")

        counters = asyncio.create_task(turn("counters", yielding=True))
        await asyncio.sleep(0.05)
        late_share = asyncio.create_task(share())
        await asyncio.sleep(0.05)
        first = asyncio.create_task(turn("profile 1"))
        second = asyncio.create_task(turn("profile 2"))
        await asyncio.sleep(0.05)
        assert order == []  # the verification still shares the device
        await verify.__aexit__()
        await asyncio.gather(counters, first, second, late_share)
        # alone, a yielding turn is not held back
        await turn("counters again", yielding=True)
        return order

    order = asyncio.run(main())
    assert order[:3] == ["profile 1", "profile 2", "counters"] or order[:3] == [
        "profile 2", "profile 1", "counters",
    ]  # fmt: skip
    assert order[3:] == ["shared", "counters again"]
