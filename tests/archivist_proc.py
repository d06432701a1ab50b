"""Runs an archivist hosting the Tally test agent as its own process (so tests can kill it)."""

from __future__ import annotations

import asyncio
import sys

from agents.archivist import Archivist
from kf import bus
from kf.agent import AgentContext
from kf.logs import configure
from tests.tally import Tally


async def main(url: str, run_id: str, db: str) -> None:
    configure("WARNING", json=True)
    nc = await bus.connect(bus.BusOptions(url))
    stop = asyncio.Event()
    arch = Archivist(
        AgentContext(run_id=run_id, agent_id="archivist@proc"), db=db, hosted=[Tally], nc=nc
    )
    await arch.run(stop)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
