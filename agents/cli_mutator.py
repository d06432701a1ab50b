"""A coding-agent CLI as a mutator (``--agent-cmd 'TEMPLATE'``).

For one selection kf prepares a scratch folder:

- ``TASK.md`` — the usual prompt (reference, device, parent, evidence, answer format) and
  what to do: leave the kernel in ``model_new.py``;
- ``reference.py`` (the task), ``parent.py`` (the parent, when there is one; also the
  starting ``model_new.py``), ``evidence.md`` (what happened to the parent);
- ``check``, ``compile`` and ``time`` — scripts that send a file (default
  ``model_new.py``) to kf, which runs it in its own sandboxed verifier on a device of the
  run (the same tools a tool-using episode has, :mod:`agents.tool_server`) and prints the
  verdict; ``check`` exits 0 only when the kernel is correct.

It then runs the command (``/bin/sh -c``; ``{dir}``, ``{task_file}``, ``{prompt}``,
``{model_file}`` and ``{check}`` in the template are replaced, shell-quoted) in that folder
with a time limit, and takes the ``ModelNew`` module the agent left in ``model_new.py`` as
the candidate, which then goes through the normal pipeline. Recorded: each tool the agent
ran (``episode.tool_called``) and an ``episode.ended`` with the command, its exit code, the
transcript (its output, trimmed), the files it left and the seconds it took.

The command is the user's own program (it usually needs the network to reach its model),
so it runs as the user, outside kf's box, like any command the user types; only what it
asks ``check`` to run is run in the box.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.tool_mutator import EpisodeResult, ToolFn, episode_ended, tool_called
from kf.llm.parse import ResponseError, parse_edit
from kf.llm.prompts import Prompt
from kf.llm.tools import ToolReply
from kf.settings import current

__all__ = ["CliSpec", "agent_label", "run_cli_episode"]

TRANSCRIPT_LIMIT = 16_000
_OURS = {"TASK.md", "reference.py", "parent.py", "evidence.md", "check", "compile", "time"}

_SCRIPT = '''#!{python}
"""kf's sandboxed {tool}: ./{tool} [FILE] (default: model_new.py). Sends the file to kf,
which runs it on a device of the run, and prints the verdict."""
import json, os, socket, sys

here = os.path.dirname(os.path.abspath(__file__))
path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "model_new.py")
with open(path) as f:
    source = f.read()
s = socket.socket(socket.AF_UNIX)
s.connect(os.path.join(here, ".kf-tools.sock"))
s.sendall(json.dumps({{"tool": "{tool}", "source": source}}).encode() + b"\\n")
data = b""
while not data.endswith(b"\\n"):
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
reply = json.loads(data or b'{{"ok": false, "text": "kf did not answer"}}')
print(reply["text"])
sys.exit(0 if reply["ok"] else 1)
'''


def agent_label(template: str) -> str:
    """The honest ``mutator`` field of a candidate a coding-agent CLI wrote."""
    return f"agent-cmd: {template}"


@dataclass
class CliSpec:
    """One CLI episode's inputs."""

    episode: str
    task: str
    selection: int | None
    template: str
    timeout_s: float
    prompt: Prompt
    reference: str
    parent: str | None = None
    evidence: str = ""
    tool_calls: int = 12
    seen: set[str] = field(default_factory=set)
    model: str = ""


def _fill(template: str, values: dict[str, str]) -> str:
    out = template
    for key, value in values.items():
        out = out.replace("{" + key + "}", shlex.quote(value))
    return out


def _task_text(spec: CliSpec) -> str:
    body = "\n\n".join(f"<!-- {m['role']} -->\n{m['content']}" for m in spec.prompt.messages)
    return (
        body + "\n\n## What to do here\n"
        "Write your kernel, a whole Python module defining `ModelNew`, to `model_new.py` in "
        "this folder (it starts as a copy of the parent, when there is one). "
        "`./compile`, `./check` and `./time` (each takes a file, default model_new.py) run "
        "it in kf's sandbox on the target device; `./check` exits 0 only when it is "
        "correct. Test before you finish. kf takes model_new.py as your answer.\n"
    )


def _prepare(spec: CliSpec, folder: Path) -> None:
    (folder / "TASK.md").write_text(_task_text(spec))
    (folder / "reference.py").write_text(spec.reference)
    if spec.parent is not None:
        (folder / "parent.py").write_text(spec.parent)
        (folder / "model_new.py").write_text(spec.parent)
    (folder / "evidence.md").write_text(spec.evidence or "(no evidence: no parent)\n")
    for tool in ("check", "compile", "time"):
        path = folder / tool
        path.write_text(_SCRIPT.format(python=sys.executable, tool=tool))
        path.chmod(0o755)


def _files(folder: Path) -> tuple[str, ...]:
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in _OURS and not rel.startswith(".kf-"):
            out.append(rel)
    return tuple(out[:200])


async def run_cli_episode(spec: CliSpec, tool: ToolFn) -> EpisodeResult:
    """Run the agent command for one selection; never raises for the agent's failures."""
    settings = current()  # read once, where the episode starts: its folder and keeping it
    folder = Path(tempfile.mkdtemp(prefix="kf-agent-", dir=settings.agent_dir))
    events: list[Any] = []
    calls = 0
    t0 = time.monotonic()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        try:
            line = await reader.readline()
            try:
                req = json.loads(line)
                name, source = str(req["tool"]), str(req["source"])
            except (ValueError, KeyError, TypeError) as exc:
                reply = ToolReply(ok=False, text=f"bad request: {exc}", error=str(exc))
                name, source = "?", ""
            else:
                if calls >= spec.tool_calls:
                    reply = ToolReply(
                        ok=False,
                        text=f"no tool calls left (all {spec.tool_calls} made)",
                        error="limit",
                    )
                else:
                    calls += 1
                    reply = await tool(name, source)
            events.append(tool_called(spec, name, calls, json.dumps({"source": source}), reply))
            writer.write(json.dumps({"ok": reply.ok, "text": reply.text}).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    ended, cause, code = "answered", "", None
    command = ""
    transcript = b""
    server = None
    try:
        _prepare(spec, folder)
        server = await asyncio.start_unix_server(serve, path=str(folder / ".kf-tools.sock"))
        values = {
            "dir": str(folder),
            "task_file": str(folder / "TASK.md"),
            "prompt": _task_text(spec),
            "model_file": str(folder / "model_new.py"),
            "check": str(folder / "check"),
        }
        command = _fill(spec.template, values)
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            cwd=folder,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "KF_AGENT_DIR": str(folder)},
        )
        try:
            transcript, _ = await asyncio.wait_for(proc.communicate(), spec.timeout_s)
            code = proc.returncode
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            transcript = b""
            if proc.stdout is not None:
                with contextlib.suppress(Exception):
                    transcript = await asyncio.wait_for(proc.stdout.read(), 5)
            await proc.wait()
            code = proc.returncode
            ended, cause = "limit", f"wall time: the command ran past {spec.timeout_s:g} s"
        if ended == "answered" and code != 0:
            cause = f"the command exited {code}"
    except OSError as exc:
        ended, cause = "crash", f"could not run the command: {exc}"
    finally:
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()
    result_file = folder / "model_new.py"
    source: str | None = None
    reason = ""
    notes: tuple[str, ...] = ()
    if ended != "crash":
        text = result_file.read_text(errors="replace") if result_file.is_file() else None
        why = ""
        if text is None:
            why = "no model_new.py left"
        elif spec.parent is not None and text == spec.parent:
            why = "model_new.py unchanged"
        else:
            try:
                edit = parse_edit(text, None)
                source, notes = edit.source, tuple(edit.notes)
            except ResponseError as exc:
                why = f"model_new.py is unusable: {exc}"
        if why:
            # a limit stays the cause of an episode cut short; otherwise there was no answer
            ended = "no_answer" if ended == "answered" else ended
            cause = (cause + "; " if cause else "") + why
    files = _files(folder)
    if source is not None and hashlib.sha256(source.encode()).hexdigest() in spec.seen:
        reason, source = "the agent's candidate duplicates one already proposed", None
    elif source is None:
        reason = f"agent command ended without a candidate ({ended}: {cause})"
    if not settings.agent_keep:
        shutil.rmtree(folder, ignore_errors=True)
    out = transcript.decode(errors="replace")
    if len(out) > TRANSCRIPT_LIMIT:
        out = f"… ({len(out) - TRANSCRIPT_LIMIT} characters cut)\n" + out[-TRANSCRIPT_LIMIT:]
    run = {"command": spec.template, "exit_code": code, "transcript": out, "files": files}
    end = episode_ended(spec, "cli", ended, cause, t0, tool_calls=calls, **run)
    return EpisodeResult(
        events=events, source=source, kind="rewrite", notes=notes, reason=reason, ended=end
    )
