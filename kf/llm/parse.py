"""Turning a model's answer into a candidate: a full rewrite or SEARCH/REPLACE diffs.

A full rewrite is a fenced ```python block defining ``ModelNew`` (the longest such block
wins). Diffs are blocks of the form::

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

from kf import params

__all__ = ["Edit", "ResponseError", "apply_diffs", "parse_edit", "parse_region"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_DIFF = re.compile(
    r"^<{5,9} ?SEARCH[^\n]*\n(.*?)^={5,9}[ \t]*\n(.*?)^>{5,9} ?REPLACE[^\n]*$",
    re.DOTALL | re.MULTILINE,
)


class ResponseError(ValueError):
    """The response held no usable edit; the message says what was wrong."""


class Edit:
    """A parsed answer: the new source and how it was obtained (``rewrite`` or ``diff``)."""

    def __init__(self, source: str, kind: str, blocks: int = 1) -> None:
        self.source = source
        self.kind = kind
        self.blocks = blocks


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


def parse_edit(response: str, parent: str) -> Edit:
    """The candidate a response describes, relative to ``parent``."""
    if not response.strip():
        raise ResponseError("the response is empty")
    diffs = [(m.group(1), m.group(2)) for m in _DIFF.finditer(response)]
    if diffs:
        source = apply_diffs(parent, diffs)
        _check(source, "after applying the diff")
        kind, blocks = "diff", len(diffs)
    else:
        code = [
            body
            for lang, body in _FENCE.findall(response)
            if lang.lower() in ("", "python", "py", "python3") and "ModelNew" in body
        ]
        if not code:
            raise ResponseError(
                "no ```python block defining ModelNew and no SEARCH/REPLACE diff in the response"
            )
        source = max(code, key=len)
        _check(source, "the rewritten module")
        kind, blocks = "rewrite", 1
    if source.strip() == parent.strip():
        raise ResponseError("the edit leaves the parent unchanged")
    return Edit(source, kind, blocks)


def parse_region(response: str, limit: int = 4000) -> str:
    """A rewritten prompt region: the first fenced block, else the whole stripped text."""
    m = _FENCE.search(response)
    text = (m.group(2) if m else response).strip()
    if not text:
        raise ResponseError("the rewritten region is empty")
    if len(text) > limit:
        raise ResponseError(f"the rewritten region is {len(text)} characters (limit {limit})")
    return text
