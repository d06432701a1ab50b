"""Stopping a command cleanly on SIGTERM, as on SIGINT.

``asyncio.run`` turns SIGINT into a cancellation of the main task (so its ``finally``
blocks run: agents stop, connections close, the embedded nats-server stops, temporary
folders go) and then raises :class:`KeyboardInterrupt`. SIGTERM's default is to end the
process at once, leaving children (the nats-server) running. :func:`run` gives SIGTERM
the same treatment and raises :class:`Terminated` afterwards.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["Terminated", "run"]

T = TypeVar("T")


class Terminated(Exception):
    """The command was stopped by a signal (SIGTERM) after cleaning up."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell's code for death by that signal (143 for SIGTERM)."""
        return 128 + self.signum


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, with SIGTERM cancelling ``main`` (once; a second SIGTERM
    during the clean-up is ignored) and raising :class:`Terminated` when it has ended."""
    got: list[int] = []

    async def guarded() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def on_term() -> None:
            if not got:
                got.append(signal.SIGTERM)
                task.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_term)
        try:
            return await main
        finally:
            if not got:
                loop.remove_signal_handler(signal.SIGTERM)

    try:
        result = asyncio.run(guarded())
    except asyncio.CancelledError:
        if got:
            raise Terminated(got[0]) from None
        raise
    if got:
        raise Terminated(got[0])
    return result
