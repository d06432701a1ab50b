"""The dashboard: watch a search live (``kf serve``, ``kf run --serve``) or study it
afterwards (``kf report --html``), all from the committed log.
"""

from __future__ import annotations

from kf.app.dashboard.app import (
    DashboardError,
    Feed,
    host_allowed,
    make_app,
    open_log,
    start_dashboard,
)
from kf.app.dashboard.page import live_page, report_html, write_report
from kf.app.dashboard.view import RunView

__all__ = [
    "DashboardError",
    "Feed",
    "RunView",
    "host_allowed",
    "live_page",
    "make_app",
    "open_log",
    "report_html",
    "start_dashboard",
    "write_report",
]
