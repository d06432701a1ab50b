"""``load_inline``'s CUDA sources compiled without ``#include <torch/types.h>``.

PyTorch's ``load_inline`` writes ``cuda.cu`` as ``#include <torch/types.h>``,
``#include <cuda.h>``, ``#include <cuda_runtime.h>``, then the ``cuda_sources``; the
first line is 324,000 lines of headers that nvcc parses three times (cudafe++, cicc, the
host compiler), most of a build's time even where the kernel names nothing of torch (the
split layout kf's prompt asks for: kernels and a launcher with plain pointers in
``cuda_sources``, the ``torch::Tensor`` wrapper in ``cpp_sources``).

For CUDA sources that :func:`why_not` finds free of torch, :func:`kf.cuda.inline.load_inline`
first builds with :func:`arguments` instead: the same call with PyTorch's
``no_implicit_headers=True`` and PyTorch's own implicit lines given back explicitly, except
that ``cuda.cu``'s first line is :data:`PLACEHOLDER` instead of the torch include. So
``main.cpp``, the flags, the module name and the link are PyTorch's, byte for byte, and
``cuda.cu`` keeps its line numbers. If that build fails in any way, the standard build
runs in the same folder and its outcome (its compile errors) is what the caller sees.
``$KF_TORCHFREE=0`` turns this off.

The test is conservative: outside comments and string literals the sources may not
include a torch, ATen, c10, pybind11 or Python header, name a namespace PyTorch's headers
open (``torch``, ``at``, ``c10``, ...), use an identifier with one of PyTorch's macro
prefixes (``TORCH_``, ``AT_``, ``C10_``, ...) or one of the macros those headers define
without one (``CHECK``, ``LOG``, ``CUDA_KERNEL_ASSERT``, ...), or test in ``#if``/
``#ifdef`` anything but the CUDA compiler's and toolkit's own macros (``#ifndef M_PI``
would pick another value where torch's headers defined it first). A name the sources
need from torch's headers and did not pass these tests makes the variant fail to compile,
and the standard build runs. ``tests/test_cuda_torchfree.py`` checks the lists against the
installed PyTorch's headers and that both builds give the same device and host code.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

from kf.settings import current

__all__ = ["PLACEHOLDER", "arguments", "prelude_known", "wanted", "why_not"]

#: ``cuda.cu``'s first line in the variant, where PyTorch puts ``#include <torch/types.h>``
PLACEHOLDER = "// kf: built without PyTorch's #include <torch/types.h> (kf.cuda.torchfree)"

#: The implicit lines PyTorch's ``load_inline`` puts in front of ``cpp_sources`` and
#: ``cuda_sources`` (its source says so: :func:`prelude_known`).
_CPP_PRELUDE = ("#include <torch/extension.h>",)
_CUDA_PRELUDE = ("#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>")

#: Namespaces PyTorch's headers open at the top level (``detail`` too, torch 2.13).
_NAMESPACES = frozenset(
    {"at", "c10", "caffe2", "torch", "pybind11", "ska", "ska_ordered", "c10_complex_math", "detail"}
)
_PREFIXES: tuple[str, ...] = (
    *("TORCH_", "AT_", "C10_", "CAFFE_", "CAFFE2_", "PYBIND11_", "THO_", "Py", "_TORCH_"),
    *("_C10_", "_HIDDEN_", "_JOIN_", "__ubsan_", "RECORD_", "REGISTER_"),
)
#: Macros PyTorch's ``torch/types.h`` leaves defined without one of those prefixes
#: (``tests/test_cuda_torchfree.py`` lists them from the installed headers), and
#: ``__COUNTER__``, whose values torch's headers would have used up.
_MACROS = frozenset(
    str.split(
        """
    BUILD_FEATURE_AVAILABLE BUILD_FEATURE_REQUIRED CHECK CONSTEXPR_EXCEPT_WIN_CUDA
    CUDA_KERNEL_ASSERT CUDA_KERNEL_ASSERT_MSG CUDA_KERNEL_ASSERT_PRINTF
    CUDA_KERNEL_ASSERT_VERBOSE DCHECK DECLARE_SYMINT_OP_INTONLY DEFINE_ST_ENUM_VAL_
    DEFINE_TO DLOG DYNAMIC_TYPE_BIT EXPECTED_MAX_LEVEL EXPORT_IF_NOT_GCC EXP_BIAS_FP8
    EXP_WIDTH_FP8 FAIL_MPSHOOKS_FUNC FAIL_MTIAHOOKS_FUNC FAIL_PRIVATEUSE1HOOKS_FUNC FATAL_IF
    FORALL_DYNAMIC_TYPES FORALL_DYNAMIC_TYPES_FAKE HAS_DEMANGLE HAS_IMPL_ABSTRACT_PYSTUB
    HAS_PT2_COMPLIANT_TAG HIDDEN_NAMESPACE_BEGIN HIDDEN_NAMESPACE_END
    LEGACY_CONTIGUOUS_MEMORY_FORMAT LLVM_GNUC_PREREQ LOG LOG_AT_FILE_LINE LOG_IF
    MAKE_TORCH_LIBRARY MAKE_TORCH_LIBRARY_IMPL MAN_WIDTH_FP8 MaxTypeIndex NON_FATAL_IF
    SKA_NOINLINE STATIC_CONSTEXPR_STR_INL_EXCEPT_WIN_CUDA
    STATIC_CONST_STR_OUT_OF_LINE_FOR_WIN_CUDA STD_TORCH_CHECK STD_TORCH_CHECK_MSG
    SYCL_KERNEL_ASSERT TENSORIMPL_MAYBE_VIRTUAL VLOG VLOG_IF VLOG_IS_ON WARNING_MESSAGE_STRING
    _EXPAND __COUNTER__
    """
    )
)
#: What ``#if``/``#ifdef`` may test: the CUDA compiler's and the toolkit's own macros,
#: which the variant's ``cuda.h`` and ``cuda_runtime.h`` define as the standard build's do.
_CONDITION_OK = re.compile(r"defined|__CUDA\w*|__NVCC\w*|CUDART_VERSION|CUDA_VERSION|__has_\w+")
_TORCH_HEADER = re.compile(r"(torch|ATen|c10|caffe2|pybind11|Python)\b", re.IGNORECASE)
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*(\w+)(.*)$", re.MULTILINE)
_CONDITIONALS = frozenset({"if", "ifdef", "ifndef", "elif", "elifdef", "elifndef"})


def _code(text: str) -> str:
    """``text`` with comments replaced by a space and string and character literals by
    ``""``; line continuations joined first (as the preprocessor does)."""
    text = text.replace("\\\r\n", "").replace("\\\n", "")
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
            out.append(" ")
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
            out.append(" ")
        elif char == '"' or (char == "'" and not (i and text[i - 1].isdigit())):
            j = i + 1
            while j < n and text[j] != char and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            i = j + 1
        else:
            out.append(char)
            i += 1
    return "".join(out)


def _texts(cuda_sources: Any) -> list[str] | None:
    if isinstance(cuda_sources, str):
        return [cuda_sources]
    if isinstance(cuda_sources, list | tuple) and all(isinstance(t, str) for t in cuda_sources):
        return list(cuda_sources)
    return None


def why_not(cuda_sources: Any) -> str | None:
    """Why ``cuda_sources`` may need PyTorch's headers (None: they name nothing of them)."""
    texts = _texts(cuda_sources)
    if not texts:
        return "no CUDA sources"
    joined = "\n".join(texts)
    if re.search(r'\bR"', joined):
        return "a raw string literal (not read here)"
    for directive, rest in _DIRECTIVE.findall(joined):  # comments too: conservative
        if directive in ("include", "include_next", "import") and _TORCH_HEADER.search(rest):
            return f"#{directive}{rest.rstrip()}"
    code = _code(joined)
    for directive, rest in _DIRECTIVE.findall(code):
        if directive in _CONDITIONALS:
            for name in _IDENTIFIER.findall(rest):
                if not _CONDITION_OK.fullmatch(name):
                    return f"#{directive} tests {name}"
    for name in _IDENTIFIER.findall(re.sub(r"^[ \t]*#[ \t]*include.*$", "", code, flags=re.M)):
        if name in _NAMESPACES or name in _MACROS or name.startswith(_PREFIXES):
            return f"names {name}"
    return None


@functools.cache
def prelude_known(load_inline: Callable[..., Any]) -> bool:
    """Whether PyTorch's ``load_inline`` (the function itself, not kf's in its place)
    takes ``no_implicit_headers`` and writes exactly the implicit lines :func:`arguments`
    gives back (read in its source)."""
    try:
        source = inspect.getsource(load_inline)
    except (OSError, TypeError):
        return False
    lines = [f"cpp_sources.insert(0, '{_CPP_PRELUDE[0]}')"]
    lines += [f"cuda_sources.insert({i}, '{line}')" for i, line in enumerate(_CUDA_PRELUDE)]
    inserts = re.findall(r"(?:cpp|cuda)_sources\.insert\([^\n]*\)", source)
    return "no_implicit_headers" in inspect.signature(load_inline).parameters and (inserts == lines)


def wanted(arguments: dict[str, Any], load_inline: Callable[..., Any]) -> bool:
    """Whether this call of PyTorch's ``load_inline`` (its arguments by name) is first
    built without the torch include (``$KF_TORCHFREE``, default on): CUDA sources free of
    torch, no ``no_implicit_headers`` or include paths of its own, and a PyTorch whose
    implicit lines are known."""
    if not current().torchfree or arguments.get("no_implicit_headers"):
        return False
    if arguments.get("sycl_sources") or arguments.get("with_cuda") is False:
        return False
    if arguments.get("extra_include_paths"):
        return False  # headers of the call's own, not read here, may include torch's
    return why_not(arguments.get("cuda_sources")) is None and prelude_known(load_inline)


def arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The call that writes the standard build's ``main.cpp`` and its ``cuda.cu`` with
    :data:`PLACEHOLDER` for the torch include: ``no_implicit_headers=True`` and PyTorch's
    other implicit lines given explicitly."""
    cpp = arguments.get("cpp_sources")
    cuda = arguments.get("cuda_sources")
    cpp_list = [cpp] if isinstance(cpp, str) else list(cpp or [])
    cuda_list = [cuda] if isinstance(cuda, str) else list(cuda or [])
    return {
        **arguments,
        "no_implicit_headers": True,
        "cpp_sources": [*_CPP_PRELUDE, *cpp_list],
        "cuda_sources": [PLACEHOLDER, *_CUDA_PRELUDE[1:], *cuda_list],
    }
