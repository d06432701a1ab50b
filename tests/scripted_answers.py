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

# -- the CPU task tests/fixtures/search/scale_relu.py -------------------------------------

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
                f'{m.group(0)}\n=======\nCONFIG = {{"CHUNK": {new}}}\n>>>>>>> REPLACE\n'
            )
        }


# -- GPU tasks: CUDA C++ through load_inline (KernelBench's format) and Triton -------------

# Elementwise operators: (CUDA expression of v (and bias b), Triton expression of v, b).
ELEMENTWISE: dict[str, tuple[str, str]] = {
    "relu": ("fmaxf(v, 0.0f)", "tl.maximum(v, 0.0)"),
    "sigmoid": ("1.0f / (1.0f + expf(-v))", "1.0 / (1.0 + tl.exp(-v))"),
    "sigmoid_wrong": ("1.0f / (1.0f + expf(v))", "1.0 / (1.0 + tl.exp(v))"),
    "scale_relu": ("fmaxf(v * 2.0f + b, 0.0f)", "tl.maximum(v * 2.0 + b, 0.0)"),
}

_PARAMS = """# --- kf:params ---
SPACE = {"BLOCK": [128, 256, 512, 1024]}
CONFIG = {"BLOCK": %d}
# --- kf:end ---
"""


def _model_init(bias: bool) -> str:
    """ModelNew's constructor: a ``hidden``-wide bias parameter, or none."""
    if bias:
        return (
            "    def __init__(self, hidden: int) -> None:\n        super().__init__()\n"
            "        self.bias = nn.Parameter(torch.randn(hidden))\n"
        )
    return "    def __init__(self) -> None:\n        super().__init__()\n"


def cuda_elementwise(op: str, bias: bool = False, block: int = 256) -> str:
    """A load_inline module applying ``op`` elementwise (64-bit indices, grid-stride)."""
    expr = ELEMENTWISE[op][0]
    b_arg = ", const float* __restrict__ bias" if bias else ""
    b_load = "        const float b = bias[i % cols];\n" if bias else ""
    host_b = ", torch::Tensor bias" if bias else ""
    call_b = ", bias.contiguous().data_ptr<float>()" if bias else ""
    py_b = ", self.bias" if bias else ""
    init = _model_init(bias)
    return f'''import torch
from torch import nn
from torch.utils.cpp_extension import load_inline

{_PARAMS % block}
cuda_source = r"""
#include <torch/extension.h>

__global__ void ew_kernel(const float* __restrict__ x{b_arg}, float* __restrict__ y,
                          long long n, long long cols) {{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {{
        const float v = x[i];
{b_load}        y[i] = {expr};
    }}
}}

torch::Tensor ew_cuda(torch::Tensor x{host_b}) {{
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    const long long n = xc.numel();
    const long long cols = xc.dim() > 0 ? xc.size(-1) : 1;
    const int threads = __BLOCK__;
    long long blocks = (n + threads - 1) / threads;
    if (blocks > 132LL * 64) blocks = 132LL * 64;
    if (n > 0) {{
        ew_kernel<<<(unsigned)blocks, threads>>>(xc.data_ptr<float>(){call_b},
                                                 y.data_ptr<float>(), n, cols);
    }}
    return y;
}}
""".replace("__BLOCK__", str(CONFIG["BLOCK"]))

cpp_source = "torch::Tensor ew_cuda(torch::Tensor x{host_b});"

ext = load_inline(
    name="kf_scripted_{op}_b" + str(CONFIG["BLOCK"]),
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["ew_cuda"],
    extra_cuda_cflags=["-O3"],
    verbose=False,
)


class ModelNew(nn.Module):
{init}
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ext.ew_cuda(x{py_b})
'''


def triton_elementwise(op: str, bias: bool = False, block: int = 1024) -> str:
    """A Triton module applying ``op`` elementwise (64-bit offsets, masked tail)."""
    expr = ELEMENTWISE[op][1]
    b_arg = ", b_ptr" if bias else ""
    b_load = "    b = tl.load(b_ptr + offs % cols, mask=mask)\n" if bias else ""
    py_b = ", self.bias" if bias else ""
    init = _model_init(bias)
    return f"""import torch
import triton
import triton.language as tl
from torch import nn

{_PARAMS % block}

@triton.jit
def _ew(x_ptr{b_arg}, y_ptr, n, cols, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask)
{b_load}    tl.store(y_ptr + offs, {expr}, mask=mask)


class ModelNew(nn.Module):
{init}
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        grid = (triton.cdiv(n, CONFIG["BLOCK"]),)
        _ew[grid](x{py_b}, y, n, x.shape[-1] if x.dim() else 1, BLOCK=CONFIG["BLOCK"])
        return y
"""


CUDA_SOFTMAX = r'''import torch
from torch import nn
from torch.utils.cpp_extension import load_inline

# --- kf:params ---
SPACE = {"BLOCK": [256, 512, 1024]}
CONFIG = {"BLOCK": 1024}
# --- kf:end ---

cuda_source = r"""
#include <torch/extension.h>
#include <math_constants.h>

__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
    if (m2 == -CUDART_INF_F) return;
    if (m == -CUDART_INF_F) { m = m2; s = s2; return; }
    const float mn = fmaxf(m, m2);
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

// one block per row: an online max/sum pass, then a pass writing exp(x - max) / sum
__global__ void softmax_rows(const float* __restrict__ x, float* __restrict__ y, long long cols) {
    const float* xr = x + (long long)blockIdx.x * cols;
    float* yr = y + (long long)blockIdx.x * cols;
    float m = -CUDART_INF_F, s = 0.0f;
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = xr[c];
        if (v > m) { s = (m == -CUDART_INF_F ? 0.0f : s * expf(m - v)) + 1.0f; m = v; }
        else { s += expf(v - m); }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        combine(m, s, m2, s2);
    }
    __shared__ float sm[32], ss[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { sm[warp] = m; ss[warp] = s; }
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) / 32;
        m = lane < warps ? sm[lane] : -CUDART_INF_F;
        s = lane < warps ? ss[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
            const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
            combine(m, s, m2, s2);
        }
        if (lane == 0) { sm[0] = m; ss[0] = s; }
    }
    __syncthreads();
    const float row_max = sm[0], inv = 1.0f / ss[0];
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
        yr[c] = expf(xr[c] - row_max) * inv;
    }
}

torch::Tensor softmax_cuda(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2, "x must be a 2-D CUDA tensor");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    if (xc.numel() > 0) {
        softmax_rows<<<(unsigned)xc.size(0), __BLOCK__>>>(xc.data_ptr<float>(),
                                                       y.data_ptr<float>(), xc.size(1));
    }
    return y;
}
""".replace("__BLOCK__", str(CONFIG["BLOCK"]))

ext = load_inline(
    name="kf_scripted_softmax_b" + str(CONFIG["BLOCK"]),
    cpp_sources="torch::Tensor softmax_cuda(torch::Tensor x);",
    cuda_sources=cuda_source,
    functions=["softmax_cuda"],
    extra_cuda_cflags=["-O3"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ext.softmax_cuda(x)
'''

TRITON_SOFTMAX = r"""import torch
import triton
import triton.language as tl
from torch import nn

# --- kf:params ---
SPACE = {"BLOCK": [1024, 2048, 4096, 8192]}
CONFIG = {"BLOCK": 4096}
# --- kf:end ---


@triton.jit
def _softmax(x_ptr, y_ptr, cols, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * cols
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + base + offs, mask=offs < cols, other=float("-inf"))
        m_new = tl.maximum(m, v)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.exp(v - safe)
        m = m_new
    row_max = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - row_max), 0)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        v = tl.load(x_ptr + base + offs, mask=mask, other=float("-inf"))
        tl.store(y_ptr + base + offs, tl.exp(v - row_max) / total, mask=mask)


class ModelNew(nn.Module):
    def __init__(self) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        _softmax[(x.shape[0],)](x, y, x.shape[1], BLOCK=CONFIG["BLOCK"], num_warps=8)
        return y
"""

# task name (as kf names it: the file's stem) → (CUDA module, Triton module, bias?)
GPU_TASKS: dict[str, tuple[str, str]] = {
    "scale_relu": (
        cuda_elementwise("scale_relu", bias=True),
        triton_elementwise("scale_relu", bias=True),
    ),
    "19_ReLU": (cuda_elementwise("relu"), triton_elementwise("relu")),
    # the first CUDA answer for sigmoid is wrong (exp(v) for exp(-v)); its retry is right
    "21_Sigmoid": (cuda_elementwise("sigmoid_wrong"), triton_elementwise("sigmoid")),
    "23_Softmax": (CUDA_SOFTMAX, TRITON_SOFTMAX),
}
GPU_FIXED: dict[str, str] = {"21_Sigmoid": cuda_elementwise("sigmoid")}

_TASK = re.compile(r"^# Task `([^`]+)`", re.MULTILINE)


class GpuResponder:
    """Answers first-generation requests with the canned module for the task and the
    language the prompt asks for (prose and a reasoning preamble around it), retries with
    the fixed module, and mutations with a SEARCH/REPLACE of the parent's CONFIG block size.
    Counts requests per task and language."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.mutations = 0

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        text = user_text(body)
        if "Rewrite ONE region" in text:
            return {"content": "```\nCoalesce loads; one pass per element; 64-bit indices.\n```"}
        m = _TASK.search(text)
        task = m.group(1) if m else "?"
        language = "triton" if "Language: Triton" in text else "cuda"
        with self.lock:
            key = f"{task}:{language}"
            self.requests[key] = self.requests.get(key, 0) + 1
        if "Write a first, exactly correct kernel" in text:
            if task not in GPU_TASKS:
                return {"content": f"I have no kernel for {task}."}
            cuda, triton = GPU_TASKS[task]
            module = triton if language == "triton" else cuda
            if "Earlier attempt" in text and language == "cuda":
                module = GPU_FIXED.get(task, module)
            return {
                "content": (
                    f"<think>\n{task} is memory-bound; one pass, coalesced.\n</think>\n"
                    f"Here is a {language} implementation:\n\n```python\n{module}```\n"
                    "It keeps the reference's interface."
                )
            }
        cfg = re.search(r'^CONFIG = \{"BLOCK": (\d+)\}$', text, re.MULTILINE)
        space = re.search(r'^SPACE = \{"BLOCK": \[([\d, ]+)\]\}$', text, re.MULTILINE)
        if cfg is None or space is None:
            return {"content": "No parent kernel with a BLOCK parameter."}
        with self.lock:
            self.mutations += 1
            n = self.mutations
        sizes = [int(v) for v in space.group(1).split(",")]
        new = sizes[n % len(sizes)]
        if new == int(cfg.group(1)):
            new = sizes[(n + 1) % len(sizes)]
        return {
            "content": (
                f"A block of {new} threads should balance occupancy:\n<<<<<<< SEARCH\n"
                f'{cfg.group(0)}\n=======\nCONFIG = {{"BLOCK": {new}}}\n>>>>>>> REPLACE\n'
            )
        }


# -- tool-using episodes and coding agents (tests/test_tool_mutator.py) -------------------

CHUNKS = (16, 32, 48, 64, 96, 128, 192, 256)


def cpp_variant(chunk: int, broken: bool = False) -> str:
    """The scale_relu module with ``CHUNK`` = ``chunk`` (its space lists every CHUNKS value)."""
    return (
        cpp_module(broken=broken)
        .replace('SPACE = {"CHUNK": [16, 64, 256]}', f'SPACE = {{"CHUNK": {list(CHUNKS)}}}')
        .replace('CONFIG = {"CHUNK": 64}', f'CONFIG = {{"CHUNK": {chunk}}}')
    )


class ToolEpisodeResponder:
    """Plays a tool-using episode for every request that offers tools: it calls
    ``compile`` on a module that does not compile; once the tool's result shows the
    compiler's error it calls ``check`` on the fixed module; once ``check`` says correct it
    answers with that module. Requests without tools (single-shot calls, prompt rewrites)
    get a whole module at once. Each answer uses a fresh CHUNK, so none is a duplicate."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0
        self.episodes: list[list[str]] = []  # per episode: the tool results seen, in order
        self.single = 0

    def _chunk(self, body: dict[str, Any]) -> int:
        """A fresh CHUNK on an episode's first turn; later turns read it back from the
        module the episode's earlier tool call carried."""
        for m in reversed(body["messages"]):
            for call in m.get("tool_calls") or ():
                found = re.search(
                    r'CONFIG = \{\\?"CHUNK\\?": (\d+)\}', call["function"]["arguments"]
                )
                if found:
                    return int(found.group(1))
        with self.lock:
            self.n += 1
            return CHUNKS[self.n % len(CHUNKS)]

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        from tests.llm_server import tool_results

        text = user_text(body)
        if "Rewrite ONE region" in text:
            return {"content": "```\nFuse, then vectorise.\n```"}
        if not body.get("tools") and not tool_results(body):
            with self.lock:
                self.single += 1
                self.n += 1
                n = self.n
            return {"content": "```python\n" + cpp_variant(CHUNKS[n % len(CHUNKS)]) + "```\n"}
        chunk = self._chunk(body)
        seen = tool_results(body)
        with self.lock:
            if not seen:
                self.episodes.append([])
            else:
                self.episodes.append(list(seen))
        if not seen:
            return {
                "content": "Let me build it first.",
                "tool_calls": [
                    {"name": "compile", "arguments": {"source": cpp_variant(chunk, True)}}
                ],
            }
        last = seen[-1]
        if "failed to build" in last:
            return {"tool_calls": [{"name": "check", "arguments": {"source": cpp_variant(chunk)}}]}
        if last.startswith("correct"):
            return {"content": "Checked and correct:\n```python\n" + cpp_variant(chunk) + "```\n"}
        return {"content": "I could not make it work."}


def hash_text(text: str) -> int:
    """A stable hash of a text (Python's own is salted per process)."""
    import zlib

    return zlib.crc32(text.encode())
