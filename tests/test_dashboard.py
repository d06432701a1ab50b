"""The dashboard, driven in Debian's headless Chromium over the DevTools protocol.

One real `kf run` (with `--serve`, so the dashboard beside a run is exercised too) is
shared by every test; the browser tests serve a copy of its log in-process on a random
loopback port and drive the page with real mouse events. Screenshots go to
`test-artifacts/dashboard/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from kf.app.dashboard import RunView, start_dashboard
from kf.app.report import fold_archive
from kf.events import Envelope, Record, decode_event
from kf.log import EventLog
from tests.shared_runs import copy_log, search_run

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (scripts/bootstrap installs it)"
)
WAIT_S = 30.0


def kf_env() -> dict[str, str]:
    return dict(os.environ, KF_LOG_LEVEL="WARNING", KF_EVAL_THREADS="1")


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real search with `kf run --serve`, its dashboard answered while the run went on
    (the run tests/test_loop.py asserts on too: tests/shared_runs.py)."""
    run = search_run(tmp_path_factory)
    run.report()  # the run succeeded
    assert run.served_state is not None, "kf run --serve printed no dashboard URL"
    assert run.served_state["run"]["run_id"]
    return run.db


def filled_cells(db: Path) -> dict[str, str]:
    """Every elite cell of every task, from the archive's own fold: ``task/key`` → id."""
    with EventLog(db, readonly=True) as elog:
        state = fold_archive(elog)
    return {f"{n}/{k}": cid for n, t in state.tasks.items() for k, cid in t.elites.items()}


# -- a small Chrome DevTools Protocol client -------------------------------------------------


class Page:
    """One Chromium tab, driven over CDP: evaluate, wait for a condition, click, screenshot."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, session: str) -> None:
        self.ws = ws
        self.session = session
        self._next = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.errors: list[str] = []
        self.requests: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            fut = self._pending.pop(data.get("id", -1), None)
            if fut is not None and not fut.done():
                if "error" in data:
                    fut.set_exception(RuntimeError(f"CDP error: {data['error']}"))
                else:
                    fut.set_result(data.get("result", {}))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(data["params"]["exceptionDetails"])[:2000])
            elif data.get("method") == "Network.requestWillBeSent":
                self.requests.append(data["params"]["request"]["url"])

    async def send(
        self, method: str, params: dict[str, Any] | None = None, *, page: bool = True
    ) -> Any:
        self._next += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next] = fut
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if page:
            msg["sessionId"] = self.session
        await self.ws.send_str(json.dumps(msg))
        return await asyncio.wait_for(fut, WAIT_S)

    async def eval(self, expression: str) -> Any:
        r = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
        )
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression[:200]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, condition: str, timeout_s: float = WAIT_S) -> Any:
        """Wait, inside the page, until the JS expression ``condition`` is truthy."""
        js = f"""new Promise((resolve, reject) => {{
          const t0 = performance.now();
          (function check() {{
            let v = null;
            try {{ v = ({condition}); }} catch (e) {{}}
            if (v) return resolve(v);
            if (performance.now() - t0 > {timeout_s * 1000})
              return reject(new Error("timed out waiting for: " + {json.dumps(condition)}));
            setTimeout(check, 50);
          }})();
        }})"""
        return await self.eval(js)

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})
        await self.wait_for("document.body && document.body.dataset.head !== undefined")

    async def click(self, selector: str) -> None:
        """A real left click (mouse pressed and released) at the centre of the element."""
        box = await self.eval(
            f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            e.scrollIntoView({{block: "center"}}); const r = e.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2]; }})()"""
        )
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
            )

    async def screenshot(self, name: str) -> Path:
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        shot = await self.send(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {
                    "x": 0,
                    "y": 0,
                    "width": size["width"],
                    "height": size["height"],
                    "scale": 1,
                },
            },
        )
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        import base64

        path.write_bytes(base64.b64decode(shot["data"]))
        return path


@contextlib.asynccontextmanager
async def chromium(tmp: Path) -> AsyncIterator[Page]:
    """Headless Chromium with a fresh profile; one tab attached over CDP."""
    assert CHROMIUM is not None
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--remote-debugging-port=0",
        f"--user-data-dir={tmp / 'chromium-profile'}",
        "--window-size=1400,1000",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    lines: list[str] = []

    async def devtools_url() -> str:
        assert proc.stderr is not None
        while line := (await proc.stderr.readline()).decode(errors="replace"):
            lines.append(line)
            if line.startswith("DevTools listening on "):
                return line.split(" on ", 1)[1].strip()
        raise AssertionError("chromium exited before DevTools listened:\n" + "".join(lines))

    async def drain() -> None:
        assert proc.stderr is not None
        while await proc.stderr.readline():
            pass

    drainer: asyncio.Task[None] | None = None
    try:
        url = await asyncio.wait_for(devtools_url(), WAIT_S)
        drainer = asyncio.create_task(drain())
        async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
            page = Page(ws, "")
            target = await page.send("Target.createTarget", {"url": "about:blank"}, page=False)
            attached = await page.send(
                "Target.attachToTarget",
                {"targetId": target["targetId"], "flatten": True},
                page=False,
            )
            page.session = attached["sessionId"]
            for domain in ("Page.enable", "Runtime.enable", "Network.enable"):
                await page.send(domain)
            await page.send(
                "Emulation.setDeviceMetricsOverride",
                {"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": False},
            )
            try:
                yield page
            finally:
                page._reader.cancel()
                with contextlib.suppress(BaseException):
                    await page._reader
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if drainer is not None:
            drainer.cancel()
            with contextlib.suppress(BaseException):
                await drainer


@contextlib.asynccontextmanager
async def dashboard(db: Path) -> AsyncIterator[str]:
    """The dashboard app serving ``db`` on a random loopback port, in this event loop."""
    url, stop = await start_dashboard(db, host="127.0.0.1", port=0, poll_s=0.1)
    try:
        yield url
    finally:
        await stop()


@pytest.fixture
def log_copy(run_db: Path, tmp_path: Path) -> Path:
    """A private copy of the shared run's log."""
    return copy_log(run_db, tmp_path / "run.db")


# -- tests ---------------------------------------------------------------------------------


@needs_chromium
async def test_dashboard_heatmap_renders_every_elite_cell(log_copy: Path, tmp_path: Path) -> None:
    """The heatmap fills exactly the cells the archive fold holds, each naming its elite."""
    expected = filled_cells(log_copy)
    assert expected, "the shared run admitted no elite"
    async with dashboard(log_copy) as url, chromium(tmp_path) as page:
        await page.goto(url)
        await page.wait_for("document.querySelectorAll('#archive svg.grid').length > 0")
        shown = await page.eval(
            "[...document.querySelectorAll('rect.cell.filled')].map(r => "
            "r.closest('.task').dataset.task + '/' + r.dataset.key + '=' + r.dataset.candidate)"
        )
        await page.screenshot("overview")
        assert sorted(shown) == sorted(f"{k}={v}" for k, v in expected.items())
        prompts = await page.eval("document.querySelector('#prompts').textContent")
        assert "no prompt population in this run (offline mutator)" in prompts
        devices = await page.eval("document.querySelectorAll('#devices .device').length")
        assert devices >= 1
        assert page.errors == []


@needs_chromium
async def test_dashboard_cell_click_opens_that_candidate(log_copy: Path, tmp_path: Path) -> None:
    """Clicking a filled cell opens the elite's detail: source, lineage, reports."""
    async with dashboard(log_copy) as url, chromium(tmp_path) as page:
        await page.goto(url)
        await page.wait_for("document.querySelector('rect.cell.filled')")
        cid = await page.eval("document.querySelector('rect.cell.filled').dataset.candidate")
        await page.click("rect.cell.filled")
        await page.wait_for(
            f"document.querySelector('#detail').dataset.candidateId === {json.dumps(cid)}"
        )
        shown = await page.eval("document.querySelector('#detail .cand-id').textContent")
        source = await page.eval("document.querySelector('#detail pre.source').textContent")
        sections = await page.eval(
            "[...document.querySelectorAll('#detail [data-section]')].map(s => s.dataset.section)"
        )
        visible = await page.eval("!document.querySelector('#detail').hidden")
        await page.screenshot("candidate")
    with EventLog(log_copy, readonly=True) as elog:
        cand = fold_archive(elog).candidates[cid]
    assert shown == cid and visible
    assert source == cand.source and "ModelNew" in source
    assert {"lineage", "compile", "verification", "timings", "source", "diff to parent"} <= set(
        sections
    )
    assert page.errors == []


def split_log(src: Path, dst: Path) -> list[Envelope]:
    """Copy ``src`` up to its first device announcement into ``dst``; return the rest, which
    a test commits later, as the run did."""
    with EventLog(src, readonly=True) as elog:
        envs = [msgspec.structs.replace(e, seq=None) for e in elog.read()]
    k = next(i for i, e in enumerate(envs) if e.type == "device.announced")
    with EventLog(dst) as writer:
        writer.append(envs[:k])
    return envs[k:]


@needs_chromium
async def test_dashboard_committed_event_appears_without_reload(
    run_db: Path, tmp_path: Path
) -> None:
    """Events committed while the page is open show up live: the device, elites, the end."""
    db = tmp_path / "live.db"
    rest = split_log(run_db, db)
    with EventLog(run_db, readonly=True) as elog:
        total = elog.count()
        device = next(e for e in elog.read(types=["device.announced"]))
    device_id = decode_event(device).device_id  # type: ignore[attr-defined]
    expected = filled_cells(run_db)
    async with dashboard(db) as url, chromium(tmp_path) as page:
        await page.goto(url)
        await page.wait_for("document.querySelector('#live.on')")
        await page.eval("window.__kfSamePage = true")
        assert await page.eval("document.querySelectorAll('#devices .device').length") == 0
        assert await page.eval("document.querySelector('#run-status').textContent") == "running"
        with EventLog(db) as writer:
            writer.append(rest)
        await page.wait_for(f"document.body.dataset.head === '{total}'")
        await page.wait_for(
            f"document.querySelector('#devices [data-device={json.dumps(device_id)}]')"
        )
        filled = await page.eval(
            "[...document.querySelectorAll('rect.cell.filled')].map(r => "
            "r.closest('.task').dataset.task + '/' + r.dataset.key)"
        )
        status = await page.eval("document.querySelector('#run-status').textContent")
        device_status = await page.eval(
            "document.querySelector('#devices .device .status').textContent"
        )
        same = await page.eval("window.__kfSamePage === true")
        await page.screenshot("live-update")
    assert same, "the page reloaded"
    assert sorted(filled) == sorted(expected)
    assert status == "finished"
    assert device_status == "left"  # the run's worker left when the run ended
    assert page.errors == []


@needs_chromium
async def test_report_html_is_self_contained(run_db: Path, tmp_path: Path) -> None:
    """`kf report --html` writes one file that renders the same heatmap with no network."""
    out = tmp_path / "report.html"
    proc = subprocess.run(
        [sys.executable, "-m", "kf.app.cli", "report", str(run_db), "--html", str(out)],
        cwd=ROOT,
        env=kf_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert 'src="' not in text and "<link" not in text
    expected = filled_cells(run_db)
    async with chromium(tmp_path) as page:
        await page.goto(out.as_uri())
        await page.wait_for("document.querySelectorAll('#archive svg.grid').length > 0")
        filled = await page.eval("document.querySelectorAll('rect.cell.filled').length")
        await page.click("rect.cell.filled")
        await page.wait_for("document.querySelector('#detail pre.source')")
        await page.screenshot("report")
    assert filled == len(expected)
    assert [u for u in page.requests if not u.startswith(("file:", "data:", "about:"))] == []
    assert page.errors == []


async def test_dashboard_api_serves_every_view(log_copy: Path) -> None:
    """Every view has its JSON; an unknown candidate is a 404 that says so."""
    async with dashboard(log_copy) as url, aiohttp.ClientSession() as s:
        for path in ("run", "archive", "progress", "devices", "prompts", "candidates", "state"):
            async with s.get(url + "api/" + path) as r:
                assert r.status == 200, path
                await r.json()
        async with s.get(url + "api/candidates") as r:
            first = (await r.json())[0]["id"]
        async with s.get(url + "api/candidates/" + first) as r:
            detail = await r.json()
        async with s.get(url + "api/candidates/nope") as r:
            assert r.status == 404
            assert "no candidate" in (await r.json())["error"]
    assert detail["id"] == first and detail["source"]


def test_serve_rejects_a_missing_or_foreign_file(tmp_path: Path) -> None:
    """`kf serve` on a missing file or a non-kf file exits 2 with a message naming it."""
    foreign = tmp_path / "notes.db"
    foreign.write_text("not sqlite")
    for path in (tmp_path / "missing.db", foreign):
        proc = subprocess.run(
            [sys.executable, "-m", "kf.app.cli", "serve", str(path), "--port", "0"],
            cwd=ROOT,
            env=kf_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2
        assert str(path) in proc.stderr and "event log" in proc.stderr


def _rec(seq: int, type_: str, data: dict[str, Any]) -> Record:
    env = Envelope(
        event_id=f"e{seq}",
        run_id="r",
        source="prompt-evolver@x.1",
        type=type_,
        schema=1,
        time=1000.0 + seq,
        data=msgspec.Raw(msgspec.msgpack.encode(data)),
        seq=seq,
    )
    return Record.of(env)


def test_view_prompt_population_comes_from_prompt_events() -> None:
    """Prompt events are listed and grouped into a population; without them, it says so."""
    empty = RunView()
    assert empty.prompts_view()["message"] == "no prompt population in this run (offline mutator)"
    view = RunView()
    view.feed(_rec(1, "prompt.seeded", {"prompt_id": "p0", "regions": {"strategy": "be fast"}}))
    view.feed(
        _rec(
            2,
            "prompt.chosen",
            {
                "task": "t",
                "selection": 0,
                "island": 0,
                "operator": "mutate",
                "parent_id": "c0",
                "prompt_id": "p0",
                "model": "m",
            },
        )
    )
    out = view.prompts_view()
    assert out["message"] is None and [e["type"] for e in out["events"]] == [
        "prompt.seeded",
        "prompt.chosen",
    ]
    assert out["population"][0]["prompt_id"] == "p0" and out["population"][0]["uses"] == 1


async def test_dashboard_refuses_a_foreign_host_header(log_copy: Path) -> None:
    """A request naming another site in Host (DNS rebinding) gets 421; local names, IP
    literals and names given with ``allowed_hosts`` are served."""
    url, stop = await start_dashboard(
        log_copy, host="127.0.0.1", port=0, allowed_hosts=["gpu-box.lan"]
    )
    port = url.rstrip("/").rsplit(":", 1)[1]
    try:
        async with aiohttp.ClientSession() as s:
            for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
                async with s.get(url + "api/state", headers={"Host": host}) as r:
                    assert r.status == 421, host
                    assert "DNS rebinding" in await r.text()
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", "gpu-box.lan:80",
                         "10.1.2.3"):  # fmt: skip
                async with s.get(url + "api/state", headers={"Host": host}) as r:
                    assert r.status == 200, host
    finally:
        await stop()


def test_dashboard_host_allowed_names() -> None:
    """The Host allow-list: names with ports, IPv6 literals, trailing dots, case."""
    from kf.app.dashboard import host_allowed

    assert host_allowed("LOCALHOST.:8765", [])
    assert host_allowed("[::1]:8765", [])
    assert host_allowed("box:1", ["box"])
    assert host_allowed(None, [])
    assert not host_allowed("box:1", [])
    assert not host_allowed("localhost.evil.example", ["127.0.0.1"])


@needs_chromium
async def test_dashboard_warns_when_the_log_fails_its_chain(log_copy: Path, tmp_path: Path) -> None:
    """A log rewritten outside kf is still shown, under a banner naming the first bad seq."""
    with contextlib.closing(sqlite3.connect(log_copy, isolation_level=None)) as c:
        c.execute("DROP TRIGGER events_no_update")
        c.execute("UPDATE events SET body = (SELECT body FROM events WHERE seq = 3) WHERE seq = 5")
    async with dashboard(log_copy) as url, chromium(tmp_path) as page:
        await page.goto(url)
        await page.wait_for("document.querySelector('#integrity[data-status=broken]')")
        text = await page.eval("document.querySelector('#integrity').textContent")
        hidden = await page.eval("document.querySelector('#integrity').hidden")
        await page.screenshot("integrity-broken")
    assert not hidden
    assert "integrity check failed at seq 5" in text and "forged" in text
    assert page.errors == []
