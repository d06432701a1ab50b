"""A candidate's source in normal form: what two candidates that compile to the same code
share, whatever their comments, blank lines and spacing.

The module is parsed as Python and dumped as its syntax tree, so Python comments,
docstrings, formatting and quoting are gone. Every string constant of more than one line
(the C++ or CUDA source a module builds) is then read as C: its ``//`` and
``/* */`` comments are dropped (never inside a C string or character literal), each line's
runs of spaces become one, a space next to punctuation goes unless punctuation is on both
sides (``a - -b`` keeps its meaning), blank lines go; line breaks stay, because the
preprocessor reads lines. Names are kept: renaming locals safely needs a C++ parser
(macros, and the names Python passes to ``load_inline``), so two kernels that differ only
in a local's name are not found equal (docs/decisions.md, "Duplicate candidates").

A source that is not valid Python is normalised as C text as a whole, so it still dedups
against itself with other spacing. :func:`digest` is what the archive compares.
"""

from __future__ import annotations

import ast
import hashlib
import re

__all__ = ["digest", "normal_c", "normal_form"]

_WORD = re.compile(r"\w")
#: marks that can join a neighbour into another token (``- -`` is not ``--``)
_JOINING = frozenset("+-*/%<>=!&|^:.#")


def _strip_c_comments(text: str) -> str:
    """``text`` without its C comments (a comment becomes one space), string and character
    literals kept whole."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "\"'":
            j = i + 1
            while j < n and text[j] != ch and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            out.append(" " if j < 0 or "\n" not in text[i:j] else "\n")
            i = n if j < 0 else j + 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _squeeze(line: str) -> str:
    """One line's spacing made canonical outside its literals: runs of blanks become one,
    and a blank goes unless it parts two word characters or two marks that could join
    into another token (``- -``, ``< <``, ``/ /``)."""
    parts = re.split(r"(\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*')", line)
    tokens: list[str] = []
    for k, part in enumerate(parts):
        tokens.append(part if k % 2 else re.sub(r"[ \t\f\v]+", " ", part))
    text = "".join(tokens).strip()
    out: list[str] = []
    for i, ch in enumerate(text):
        if ch == " " and 0 < i < len(text) - 1:
            left, right = text[i - 1], text[i + 1]
            words = bool(_WORD.match(left)) and bool(_WORD.match(right))
            if not words and not (left in _JOINING and right in _JOINING):
                continue
        out.append(ch)
    return "".join(out)


_DEFINE = re.compile(r"[ \t]*#[ \t]*define[ \t]+(\w+)([ \t]*)")


def _line(line: str) -> str:
    """One line in normal form; a ``#define``'s name keeps the blank after it, which
    tells an object-like macro (``X (a)``) from a function-like one (``X(a)``)."""
    m = _DEFINE.match(line)
    if m is None:
        return _squeeze(line)
    rest = _squeeze(line[m.end() :])
    return f"#define {m.group(1)}{' ' if m.group(2) else ''}{rest}".rstrip()


def normal_c(text: str) -> str:
    """C, C++ or CUDA text without comments, blank lines or insignificant spacing."""
    lines = (_line(line) for line in _strip_c_comments(text).splitlines())
    return "\n".join(line for line in lines if line)


class _Strings(ast.NodeTransformer):
    """Drops docstrings; puts every string constant of more than one line in C normal form."""

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if isinstance(node.value, str) and "\n" in node.value:
            return ast.copy_location(ast.Constant(value=normal_c(node.value)), node)
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
        return super().generic_visit(node)


def normal_form(source: str) -> str:
    """The source as the compiler and the interpreter see it, in one canonical text."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return "c:" + normal_c(source)
    return "py:" + ast.dump(_Strings().visit(tree), annotate_fields=False)


def digest(source: str) -> str:
    """sha256 of :func:`normal_form` (hex): equal for sources that compile to the same code
    up to comments and spacing."""
    return hashlib.sha256(normal_form(source).encode()).hexdigest()
