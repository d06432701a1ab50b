"""Canned answers for the scripted OpenAI-compatible server, shaped the way real models
answer (reasoning preambles, prose, several fences, CRLF, answers cut off at the token
limit). They are written by kf's developers, not by a model; the server that serves them
is labelled ``scripted`` and every candidate says so.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from tests.llm_server import user_text

# -- the CPU task tests/fixtures/llm/tasks/scale_relu.py ----------------------------------

CPP_MODULE = '''\
import ctypes

import torch
from torch import nn

import kf.native

# --- kf:params ---
SPACE = {"CHUNK": [16, 64, 256]}
CONFIG = {"CHUNK": 64}
# --- kf:end ---

SOURCE = r"""
#include <cstdint>
#include <algorithm>
extern "C" void scale_relu(const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
    #pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c0 = 0; c0 < cols; c0 += CHUNK) {
            const int64_t end = std::min<int64_t>(cols, c0 + CHUNK);
            #pragma omp simd
            for (int64_t c = c0; c < end; ++c) {
                const float v = x[r * cols + c] * @SCALE@ + b[c];
                y[r * cols + c] = v > 0.0f ? v : 0.0f;
            }
        }
    }
}
"""


class ModelNew(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(hidden))
        self.lib = kf.native.build(SOURCE.replace("@SCALE@", "@FACTOR@"), defines=CONFIG)
        self.lib.scale_relu.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        self.lib.scale_relu(
            x.data_ptr(), self.bias.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1]
        )
        return y
'''


def cpp_module(factor: str = "2.0f", broken: bool = False) -> str:
    """The C++/OpenMP kernel for scale_relu; ``factor`` 1.0f makes it wrong, ``broken``
    makes it fail to compile (an undeclared identifier)."""
    src = CPP_MODULE.replace("@FACTOR@", factor)
    if broken:
        src = src.replace("const float v = x[r", "const float v = xs[r")
    return src


class CpuResponder:
    """The first generation fails (a compile error, a wrong result); a retry whose prompt
    carries both failures' evidence gets a correct kernel, and another retry answer is cut
    off at the token limit; mutations get a SEARCH/REPLACE of the parent's CONFIG."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first = 0
        self.retries = 0
        self.mutations = 0
        self.evidence_seen: list[str] = []

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        text = user_text(body)
        if "Rewrite ONE region" in text:
            return {"content": "<think>short</think>\n```\nFuse, then vectorise.\n```"}
        if "Write a first, exactly correct kernel" in text:
            return self._init(text)
        return self._mutate(text)

    def _init(self, text: str) -> dict[str, Any]:
        with self.lock:
            if "Earlier attempt" not in text:
                n, self.first = self.first, self.first + 1
                kind = "first"
            else:
                n, self.retries = self.retries, self.retries + 1
                kind = "retry"
                self.evidence_seen.append(text)
        if kind == "first" and n % 2 == 0:
            return {
                "content": (
                    "<think>\nThe op is elementwise; one pass over x. Maybe:\n```python\n"
                    "class ModelNew: pass\n```\nNo, use OpenMP.\n</think>\n"
                    "Here is a fused kernel:\n\n```python\n"
                    + cpp_module(broken=True)
                    + "```\n\nIt parallelises over rows."
                )
            }
        if kind == "first":
            body = "Sure! ```python is below.\n```py\n" + cpp_module("1.0f") + "```\n"
            return {"content": body.replace("\n", "\r\n")}
        has_compile = "undeclared" in text or "not declared" in text
        has_trial = "max abs err" in text
        if not (has_compile and has_trial):
            return {"content": "I cannot see what went wrong."}
        if n % 2 == 0:
            return {
                "content": (
                    "The first attempt used an undeclared name and the second scaled by 1.\n"
                    "The kernel:\n```cpp\n// C++ part only, for reading\n```\n"
                    "The module:\n```python\n" + cpp_module() + "```\n"
                )
            }
        return {"content": "```python\n" + cpp_module()[:300], "finish_reason": "length"}

    def _mutate(self, text: str) -> dict[str, Any]:
        m = re.search(r'^CONFIG = \{"CHUNK": (\d+)\}$', text, re.MULTILINE)
        if m is None:
            return {"content": "No parent found."}
        with self.lock:
            self.mutations += 1
            n = self.mutations
        new = [16, 64, 256][n % 3]
        if str(new) == m.group(1):
            new = [16, 64, 256][(n + 1) % 3]
        return {
            "content": (
                "Try another chunk:\n<<<<<<< SEARCH\n"
                f"{m.group(0)}\n=======\nCONFIG = {{\"CHUNK\": {new}}}\n>>>>>>> REPLACE\n"
            )
        }
