"""Turning a model's answer into a candidate: a full rewrite or SEARCH/REPLACE diffs.

Answers are read the way real models write them: CRLF line ends are normalised,
``<think>…</think>`` reasoning is dropped, prose around the code is ignored. A full rewrite
is a fenced block (```python, ```py, a bare fence, or ~~~) defining ``ModelNew``; of
several, the last that parses and defines it wins; an answer with no fence at all that is
itself such a module is taken whole. An unclosed last block (an answer cut off by the token
limit) is named as such. Diffs are blocks of the form::

    <<<<<<< SEARCH
    text that occurs in the parent
    =======
    its replacement
    >>>>>>> REPLACE

applied in order; a SEARCH text must occur in the parent exactly, or line by line with
surrounding whitespace ignored. Anything else raises :class:`ResponseError`, whose
message becomes the reason of a recorded failed mutation.
"""

from __future__ import annotations

import ast
import re

from kf.kernels import params

__all__ = [
    "Edit",
    "ResponseError",
    "apply_diffs",
    "clean_answer",
    "code_blocks",
    "parse_edit",
    "parse_region",
]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_DIFF = re.compile(
    r"^<{5,9} ?SEARCH[^\n]*\n(.*?)^={5,9}[ \t]*\n(.*?)^>{5,9} ?REPLACE[^\n]*$",
    re.DOTALL | re.MULTILINE,
)


class ResponseError(ValueError):
    """The response held no usable edit; the message says what was wrong."""


class Edit:
    """A parsed answer: the new source and how it was obtained (``rewrite`` or ``diff``)."""

    def __init__(
        self, source: str, kind: str, blocks: int = 1, notes: list[str] | None = None
    ) -> None:
        self.source = source
        self.kind = kind
        self.blocks = blocks
        self.notes = list(notes or [])


def _find_lines(parent: str, search: str) -> tuple[int, int] | None:
    """Character span of ``search`` in ``parent`` matching line by line, ignoring edges' spaces."""
    want = [ln.strip() for ln in search.strip("\n").splitlines()]
    if not want or not any(want):
        return None
    lines = parent.splitlines(keepends=True)
    for i in range(len(lines) - len(want) + 1):
        if all(lines[i + k].strip() == want[k] for k in range(len(want))):
            start = sum(len(x) for x in lines[:i])
            end = start + sum(len(x) for x in lines[i : i + len(want)])
            return start, end
    return None


def apply_diffs(parent: str, blocks: list[tuple[str, str]]) -> str:
    """Apply SEARCH/REPLACE blocks in order; raise :class:`ResponseError` when one misses."""
    source = parent
    for n, (search, replace) in enumerate(blocks, 1):
        if not search.strip():
            raise ResponseError(f"SEARCH block {n} is empty")
        if search in source:
            source = source.replace(search, replace, 1)
            continue
        span = _find_lines(source, search)
        if span is None:
            first = search.strip().splitlines()[0][:80]
            raise ResponseError(
                f"SEARCH block {n} does not occur in the parent (first line: {first!r})"
            )
        start, end = span
        repl = replace if replace.endswith("\n") or not replace else replace + "\n"
        source = source[:start] + repl + source[end:]
    return source


def _check(source: str, how: str) -> None:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ResponseError(f"{how}: not valid Python: {exc.msg} (line {exc.lineno})") from None
    if not any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body):
        raise ResponseError(f"{how}: the module defines no class ModelNew")
    try:
        params.parse(source)
    except params.ParamsError as exc:
        raise ResponseError(f"{how}: invalid kf:params block: {exc}") from None


_THINK = re.compile(r"<(think|thinking|reasoning)>.*?</\1>", re.DOTALL | re.IGNORECASE)
_THINK_OPEN = re.compile(r"<(think|thinking|reasoning)>", re.IGNORECASE)
_FENCE_LINE = re.compile(r"^[ \t]*(```|~~~)[ \t]*([A-Za-z0-9_+.-]*)[^\n]*$", re.MULTILINE)
_PYTHON_TAGS = ("", "python", "py", "python3", "py3")


def clean_answer(response: str) -> tuple[str, list[str]]:
    """The answer without CRLF line ends and without ``<think>…</think>`` reasoning.

    Returns the text and notes on what was removed. An opened but never closed reasoning
    block leaves nothing: :class:`ResponseError` says so.
    """
    notes: list[str] = []
    text = response
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        notes.append("CRLF line ends normalised")
    removed = 0
    while True:
        m = _THINK.search(text)
        if m is None:
            break
        removed += len(m.group(0))
        text = text[: m.start()] + text[m.end() :]
    opened = _THINK_OPEN.search(text)
    if opened is not None:
        before = text[: opened.start()]
        if "ModelNew" not in before and "SEARCH" not in before:
            raise ResponseError(
                "the answer is all reasoning: a <think> block was opened and never closed"
            )
        removed += len(text) - opened.start()
        text = before
    if removed:
        notes.append(f"reasoning removed ({removed} chars)")
    return text, notes


def code_blocks(text: str) -> tuple[list[tuple[str, str]], bool]:
    """Fenced blocks as ``(language, body)`` in order, and whether the last one is unclosed."""
    blocks: list[tuple[str, str]] = []
    fences = list(_FENCE_LINE.finditer(text))
    i = 0
    while i < len(fences):
        opening = fences[i]
        closing = next(
            (f for f in fences[i + 1 :] if f.group(1) == opening.group(1) and not f.group(2)),
            None,
        )
        if closing is None:
            body = text[opening.end() + 1 :]
            blocks.append((opening.group(2).lower(), body))
            return blocks, True
        blocks.append((opening.group(2).lower(), text[opening.end() + 1 : closing.start()]))
        i = fences.index(closing) + 1
    return blocks, False


def _defines_model_new(source: str) -> tuple[bool, str | None]:
    """Whether ``source`` parses and defines ``class ModelNew`` (and the syntax error if not)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return False, f"{exc.msg} (line {exc.lineno})"
    found = any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body)
    return found, None


def _full_module(text: str, cut: bool) -> tuple[str, list[str]]:
    """The module of a full-rewrite answer: the last Python block defining ModelNew."""
    blocks, unclosed = code_blocks(text)
    notes: list[str] = []
    candidates = [(i, body) for i, (lang, body) in enumerate(blocks) if lang in _PYTHON_TAGS]
    good = [(i, body) for i, body in candidates if _defines_model_new(body)[0]]
    if good:
        i, body = good[-1]
        if len(blocks) > 1:
            notes.append(f"took block {i + 1} of {len(blocks)} (the last defining ModelNew)")
        if unclosed and i == len(blocks) - 1:
            raise ResponseError(_cut_message(cut, "the code block defining ModelNew is not closed"))
        return body, notes
    if not blocks:
        ok, _ = _defines_model_new(text)
        if ok:
            return text, ["no code fence: the whole answer is the module"]
    broken = [(i, body) for i, body in candidates if "ModelNew" in body]
    if broken:
        i, body = broken[-1]
        if unclosed and i == len(blocks) - 1:
            raise ResponseError(_cut_message(cut, "the last code block is not closed"))
        _, err = _defines_model_new(body)
        if err is None:
            raise ResponseError(f"the rewritten module (block {i + 1}) defines no class ModelNew")
        raise ResponseError(
            f"the code block defining ModelNew (block {i + 1}) is not valid Python: {err}"
        )
    if unclosed:
        raise ResponseError(_cut_message(cut, "the last code block is not closed"))
    tags = sorted({lang or "(bare)" for lang, _ in blocks})
    raise ResponseError(
        "no ```python block defining ModelNew and no SEARCH/REPLACE diff in the response"
        + (f" (blocks seen: {', '.join(tags)})" if blocks else "")
    )


def _cut_message(cut: bool, what: str) -> str:
    if cut:
        return f"the answer was cut off at the token limit (finish_reason=length): {what}"
    return f"{what} (the answer looks cut off)"


def parse_edit(response: str, parent: str | None, *, finish_reason: str | None = None) -> Edit:
    """The candidate a response describes, relative to ``parent`` (None: a first kernel,
    which must be a complete module). ``finish_reason="length"`` (the answer hit the token
    limit) is named in the error when the answer is unusable."""
    cut = finish_reason == "length"
    if not response.strip():
        empty = "the response is empty"
        raise ResponseError(_cut_message(True, empty) if cut else empty)
    text, notes = clean_answer(response)
    if not text.strip():
        raise ResponseError("the answer holds nothing besides its reasoning")
    diffs = [(m.group(1), m.group(2)) for m in _DIFF.finditer(text)]
    if diffs and parent is None:
        raise ResponseError(
            "SEARCH/REPLACE diffs need a parent; a first kernel must be a complete module"
        )
    if diffs:
        assert parent is not None
        source = apply_diffs(parent, diffs)
        _check(source, "after applying the diff")
        kind, blocks = "diff", len(diffs)
    else:
        source, more = _full_module(text, cut)
        notes += more
        _check(source, "the rewritten module")
        kind, blocks = "rewrite", 1
    if parent is not None and source.strip() == parent.strip():
        raise ResponseError("the edit leaves the parent unchanged")
    if cut:
        notes.append("the answer hit the token limit after its code (finish_reason=length)")
    return Edit(source, kind, blocks, notes)


def parse_region(response: str, limit: int = 4000) -> str:
    """A rewritten prompt region: the first fenced block, else the whole stripped text
    (reasoning in ``<think>`` blocks and CRLF line ends removed first)."""
    response, _ = clean_answer(response)
    m = _FENCE.search(response)
    text = (m.group(2) if m else response).strip()
    if not text:
        raise ResponseError("the rewritten region is empty")
    if len(text) > limit:
        raise ResponseError(f"the rewritten region is {len(text)} characters (limit {limit})")
    return text
