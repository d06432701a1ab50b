"""A scripted OpenAI-compatible chat server for tests (model name: "scripted").

It is not a language model: each request to ``/v1/chat/completions`` is answered by the
next scripted action, or by a responder function once the script is used up. Actions:
``{"content": str}`` (a normal completion with usage), ``{"status": 429 | 500, ...}``,
``{"hang": seconds}`` (answers after that long, past a client's timeout),
``{"garbage": str}`` (a 200 whose body is not a completion). A completion may carry
``"finish_reason"`` (e.g. ``"length"``, an answer cut off at the token limit) and
``"delay"`` (seconds to wait before answering, for a slow model). ``{"tool_calls": [{"name":
str, "arguments": dict | str}, ...]}`` answers with OpenAI tool calls (``finish_reason``
``tool_calls``; a str ``arguments`` is sent as is, so malformed JSON can be scripted), with
``"content"`` optional beside them. It runs in a thread with its
own event loop, so synchronous tests (driving ``kf run`` in a subprocess) can use it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

Action = dict[str, Any]
Responder = Callable[[dict[str, Any]], Action]


class ScriptedServer:
    """An aiohttp OpenAI-compatible server answering from a script; ``url`` ends in ``/v1``."""

    def __init__(self, script: list[Action] | None = None, responder: Responder | None = None):
        self.script: list[Action] = list(script or [])
        self.responder = responder
        self.requests: list[dict[str, Any]] = []
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._hangs: list[asyncio.Future[None]] = []
        self.in_flight = 0  # delayed answers being waited on now
        self.max_in_flight = 0  # the most delayed answers waited on at once

    def _next(self, body: dict[str, Any]) -> Action:
        with self._lock:
            self.requests.append(body)
            if self.script:
                return self.script.pop(0)
        if self.responder is not None:
            return self.responder(body)
        return {"status": 500, "error": "script exhausted"}

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        action = self._next(body)
        if "hang" in action:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._hangs.append(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, action["hang"])
            return web.json_response({"error": "too late"}, status=504)
        if "status" in action:
            return web.json_response(
                {"error": {"message": action.get("error", "scripted error"), "type": "scripted"}},
                status=int(action["status"]),
            )
        if "garbage" in action:
            return web.Response(text=action["garbage"], content_type="application/json")
        if action.get("delay"):
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(float(action["delay"]))
            finally:
                with self._lock:
                    self.in_flight -= 1
        calls = [
            {
                "id": f"call-{len(self.requests)}-{i}",
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": c["arguments"]
                    if isinstance(c.get("arguments"), str)
                    else json.dumps(c.get("arguments", {})),
                },
            }
            for i, c in enumerate(action.get("tool_calls", ()))
        ]
        content = action.get("content")
        if content is None and not calls:
            content = ""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        prompt_tokens = sum(
            len(str(m.get("content") or "").split()) for m in body.get("messages", [])
        )
        completion_tokens = len(str(content or "").split()) + sum(
            len(c["function"]["arguments"].split()) for c in calls
        )
        return web.json_response(
            {
                "id": f"scripted-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model", "scripted"),
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": action.get(
                            "finish_reason", "tool_calls" if calls else "stop"
                        ),
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    def start(self) -> ScriptedServer:
        """Serve on a free loopback port; returns once it is listening."""
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self._chat)
            runner = web.AppRunner(app)
            try:
                loop.run_until_complete(runner.setup())
                site = web.TCPSite(runner, "127.0.0.1", 0)
                loop.run_until_complete(site.start())
                port = runner.addresses[0][1]
                self.url = f"http://127.0.0.1:{port}/v1"
                self._runner = runner
            except BaseException as exc:
                failure.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="scripted-llm", daemon=True)
        self._thread.start()
        started.wait(10)
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        """Release hanging requests, stop serving and join the thread."""
        loop = self._loop
        if loop is None or self._thread is None:
            return

        def release() -> None:
            for fut in self._hangs:
                if not fut.done():
                    fut.set_result(None)
            loop.stop()

        loop.call_soon_threadsafe(release)
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def user_text(body: dict[str, Any]) -> str:
    """The last user message of a request."""
    msgs = [m for m in body.get("messages", []) if m.get("role") == "user"]
    return str(msgs[-1]["content"]) if msgs else ""


def echo_reference(body: dict[str, Any]) -> dict[str, Any]:
    """A scripted answer (not a model): the prompt's reference, with ModelNew its Model."""
    text = user_text(body)
    if "Rewrite ONE region" in text:
        return {"content": "```\nKeep the reference's ops.\n```"}
    m = re.search(r"the PyTorch reference\n```python\n(.*?)\n```", text, re.S)
    if m is None:
        return {"content": "no reference in the prompt"}
    return {"content": f"```python\n{m.group(1)}\n\nclass ModelNew(Model):\n    pass\n```"}


def tool_results(body: dict[str, Any]) -> list[str]:
    """The contents of the tool results (role ``tool``) a request carries, in order."""
    return [
        str(m.get("content") or "") for m in body.get("messages", []) if m.get("role") == "tool"
    ]


def dumps(obj: Any) -> str:
    """Compact JSON (for garbage bodies that look almost right)."""
    return json.dumps(obj)
