"""The dashboard page, live (served with its API) or as one self-contained HTML report.

Both use the same ``static/index.html``, ``style.css`` and ``app.js``. The live page links
them and fetches ``/api/…``; the report inlines them and embeds the data (the overview
state and every candidate's detail) as JSON, so the file opens anywhere with no server
and no network.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import msgspec

from kf.app.dashboard.feed import Feed, integrity_state, open_log

__all__ = ["live_page", "report_html", "write_report"]

STATIC = Path(__file__).parent / "static"
_HEAD = "<!--kf:head-->"
_DATA = "<!--kf:data-->"
_SCRIPT = "<!--kf:script-->"


def _template() -> str:
    return (STATIC / "index.html").read_text(encoding="utf-8")


def live_page() -> str:
    """The page as ``kf serve`` sends it: linked assets, data from the API."""
    return (
        _template()
        .replace(_HEAD, '<link rel="stylesheet" href="static/style.css">')
        .replace(_DATA, "")
        .replace(_SCRIPT, '<script src="static/app.js"></script>')
    )


def _json_for_script(data: Any) -> str:
    # "<" escaped, so no "</script>" or "<!--" inside the data can end the element
    return msgspec.json.encode(data).decode().replace("<", "\\u003c")


def report_html(db: str | Path) -> str:
    """A self-contained HTML report of a run: inline CSS, JavaScript and data."""
    elog = open_log(db)
    try:
        feed = Feed(elog)
        feed.catch_up()
    finally:
        elog.close()
    view = feed.view
    state = view.state()
    state["db"] = str(db)
    state["undecodable"] = feed.undecodable
    state["integrity"] = integrity_state(feed.integrity)
    details = {c["id"]: view.candidate(c["id"]) for c in state["candidates"]}
    css = (STATIC / "style.css").read_text(encoding="utf-8")
    js = (STATIC / "app.js").read_text(encoding="utf-8").replace("</script", "<\\/script")
    data = _json_for_script({"state": state, "candidates": details})
    title = f"kf report — {html.escape(view.run_id or str(db))}"
    return (
        _template()
        .replace("<title>kf dashboard</title>", f"<title>{title}</title>")
        .replace(_HEAD, f"<style>\n{css}\n</style>")
        .replace(_DATA, f'<script id="kf-data" type="application/json">{data}</script>')
        .replace(_SCRIPT, f"<script>\n{js}\n</script>")
    )


def write_report(db: str | Path, out: str | Path) -> Path:
    """Write :func:`report_html` of ``db`` to ``out``; return the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_html(db), encoding="utf-8")
    return path
