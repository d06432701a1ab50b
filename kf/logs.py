"""structlog set-up: JSON lines when not on a terminal, readable lines when on one.

Context (agent, run, event ids) is bound through ``contextvars`` so every line carries it.
"""

from __future__ import annotations

import logging
import sys

import structlog

from kf.settings import current

__all__ = ["configure"]

_configured = False


def configure(level: str | None = None, *, json: bool | None = None) -> None:
    """Configure structlog once per process; logs go to stderr."""
    global _configured
    if _configured:
        return
    _configured = True
    lvl = getattr(logging, (level or current().log_level or "INFO").upper(), logging.INFO)
    as_json = (not sys.stderr.isatty()) if json is None else json
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
