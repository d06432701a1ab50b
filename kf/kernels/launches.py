"""The ``<<<...>>>`` launches of a CUDA source, read as kf reads them everywhere: comments
and literals blanked first, a launch's configuration split at its top-level commas (so
``dim3(a, b)`` is one part).

:mod:`kf.cuda.torchsplit` rewrites launches through launchers with these; the grader's
graph timing asks :func:`legacy_stream_launch` whether a kernel went to the legacy
default stream, which a CUDA graph captured on torch's stream does not hold.
"""

from __future__ import annotations

import re

#: a launch: the kernel's name and its configuration (between ``<<<`` and ``>>>``)
LAUNCH = re.compile(r"([A-Za-z_]\w*)\s*<<<(.*?)>>>\s*\(", re.DOTALL)

#: a stream argument that names the legacy default stream
_LEGACY_STREAMS = {"0", "nullptr", "NULL", "cudaStreamLegacy", "(cudaStream_t)0"}


def blank(text: str) -> str:
    """``text`` the same length, comments blanked (newlines kept) and the insides of
    string and character literals blanked (their quotes kept)."""
    out = list(text)
    i, n = 0, len(text)

    def clear(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            clear(i, end)
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            clear(i, end)
            i = end
        elif text[i] == '"' or (text[i] == "'" and not (i and text[i - 1].isalnum())):
            j = i + 1
            while j < n and text[j] != text[i] and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            clear(i + 1, min(j, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


def split_top(config: str) -> list[str]:
    """``config`` split at its commas outside parentheses, brackets and braces."""
    parts, depth, last = [], 0, 0
    for i, char in enumerate(config):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(config[last:i])
            last = i + 1
    parts.append(config[last:])
    return parts


def configs(source: str) -> list[tuple[str, list[str]]]:
    """Each launch of ``source`` (comments and literals ignored): its kernel's name and
    its configuration's parts, stripped."""
    return [
        (m.group(1), [part.strip() for part in split_top(m.group(2))])
        for m in LAUNCH.finditer(blank(source))
    ]


def legacy_stream_launch(source: str) -> bool:
    """Whether a launch of ``source`` goes to the legacy default stream: no stream
    argument (``<<<grid, block>>>``, ``<<<grid, block, shared>>>``) or stream ``0``."""
    return any(
        len(parts) < 4 or parts[3].replace(" ", "") in _LEGACY_STREAMS
        for _, parts in configs(source)
    )
