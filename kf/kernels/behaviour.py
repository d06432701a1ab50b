"""MAP-Elites behavioural descriptors, read from a candidate's source text.

:func:`describe` places a kernel in a 4×4×4 grid: how it uses **memory**, how it
**computes**, how it **parallelises**. It is a pure, deterministic function of the text
(regular expressions over it; no I/O, no hashing order), cheap enough to run inside
archive folds, and cached.

What is read
------------
The whole candidate module: Python, C++/CUDA embedded in string literals, Triton
kernels. When the text is a valid Python module, its ``#`` comments and bare string
statements (docstrings) are dropped, and C/C++ ``//`` and ``/* */`` comments inside its
string literals are dropped, so prose about a technique does not count as using it.
Text that is not Python is read as C/C++ with its comments dropped.

A source with no recognisable kernel (no ``__global__``, ``@triton.jit``,
``extern "C"``, ``#pragma omp``, SIMD intrinsics, ``load_inline``/``cpp_extension``,
``kf.native``, ``<<<…>>>``, ``PYBIND11_MODULE``/``TORCH_LIBRARY``) is ``(0, 0, 0)``.

Memory (``MEMORY_LEVELS``)
--------------------------
=====  ============  ==============================================================
level  name          raised by (the highest matching rule wins)
=====  ============  ==============================================================
0      naive         scalar loads and stores only
1      vectorised    CUDA vector types (``float4``, ``half2``, ``__nv_bfloat162``…),
                     ``__ldg``, ``reinterpret_cast<float4…>``; x86 ``__m128/256/512``
                     and ``_mm*_`` intrinsics; NEON/SVE (``float32x4_t``, ``vld1q_``,
                     ``svld1``); ``#pragma omp simd``, ``GCC ivdep``,
                     ``vector_size``; Triton ``tl.load``; CONFIG ``*VEC*``/``*SIMD*``/
                     ``*LANES*``/``*UNROLL*``/``*_PER_THREAD`` > 1
2      tiled         ``__shared__``; ``tl.dot``; a Triton ``range(…, BLOCK_K)`` loop;
                     a C ``for`` loop stepping by a ``TILE``/``BLOCK``/``BM``/``KC``…
                     name or a ``*tile*`` variable; a local array sized by such a
                     name; CONFIG ``*TILE*``/``BLOCK_M|N|K``/``BM|BN|BK``/``MC|NC|KC``
                     > 1
3      registers     2-D register arrays with small dimensions (``float acc[4][4]``,
                     ``[TM][TN]``) not in shared memory; arrays of SIMD vectors
                     (``__m256 c[4]``); four or more numbered accumulators
                     (``acc0…acc3``, ``c00``…); ``micro_kernel``; async copies
                     (``cp.async``, ``__pipeline_memcpy_async``, ``memcpy_async``,
                     ``cuda::pipeline``, ``ldmatrix``, TMA descriptors);
                     AMX ``_tile_loadd``; ``tl.dot`` with ``tl.make_block_ptr`` or
                     ``tl.advance``; CONFIG ``TM|TN|MR|NR``/``*REG*`` > 1
=====  ============  ==============================================================

Compute (``COMPUTE_LEVELS``)
----------------------------
=====  ============  ==============================================================
level  name          rule
=====  ============  ==============================================================
3      tiled         matrix instructions (``wmma``, ``mma``, ``wgmma``, ``tl.dot``,
                     ``_mm512_dpbf16_ps``, VNNI ``dpbusd``, AMX ``_tile_*``, Arm
                     ``mmla``), or memory tiling together with register blocking
                     (a blocked GEMM-style micro-kernel)
2      online        online / single-pass algorithms: online softmax (``m_new``,
                     ``m_i``, ``l_i``, ``running_max``, ``exp(m_old - m_new)``…),
                     Welford (``welford``, ``mean += delta…``, ``M2 +=``), one-pass
                     sums of squares (``sum_sq``, ``sumsq``)
0      multi-pass    otherwise, two or more passes over the data: GPU kernels
                     (``__global__`` + ``@triton.jit``) when there are any, else
                     the larger of the ``extern "C"`` function definitions and the
                     ``omp for`` / ``at::parallel_for`` loops
1      fused         otherwise (one pass: everything the module does, in one
                     kernel; a single-op kernel counts as fused)
=====  ============  ==============================================================

Parallelism (``PARALLEL_LEVELS``)
---------------------------------
=====  ============  ==============================================================
level  name          CPU rule / CUDA rule / Triton rule
=====  ============  ==============================================================
0      thread        serial code / independent threads only / —
1      block         threads: ``omp parallel|for|task``, ``std::thread``,
                     ``pthread_create``, ``at::parallel_for``, ``tbb::``, CONFIG
                     ``*THREADS*``/``*WORKERS*`` > 1 / ``__syncthreads``,
                     ``__shared__``, ``this_thread_block``, block reductions /
                     every Triton program (a block of cooperating warps)
2      warp          SIMD: ``omp simd``, ``_mm*_`` intrinsics, ``__m256``, NEON/SVE, AMX,
                     ``vector_size``, ``ivdep``, CONFIG ``*VEC*`` > 1 / ``__shfl*``,
                     ``__reduce_*_sync``, ``__ballot_sync``, ``tiled_partition``,
                     warp reductions, ``wmma``/``mma`` / reductions (``tl.sum``,
                     ``tl.max``, ``tl.reduce``…) or ``tl.dot``
3      hierarchy     threads + SIMD + cache tiling together, or nested parallelism
                     (``omp teams``, ``omp_set_max_active_levels``, ``omp_set_nested``)
                     / block + warp cooperation together, block reductions finished
                     with global atomics, or grid-level cooperation (``this_grid``,
                     ``grid.sync``, cluster APIs, cooperative launch) / a Triton
                     reduction combined with ``tl.atomic_*`` or a persistent
                     ``tl.num_programs`` loop
=====  ============  ==============================================================

The CPU rules apply to CPU sources, the CUDA rules to sources with ``__global__``,
``threadIdx`` or ``blockIdx``, the Triton rules to ``@triton.jit`` sources; a source that
mixes them gets the highest level any applicable rule gives.

Template parameters (see :mod:`kf.kernels.params`) change what a kernel does, so the CONFIG of a
valid ``kf:params`` block raises levels as the tables say (integer values > 1 only;
booleans never count). ``*THREADS*`` and ``*VEC*`` raise parallelism on CPU sources only:
a CUDA block always has many threads, and CUDA vector width is a memory matter.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Mapping
from functools import lru_cache

import msgspec

from kf.kernels import params

__all__ = [
    "COMPUTE_LEVELS",
    "MEMORY_LEVELS",
    "PARALLEL_LEVELS",
    "Behaviour",
    "describe",
]

MEMORY_LEVELS = ("naive", "vectorised", "tiled", "registers")
COMPUTE_LEVELS = ("multi-pass", "fused", "online", "tiled")
PARALLEL_LEVELS = ("thread", "block", "warp", "hierarchy")


class Behaviour(msgspec.Struct, frozen=True):
    """Where a kernel sits in the archive: memory, compute and parallelism levels, 0..3."""

    memory: int
    compute: int
    parallel: int

    def cell(self) -> tuple[int, int, int]:
        """The archive cell: ``(memory, compute, parallel)``."""
        return (self.memory, self.compute, self.parallel)


def _rx(pattern: str, flags: int = 0) -> re.Pattern[str]:
    return re.compile(pattern, flags)


# --------------------------------------------------------------------------- signals

_KERNEL = _rx(
    r"__global__|\btriton\.jit\b|extern\s+\"C\"|#\s*pragma\s+omp\b|\b_mm(?:256|512)?_\w+"
    r"|\bload_inline\b|\bcpp_extension\b|\bkf\.native\b|<<<|PYBIND11_MODULE|TORCH_LIBRARY"
    r"|\bvld1q?_|\bsvld1"
)
_CUDA = _rx(r"__global__|\bthreadIdx\b|\bblockIdx\b")
_TRITON = _rx(r"\btriton\.jit\b")

_VECTOR = _rx(
    r"\b(?:float|int|uint|double|half|char|short|long)[24]\b|\b__half2\b|\bhalf2\b"
    r"|\b__nv_bfloat162\b|\b__ldg\b|reinterpret_cast\s*<\s*(?:const\s+)?\w+[24]\b"
    r"|\b__m(?:128|256|512)[dhi]?\b|\b_mm(?:256|512)?_\w+"
    r"|\b(?:float|int|uint)(?:8|16|32|64)x\d+_t\b|\bv(?:ld|st)[1-4]q?_\w+|\bsv(?:ld|st)1\w*"
    r"|#\s*pragma\s+omp\s+(?:parallel\s+for\s+|for\s+|declare\s+)?simd\b"
    r"|#\s*pragma\s+GCC\s+ivdep|#\s*pragma\s+clang\s+loop\s+vectorize|\bvector_size\b"
    r"|\btl\.load\b|\btl\.multiple_of\b|\btl\.max_contiguous\b"
)
_SIMD = _rx(
    r"\b__m(?:128|256|512)[dhi]?\b|\b_mm(?:256|512)?_\w+|\b(?:float|int|uint)(?:8|16|32|64)x\d+_t\b"
    r"|\bv(?:ld|st)[1-4]q?_\w+|\bsv(?:ld|st)1\w*|\bvector_size\b"
    r"|#\s*pragma\s+omp\s+(?:parallel\s+for\s+|for\s+|declare\s+)?simd\b"
    r"|#\s*pragma\s+GCC\s+ivdep|#\s*pragma\s+clang\s+loop\s+vectorize|\b_tile_\w+"
)

_TILE_NAME = r"(?:[A-Z0-9_]*(?:TILE|BLOCK|BLK|BM|BN|BK|MC|NC|KC)[A-Z0-9_]*|\w*[Tt]ile\w*)"
_TILING = _rx(
    r"__shared__|\btl\.dot\b"
    r"|\brange\s*\([^()\n]*,\s*[A-Z_0-9]*(?:BLOCK|TILE)[A-Z_0-9]*\s*\)"
    r"|\bfor\s*\([^;()]*;[^;]*;[^)]*\+=\s*" + _TILE_NAME + r"\s*\)"
    r"|\b\w+\s+\w+\s*\[\s*" + _TILE_NAME + r"\s*\]"
)
_SMALL = r"(?:[1-9]|1[0-6]|[A-Z_]*(?:TM|TN|MR|NR|REG|THREAD_M|THREAD_N|WM|WN)[A-Z0-9_]*)"
_REGISTERS = _rx(
    r"^(?![^\n]*__shared__)[^\n]*\b(?:float|double|half|__half|int|float[24]|acc_t|scalar_t"
    r"|accscalar_t|__m(?:128|256|512)[dhi]?|float32x4_t)\s+\w+\s*\[\s*"
    + _SMALL
    + r"\s*\]\s*\[\s*"
    + _SMALL
    + r"\s*\]"
    r"|\b__m(?:128|256|512)[dhi]?\s+\w+\s*\[|\b(?:float|int)(?:16|32)x\d+_t\s+\w+\s*\["
    r"|\bmicro_?kernel\w*|\bcp\.async\b|\bcp_async\w*|__pipeline_memcpy_async|\bmemcpy_async\b"
    r"|\bcuda::pipeline\b|\bldmatrix\b|\bcp\.async\.bulk\b|make_tensor_descriptor"
    r"|\bcuTensorMap\w*|\b_tile_loadd\w*",
    re.MULTILINE,
)
_NUMBERED_ACC = _rx(r"\b(?:acc|accum|sum|c|r)_?\d{1,2}\b")
_BLOCK_PTR = _rx(r"\btl\.make_block_ptr\b|\btl\.advance\b")
_DOT = _rx(r"\btl\.dot\b")

_MATRIX = _rx(
    r"\bwmma\b|\bw?mma(?:_sync)?\b|\bwgmma\w*|\btl\.dot\b|_mm512_dpbf16_ps|\b_mm\d*_dpbusds?_\w+"
    r"|\b_tile_\w+|\bvmmlaq\w*|\bsvmmla\w*|\bbfmmla\b"
)
_ONLINE = _rx(
    r"(?i:\bwelford\w*|\bonline_?softmax\w*)"
    r"|(?i:\b(?:running|online|prev|old|new)_?max\b|\bmax_?(?:new|old|prev)\b)"
    r"|\bm_(?:new|old|prev|i|ij)\b|\bl_(?:new|old|prev|i|ij)\b"
    r"|\bmean\w*\s*\+=\s*\w*delta|\b[mM]2\w*\s*\+="
    r"|(?i:\b(?:sum_?sq|sq_?sum|sumsq|sum_of_squares)\w*)"
)
_GPU_KERNEL = _rx(r"__global__|\btriton\.jit\b")
_OMP_FOR = _rx(r"#\s*pragma\s+omp\s+(?:parallel\s+)?for\b|\bat::parallel_for\b")
_EXTERN_C = _rx(r"extern\s+\"C\"")

_THREADS = _rx(
    r"#\s*pragma\s+omp\s+(?:parallel|for|task|taskloop)\b|\bstd::thread\b|\bstd::jthread\b"
    r"|\bpthread_create\b|\bat::parallel_for\b|\btbb::\w+|\bstd::async\b"
)
_NESTED = _rx(r"#\s*pragma\s+omp\s+teams\b|\bomp_set_max_active_levels\b|\bomp_set_nested\b")
_BLOCK_COOP = _rx(
    r"__syncthreads\w*|__shared__|\bthis_thread_block\b|\bthread_block\b"
    r"|(?i:\bblock_?reduce\w*)|\bcub::Block\w+"
)
_WARP = _rx(
    r"\b__shfl\w*|\b__reduce_\w+_sync\b|\b__ballot_sync\b|\b__any_sync\b|\b__all_sync\b"
    r"|\btiled_partition\b|(?i:\bwarp_?reduce\w*)|\bcub::Warp\w+|\bwmma\b|\bw?mma(?:_sync)?\b"
    r"|\b__activemask\b"
)
_GRID = _rx(
    r"\bthis_grid\b|\bgrid_group\b|\bgrid\.sync\b|\bcudaLaunchCooperativeKernel\w*"
    r"|\bcluster_group\b|\bthis_cluster\b|__cluster_dims__|\bcluster\.sync\b"
)
_ATOMIC = _rx(r"\batomic(?:Add|Max|Min|CAS|Exch|Or|And)\w*\s*\(")
_TRITON_REDUCE = _rx(
    r"\btl\.(?:sum|max|min|reduce|argmax|argmin|cumsum|cumprod|associative_scan|xor_sum|dot)\b"
)
_TRITON_GRID = _rx(r"\btl\.atomic_\w+|\btl\.num_programs\b")

# CONFIG parameter names, matched against the upper-cased name.
_CFG_REGISTERS = _rx(r"^(?:TM|TN|MR|NR|RM|RN)$|REG")
_CFG_TILE = _rx(r"TILE|^(?:BLOCK|BLK)_?(?:M|N|K|ROWS?|COLS?|SIZE_[MNK])$|^(?:BM|BN|BK|MC|NC|KC)$")
_CFG_VECTOR = _rx(r"VEC|SIMD|LANES|UNROLL|_PER_THREAD$")
_CFG_SIMD = _rx(r"VEC|SIMD|LANES")
_CFG_THREADS = _rx(r"THREADS|WORKERS")


# --------------------------------------------------------------------------- text


def _strip_c_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def _string_body(token: str) -> str:
    """The text inside a string literal token, with ``\\n`` escapes made real newlines."""
    prefix_len = 0
    while prefix_len < len(token) and token[prefix_len] not in "'\"":
        prefix_len += 1
    prefix = token[:prefix_len].lower()
    rest = token[prefix_len:]
    quote = 3 if rest[:3] in ('"""', "'''") else 1
    body = rest[quote:-quote] if len(rest) >= 2 * quote else rest
    return body if "r" in prefix else body.replace("\\n", "\n")


def _code_text(source: str) -> str:
    """The source without comments and docstrings (see the module docstring)."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return _strip_c_comments(source)
    lines = io.StringIO(source).readlines()
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    pieces: list[str] = []
    cursor = 0
    previous = tokenize.NEWLINE
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, ValueError):
        return _strip_c_comments(source)
    for index, tok in enumerate(tokens):
        kind = tok.type
        if kind in (tokenize.COMMENT, tokenize.STRING):
            begin = starts[tok.start[0] - 1] + tok.start[1]
            end = starts[tok.end[0] - 1] + tok.end[1]
            pieces.append(source[cursor:begin])
            if kind == tokenize.STRING:
                following = tokens[index + 1].type if index + 1 < len(tokens) else None
                bare = previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT) and (
                    following in (tokenize.NEWLINE, tokenize.ENDMARKER, None)
                )
                pieces.append(" " if bare else f" {_strip_c_comments(_string_body(tok.string))} ")
            cursor = end
        if kind not in (tokenize.COMMENT, tokenize.NL):
            previous = kind
    pieces.append(source[cursor:])
    return "".join(pieces)


def _config(source: str) -> Mapping[str, object]:
    try:
        parsed = params.parse(source)
    except params.ParamsError:
        return {}
    return parsed[1] if parsed is not None else {}


def _raised(config: Mapping[str, object], pattern: re.Pattern[str]) -> bool:
    """Whether some integer CONFIG value > 1 has a name ``pattern`` matches."""
    return any(
        isinstance(value, int)
        and not isinstance(value, bool)
        and value > 1
        and pattern.search(name.upper()) is not None
        for name, value in config.items()
    )


# --------------------------------------------------------------------------- levels


def _memory(text: str, config: Mapping[str, object]) -> int:
    numbered = {m.group(0) for m in _NUMBERED_ACC.finditer(text)}
    if (
        _REGISTERS.search(text)
        or len(numbered) >= 4
        or (_DOT.search(text) and _BLOCK_PTR.search(text))
        or _raised(config, _CFG_REGISTERS)
    ):
        return 3
    if _TILING.search(text) or _raised(config, _CFG_TILE):
        return 2
    if _VECTOR.search(text) or _raised(config, _CFG_VECTOR):
        return 1
    return 0


def _passes(text: str) -> int:
    gpu = len(_GPU_KERNEL.findall(text))
    if gpu:
        return gpu
    return max(_extern_c_functions(text), len(_OMP_FOR.findall(text)), 1)


_EXTERN_C_DEFINITION = _rx(r"\s*[^;{}]{0,1000}?\)\s*(?:const\s*)?\{")
_BRACES = _rx(r"[{}]")


def _extern_c_functions(text: str) -> int:
    """Function definitions declared ``extern "C"``, singly or in an ``extern "C" { }`` block.

    Linear in the text: each character is scanned at most once.
    """
    count = 0
    scanned = 0
    for match in _EXTERN_C.finditer(text):
        pos = match.end()
        if pos < scanned:
            continue
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if not text.startswith("{", pos):
            definition = _EXTERN_C_DEFINITION.match(text, pos)
            count += definition is not None
            scanned = definition.end() if definition else pos
            continue
        depth = 0
        for brace in _BRACES.finditer(text, pos):
            if brace.group() == "{":
                depth += 1
                if depth == 2:
                    head = text[max(pos, brace.start() - 200) : brace.start()].rstrip()
                    count += head.removesuffix("const").rstrip().endswith(")")
            else:
                depth -= 1
            scanned = brace.end()
            if depth == 0:
                break
        else:
            scanned = len(text)
    return count


def _compute(text: str, memory: int) -> int:
    tiled = _TILING.search(text) is not None
    if _MATRIX.search(text) or (tiled and memory == 3):
        return 3
    if _ONLINE.search(text):
        return 2
    return 0 if _passes(text) >= 2 else 1


def _parallel(text: str, config: Mapping[str, object], *, cuda: bool, triton: bool) -> int:
    levels = [0]
    cpu = not (cuda or triton) or bool(_THREADS.search(text) or _SIMD.search(text))
    if cpu:
        threads = _THREADS.search(text) is not None or _raised(config, _CFG_THREADS)
        simd = _SIMD.search(text) is not None or _raised(config, _CFG_SIMD)
        tiled = _TILING.search(text) is not None or _raised(config, _CFG_TILE)
        if _NESTED.search(text) or (threads and simd and tiled):
            levels.append(3)
        elif simd:
            levels.append(2)
        elif threads:
            levels.append(1)
    if cuda:
        block = _BLOCK_COOP.search(text) is not None
        warp = _WARP.search(text) is not None
        atomic = _ATOMIC.search(text) is not None
        if _GRID.search(text) or (block and (warp or atomic)):
            levels.append(3)
        elif warp:
            levels.append(2)
        elif block:
            levels.append(1)
    if triton:
        reduce = _TRITON_REDUCE.search(text) is not None
        if reduce and _TRITON_GRID.search(text):
            levels.append(3)
        else:
            levels.append(2 if reduce else 1)
    return max(levels)


@lru_cache(maxsize=4096)
def describe(source: str) -> Behaviour:
    """The behavioural descriptor of a candidate module's source (rules: module docstring)."""
    text = re.sub(r"[ \t]+", " ", _code_text(source))
    if not _KERNEL.search(text):
        return Behaviour(0, 0, 0)
    config = _config(source)
    cuda = _CUDA.search(text) is not None
    triton = _TRITON.search(text) is not None
    memory = _memory(text, config)
    return Behaviour(
        memory=memory,
        compute=_compute(text, memory),
        parallel=_parallel(text, config, cuda=cuda, triton=triton),
    )
