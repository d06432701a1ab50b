"""KernelBench's usual layout split into kf's: kernels without torch, the wrapper in ``main.cpp``.

Models usually answer as KernelBench's examples do: the whole extension in
``cuda_sources`` under ``#include <torch/extension.h>``, kernels and the ``torch::Tensor``
host function that launches them with ``<<<...>>>``. nvcc then parses PyTorch's headers
three times (33 s on the H200 machine, against 1.2 s for a ``cuda.cu`` without them).

:func:`split` rewrites such a call, when :func:`why_not` finds nothing it cannot account
for, into the layout kf's prompt asks for:

- the **device part**, ``cuda_sources``: the source's non-torch includes, its kernels,
  ``__device__`` functions and variables, structs and the macros and constants they use,
  in their order, and for each kernel launched a *launcher* with plain parameters,
  ``void kf_launch_<kernel>(dim3, dim3, size_t, cudaStream_t, <the kernel's parameters>)``
  whose body is the launch ``<kernel><<<g, b, s, st>>>(<its parameters>)``. It must name
  nothing of torch (:func:`kf.cuda.torchfree.why_not`), and is built as
  :mod:`kf.cuda.torchfree` builds such sources: without ``#include <torch/types.h>``.
- the **host part**, appended to ``cpp_sources`` (so compiled by the C++ compiler in
  ``main.cpp``, with the precompiled ``torch/extension.h``, :mod:`kf.cuda.pch`): every
  include, the host functions, the launchers' declarations, and each
  ``k<<<g, b[, s[, st]]>>>(args);`` rewritten as ``kf_launch_k(g, b, s, st, args);``
  (``s`` and ``st`` default to 0 as ``<<<>>>``'s do). The launcher's parameters are the
  launch's own conversions: ``<<<>>>`` passes its configuration to
  ``__cudaPushCallConfiguration(dim3, dim3, size_t, cudaStream_t)`` and the arguments to
  the kernel's stub, whose parameters are the kernel's.

What makes it the same program, and what the checker therefore refuses (then the call is
built PyTorch's way, as before):

- every top-level item must be recognised: includes first (torch's, ATen's, c10's,
  pybind11's to the host part; a known list of system and CUDA headers to both;
  CUDA's device-only headers to the device part; anything else is refused); object-like
  macros and ``const``/``constexpr`` scalars with literal values (to both parts);
  function-like macros used on one side only; kernels (not templates, not overloaded),
  ``__device__`` items and structs; host functions and their declarations. Templates,
  namespaces, ``extern``, classes, enums, ``using``, ``typedef``, global host variables,
  raw strings, other directives (``#if``, ``#undef``, ``#pragma`` at top level) are
  refused;
- the host part may not name anything the device part defines (a kernel only in a
  launch it rewrites: not ``cudaFuncSetAttribute(kernel, ...)``), nor CUDA's device
  built-ins or qualifiers, nor hold a directive, nor call unqualified a function CUDA's
  headers declare for nvcc's compiles only (``min``, ``max``, ``abs``, ... whose
  overloads differ between nvcc's host pass and g++: read from the toolkit's headers);
  the device part may not name a host function;
- a launch is a statement ``name<<<config>>>(args);`` whose configuration holds no
  angle bracket, and neither holds ``++``, ``--`` or an assignment (nvcc evaluates the
  configuration before the arguments; a call leaves the order open);
- a launched kernel's parameters are named and typed only with scalar, CUDA vector and
  half types, pointers and qualifiers (the host part must spell them without the
  device part's structs);
- ``cpp_sources`` holds only includes and function declarations (the host part joins
  their translation unit), ``extra_cflags`` is empty and ``extra_cuda_cflags`` holds
  only flags of the device compile (``-O3``, ``--use_fast_math``, ``-lineinfo``,
  ``-Xptxas``...): the host part's compile gets the flags ``main.cpp`` gets.

Host code then differs from the standard build in its compiler's pass only: g++ on
``main.cpp`` instead of nvcc's host pass of ``cuda.cu`` (no ``__CUDACC__`` in PyTorch's
headers, ``main.cpp``'s optimisation level). ``tests/test_cuda_torchsplit.py`` compiles
typical answers both ways with nvcc and compares the kernels' SASS and the module's
exported functions.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kf.cuda import torchfree
from kf.kernels import launches

__all__ = ["LAUNCHER_PREFIX", "VERSION", "Split", "cuda_only_names", "split", "why_not"]

#: the transformation's version, in the build's key (a change rebuilds what it split)
VERSION = 1

#: the generated launchers' names start so (a source that names one is refused)
LAUNCHER_PREFIX = "kf_launch_"

#: headers whose code may go to the host part only
_TORCH_INCLUDE = re.compile(r"[<\"](torch|ATen|c10|pybind11|Python)\b")
#: headers both parts may include (the same declarations under nvcc and g++)
_BOTH = frozenset(
    str.split(
        """
    cuda.h cuda_runtime.h cuda_runtime_api.h cuda_fp16.h cuda_bf16.h cuda_fp8.h
    device_launch_parameters.h vector_types.h stdint.h stdio.h stdlib.h math.h float.h
    limits.h stddef.h cstdint cstdio cstdlib cmath cfloat climits cstddef vector algorithm
    utility type_traits limits iostream string array tuple
    """
    )
)
#: CUDA headers for device code only (g++ cannot read some of them)
_DEVICE_ONLY = re.compile(
    r"(cooperative_groups(/\w+)?\.h|mma\.h|cuda_pipeline(_primitives)?\.h|cuda_awbarrier\.h"
    r"|(cub|cuda|thrust)/[\w/]+(\.cuh|\.h)?|sm_\d+_intrinsics\.h)"
)
#: qualifiers and built-ins host code in the split may not hold
_DEVICE_WORDS = frozenset(
    str.split(
        """
    __global__ __device__ __host__ __shared__ __constant__ __managed__ __launch_bounds__
    __forceinline__ __noinline__ __syncthreads __syncwarp threadIdx blockIdx blockDim gridDim
    warpSize
    """
    )
)
#: what puts a top-level item in the device part
_DEVICE_QUALIFIERS = frozenset(
    {"__device__", "__host__", "__constant__", "__shared__", "__managed__", "__forceinline__"}
)
#: what refuses a top-level item outright
_REFUSED_WORDS = frozenset(
    str.split(
        """
    template namespace extern class union enum operator friend asm __asm__ typename
    decltype auto static_assert using typedef thread_local __attribute__ alignas
    """
    )
)
#: a launched kernel's parameter types may only be spelt with these
_PARAMETER_WORDS = frozenset(
    str.split(
        """
    const volatile __restrict__ __restrict unsigned signed long short int char float double
    bool size_t ptrdiff_t int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t
    half half2 __half __half2 __nv_bfloat16 __nv_bfloat162 nv_bfloat16 nv_bfloat162 void
    float1 float2 float3 float4 double1 double2 double3 double4 int1 int2 int3 int4 uint1
    uint2 uint3 uint4 char1 char2 char4 uchar1 uchar2 uchar4 short2 short4 ushort2 ushort4
    long2 long4 ulong2 longlong2 ulonglong2 dim3
    """
    )
)
#: device-compile flags that change nothing of host code (``extra_cuda_cflags``)
_CUDA_FLAG = re.compile(
    r"-O[0-3]|--?use_fast_math|-lineinfo|--?expt-relaxed-constexpr|--?expt-extended-lambda"
    r"|-Xptxas(=\S+)?|--ptxas-options=\S+|-v|-w|-maxrregcount=\d+|--maxrregcount=\d+"
    r"|-ftz=(true|false)|-prec-div=(true|false)|-prec-sqrt=(true|false)|-fmad=(true|false)"
    r"|-gencode=\S+|-arch=\S+|--generate-line-info|-res-usage|--resource-usage"
)
_KEYWORDS = frozenset(
    str.split(
        """
    if for while switch return sizeof alignof static_cast reinterpret_cast const_cast
    dynamic_cast catch throw noexcept new delete do else case default
    """
    )
)
_IDENT = re.compile(r"[A-Za-z_]\w*")
_SCALAR = (
    r"(?:unsigned\s+|signed\s+)?(?:int|long|long\s+long|short|char|float|double|bool|size_t"
    r"|u?int(?:8|16|32|64)_t|unsigned)"
)
_CONSTANT = re.compile(
    rf"(?:static\s+)?(?:constexpr|const)\s+(?:static\s+)?{_SCALAR}\s+([A-Za-z_]\w*)\s*=\s*"
    r"([^;{}=]*);",
    re.DOTALL,
)
_KERNEL = re.compile(r"(?:static\s+)?__global__\s+void\s+([A-Za-z_]\w*)\s*\((.*)\)", re.DOTALL)
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\([^()]*\)")
_DEFINE = re.compile(r"#\s*define\s+([A-Za-z_]\w*)(\()?")
_INCLUDE = re.compile(r"#\s*include\s*([<\"])([^>\"]+)[>\"]\s*$")
_LITERAL_VALUE = re.compile(r"[\s\w.+\-*/%()<>|&^~]*")
_DECLARATION = re.compile(r"[\w:<>,\s*&]+?[\s*&]([A-Za-z_]\w*)\s*\([^;{}]*\)\s*;", re.DOTALL)


@dataclass
class _Item:
    """One top-level item of the source: where it goes (``host``, ``device``, ``both``),
    its text, and the name it defines (a function, variable, struct or macro)."""

    side: str
    text: str
    name: str = ""
    kind: str = ""


@dataclass(frozen=True)
class Split:
    """A call's sources split: the host part for ``cpp_sources``, the device part (with
    the launchers) for ``cuda_sources``, and the kernels launched."""

    host: str
    device: str
    kernels: tuple[str, ...] = field(default=())

    def arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """``arguments`` with the sources split (the host part after ``cpp_sources``)."""
        cpp = arguments.get("cpp_sources")
        cpp_list = [cpp] if isinstance(cpp, str) else list(cpp or [])
        return {**arguments, "cpp_sources": [*cpp_list, self.host], "cuda_sources": self.device}


class _Refused(Exception):
    """Why a source is not split (one line)."""


def _top_level(text: str, masked: str) -> list[tuple[str, str, str]]:
    """The top-level items of ``text``: (``directive`` or ``code``, its text, its masked
    text); a code item's braces and parentheses balanced."""
    items: list[tuple[str, str, str]] = []
    i, n = 0, len(masked)
    while i < n:
        while i < n and masked[i].isspace():
            i += 1
        if i >= n:
            break
        start = i
        if masked[i] == "#":
            while i < n and masked[i] != "\n":
                i += 2 if masked.startswith("\\\n", i) else 1
            items.append(("directive", text[start:i], masked[start:i]))
            continue
        depth, header_end = 0, -1
        while i < n:
            char = masked[i]
            if char in "([{":
                if char == "{" and depth == 0:
                    header_end = i
                depth += 1
            elif char in ")]}":
                depth -= 1
                if depth < 0:
                    raise _Refused("unbalanced brackets")
                if char == "}" and depth == 0:
                    header = masked[start:header_end].rstrip()
                    if header.endswith((")", "const")):
                        i += 1
                        break
            elif char == ";" and depth == 0:
                i += 1
                break
            i += 1
        else:
            if masked[start:].strip():
                raise _Refused("the source ends inside an item (a missing ; or brace)")
        items.append(("code", text[start:i], masked[start:i]))
    return items


def _words(masked: str) -> set[str]:
    return set(_IDENT.findall(masked))


def _classify_directive(text: str, masked: str, seen_code: bool) -> _Item:
    if "\\\n" in masked and not masked.lstrip().startswith("#define"):
        raise _Refused("a continued directive")
    include = _INCLUDE.match(masked.strip()) and _INCLUDE.match(text.strip())
    if include:
        if seen_code:
            raise _Refused("an #include after code")
        name = include.group(2).strip()
        if _TORCH_INCLUDE.search(text):
            return _Item("host", text, kind="include")
        if include.group(1) == "<" and name in _BOTH:
            return _Item("both", text, kind="include")
        if include.group(1) == "<" and _DEVICE_ONLY.fullmatch(name):
            return _Item("device", text, kind="include")
        raise _Refused(f"#include {include.group(1)}{name}: a header not known here")
    define = _DEFINE.match(masked.strip())
    if define:
        value = masked.strip()[define.end() :]
        if define.group(2) is None and _LITERAL_VALUE.fullmatch(value):
            return _Item("both", text, define.group(1), kind="macro")
        return _Item("either", text, define.group(1), kind="macro")
    raise _Refused(f"the directive {masked.strip().split()[0]}")


def _classify_code(text: str, masked: str) -> _Item:
    """Where a top-level code item goes, and the name it defines."""
    head = masked.split("{", 1)[0]
    head_words = _words(head)
    struct = re.match(r"\s*struct\s+([A-Za-z_]\w*)", masked)
    refused = (head_words if struct is None else _words(masked)) & _REFUSED_WORDS
    if refused:  # a function's body is its own (the same code in either build)
        raise _Refused(f"a top-level {sorted(refused)[0]}")
    if "__global__" in head_words:
        kernel = _KERNEL.fullmatch(_LAUNCH_BOUNDS.sub(" ", head).strip().rstrip(";").strip())
        if kernel is None:
            raise _Refused("a kernel not of the form __global__ void name(parameters)")
        kind = "kernel" if "{" in masked else "kernel-declaration"
        return _Item("device", text, kernel.group(1), kind=kind)
    if head_words & _DEVICE_QUALIFIERS:
        return _Item("device", text, _declared_name(head), kind="device")
    if struct:
        return _Item("device", text, struct.group(1), kind="struct")
    constant = _CONSTANT.fullmatch(masked.strip())
    if constant:
        if not _LITERAL_VALUE.fullmatch(constant.group(2)):
            raise _Refused(f"the constant {constant.group(1)}'s value")
        return _Item("both", text, constant.group(1), kind="constant")
    if "{" in masked and head.rstrip().endswith((")", "const")) and "=" not in head:
        return _Item("host", text, _declared_name(head), kind="function")
    declaration = _DECLARATION.fullmatch(masked.strip())
    if declaration and "=" not in masked:
        return _Item("host", text, declaration.group(1), kind="declaration")
    raise _Refused(f"a top-level item not recognised: {' '.join(masked.split())[:60]!r}")


def _declared_name(head: str) -> str:
    """The name a declaration's head declares: before its first parenthesis, else before
    its first ``[``, ``=`` or ``;``."""
    cut = re.split(r"[(\[=;]", head, maxsplit=1)[0]
    found: list[str] = _IDENT.findall(cut)
    if not found:
        raise _Refused("a declaration without a name")
    return found[-1]


@functools.cache
def cuda_only_names(cuda_home: str) -> frozenset[str]:
    """Every name CUDA's headers may declare, for nvcc's compiles only, as a function
    (read from the toolkit's ``crt/`` headers and its device function and intrinsic
    headers: any identifier before a parenthesis, more than it needs); empty where they
    are not found (then nothing is split)."""
    include = Path(cuda_home) / "include"
    files = [*include.glob("crt/*.h"), *include.glob("crt/*.hpp")]
    for pattern in ("*_functions.h", "*_functions.hpp", "*intrinsics.h", "*intrinsics.hpp"):
        files += [p for p in include.glob(pattern) if not p.name.startswith(("vector_", "driver_"))]
    names: set[str] = set()
    for path in files:
        try:
            names |= set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", path.read_text(errors="replace")))
        except OSError:
            continue
    return frozenset(names - _KEYWORDS)


def _cuda_home() -> str | None:
    try:
        import torch.utils.cpp_extension as ext

        home = getattr(ext, "CUDA_HOME", None)
    except ImportError:
        home = None
    home = home or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return str(home) if os.path.isdir(os.path.join(home, "include", "crt")) else None


def _parameters(kernel: str, text: str) -> tuple[str, list[str]]:
    """A kernel definition's parameter list (its text, comments dropped) and their names;
    refused unless each is a named parameter of an allowed type."""
    masked = launches.blank(text)
    found = re.search(rf"\b{kernel}\s*\(", masked)
    assert found is not None
    listed = masked[found.end() : _closing(masked, found.end() - 1)]
    names: list[str] = []
    if listed.strip() in ("", "void"):
        return "", names
    for parameter in listed.split(","):
        words = _IDENT.findall(parameter)
        rest = re.sub(r"[A-Za-z_]\w*|[\s*]", "", parameter)
        if rest or len(words) < 2 or not set(words[:-1]) <= _PARAMETER_WORDS:
            raise _Refused(f"kernel {kernel}'s parameter {' '.join(parameter.split())!r}")
        if words[-1] in _PARAMETER_WORDS:
            raise _Refused(f"kernel {kernel} has an unnamed parameter")
        names.append(words[-1])
    return " ".join(listed.split()), names


def _closing(masked: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(masked)):
        if masked[i] == "(":
            depth += 1
        elif masked[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise _Refused("a launch without its closing parenthesis")


_SIDE_EFFECT = re.compile(r"\+\+|--|(?<![=!<>+\-*/%&|^])=(?!=)|[+\-*/%&|^]=|<<=|>>=")


def _rewrite_launches(text: str, kernels: dict[str, str]) -> tuple[str, set[str]]:
    """``text`` (a host item) with each ``k<<<...>>>(...);`` rewritten as a call of its
    launcher; the kernels launched."""
    out, launched = text, set[str]()
    while True:
        masked = launches.blank(out)
        found = launches.LAUNCH.search(masked)
        if found is None:
            if "<<<" in masked:
                raise _Refused("a launch not of the form kernel<<<config>>>(arguments);")
            return out, launched
        name, config = found.group(1), found.group(2)
        before = masked[: found.start()].rstrip()
        if name not in kernels:
            raise _Refused(f"a launch of {name}, which is not a kernel of this source")
        if before.endswith(("::", ".", "->")):
            raise _Refused(f"a qualified launch of {name}")
        close = _closing(masked, found.end() - 1)
        after = masked[close + 1 :].lstrip()
        if not after.startswith(";"):
            raise _Refused(f"a launch of {name} that is not a statement")
        arguments = masked[found.end() : close]
        if "<" in config or ">" in config or _SIDE_EFFECT.search(config + " " + arguments):
            raise _Refused(f"a launch of {name} whose configuration or arguments it cannot read")
        parts = launches.split_top(config)
        if not 2 <= len(parts) <= 4 or not all(p.strip() for p in parts):
            raise _Refused(f"a launch of {name} with {len(parts)} configuration values")
        config_text = ", ".join(p.strip() for p in [*parts, *["0"] * (4 - len(parts))])
        args_text = out[found.end() : close]
        call = f"{LAUNCHER_PREFIX}{name}({config_text}{', ' if args_text.strip() else ''}"
        out = out[: found.start()] + call + args_text + out[close:]
        launched.add(name)


def _host_calls(masked: str) -> set[str]:
    """Names called unqualified in host code."""
    names = set()
    for found in re.finditer(r"([A-Za-z_]\w*)\s*\(", masked):
        before = masked[: found.start()].rstrip()
        if not before.endswith(("::", ".", "->")):
            names.add(found.group(1))
    return names - _KEYWORDS


def _check_call(arguments: dict[str, Any]) -> None:
    """Refuses a call whose flags or other sources the split does not account for."""
    for name in ("extra_cflags", "extra_include_paths", "extra_ldflags", "sycl_sources"):
        if arguments.get(name):
            raise _Refused(f"{name} given")
    if arguments.get("no_implicit_headers") or arguments.get("with_cuda") is False:
        raise _Refused("no_implicit_headers or with_cuda=False")
    flags = arguments.get("extra_cuda_cflags") or []
    for flag in [flags] if isinstance(flags, str) else flags:
        if not isinstance(flag, str) or not all(_CUDA_FLAG.fullmatch(w) for w in flag.split()):
            raise _Refused(f"extra_cuda_cflags {flag!r}")
    cpp = arguments.get("cpp_sources")
    for text in [cpp] if isinstance(cpp, str) else list(cpp or []):
        if not isinstance(text, str):
            raise _Refused("cpp_sources that are not strings")
        for kind, item, masked in _top_level(text, launches.blank(text)):
            if kind == "directive":
                include = _INCLUDE.match(masked.strip())
                if include is None or _classify_directive(item, masked, False).side == "device":
                    raise _Refused("cpp_sources hold more than includes and declarations")
            elif not _DECLARATION.fullmatch(masked.strip()) or "=" in masked:
                raise _Refused("cpp_sources hold more than includes and declarations")


def _texts(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and value and all(isinstance(t, str) for t in value):
        return "\n".join(value)
    raise _Refused("no CUDA sources")


def _split(arguments: dict[str, Any]) -> Split:
    source = _texts(arguments.get("cuda_sources"))
    if torchfree.why_not(source) is None:
        raise _Refused("the CUDA sources name nothing of torch (kf.cuda.torchfree builds them)")
    if re.search(r'\bR"', source):
        raise _Refused("a raw string literal")
    if LAUNCHER_PREFIX in source:
        raise _Refused(f"the source names {LAUNCHER_PREFIX}...")
    _check_call(arguments)
    items, seen_code = [], False
    for kind, text, masked in _top_level(source, launches.blank(source)):
        if kind == "directive":
            items.append(_classify_directive(text, masked, seen_code))
        else:
            seen_code = True
            items.append(_classify_code(text, masked))
    return _assemble(items)


def _place_macros(items: list[_Item]) -> None:
    """A function-like (or not literal) macro goes to the one side that names it."""
    for item in items:
        if item.side != "either":
            continue
        uses = {
            other.side
            for other in items
            if other is not item and item.name in _words(launches.blank(other.text))
        }
        if {"host", "device"} <= uses or "both" in uses:
            raise _Refused(f"the macro {item.name} is used by host and device code")
        item.side = "device" if uses == {"device"} else "host"


def _assemble(items: list[_Item]) -> Split:
    _place_macros(items)
    kernels: dict[str, str] = {}
    for item in items:
        if item.kind == "kernel":
            if item.name in kernels:
                raise _Refused(f"kernel {item.name} is defined twice (overloaded)")
            kernels[item.name] = item.text
    device_names = {item.name for item in items if item.side == "device" and item.name}
    host_names = {item.name for item in items if item.side == "host" and item.name}
    host_texts: list[tuple[_Item, str]] = []
    launched: set[str] = set()
    for item in items:
        if item.side not in ("host", "both"):
            continue
        text = item.text
        if item.kind == "function":
            text, used = _rewrite_launches(item.text, kernels)
            launched |= used
        host_texts.append((item, text))
    _check_host([h for h in host_texts if h[0].side == "host"], device_names, host_names)
    launchers, declarations = _launchers(sorted(launched), kernels)
    device = "\n".join([i.text for i in items if i.side in ("device", "both")] + launchers)
    why = torchfree.why_not(device)
    if why is not None:
        raise _Refused(f"the device part {why}")
    device_text = "\n".join(i.text for i in items if i.side == "device")
    if _words(launches.blank(device_text)) & host_names:
        raise _Refused("the device part names a host function")
    host = ["#include <cuda_runtime.h>"]
    for item, text in host_texts:
        if declarations and item.kind in ("function", "declaration"):
            host += declarations  # before the first host function (after includes, macros)
            declarations = []
        host.append(text)
    return Split(host="\n".join(host) + "\n", device=device + "\n", kernels=tuple(sorted(launched)))


def _check_host(
    host: list[tuple[_Item, str]], device_names: set[str], host_names: set[str]
) -> None:
    """Refuses host code that names the device part, CUDA's device words or a function
    whose overloads differ under nvcc, or that holds a directive."""
    home = _cuda_home()
    blocked = cuda_only_names(home) if home else frozenset()
    if not blocked:
        raise _Refused("CUDA's headers were not found (their device-only names unknown)")
    for item, text in host:
        if item.kind == "include":
            continue
        masked = launches.blank(text)
        if item.kind == "function" and re.search(r"^[ \t]*#", masked, re.MULTILINE):
            raise _Refused(f"a directive inside {item.name}")
        words = _words(masked)
        named = (words & device_names) | (words & _DEVICE_WORDS)
        if named:
            raise _Refused(f"host code names {sorted(named)[0]}")
        calls = (_host_calls(masked) & blocked) - host_names
        if calls:
            raise _Refused(f"host code calls {sorted(calls)[0]} unqualified")


def _launchers(launched: list[str], kernels: dict[str, str]) -> tuple[list[str], list[str]]:
    """Each launched kernel's launcher (for the device part) and its declaration."""
    definitions, declarations = [], []
    for name in launched:
        parameters, names = _parameters(name, kernels[name])
        head = (
            f"void {LAUNCHER_PREFIX}{name}(dim3 kf_grid_, dim3 kf_block_, size_t kf_shared_, "
            f"cudaStream_t kf_stream_{', ' if parameters else ''}{parameters})"
        )
        call = f"{name}<<<kf_grid_, kf_block_, kf_shared_, kf_stream_>>>({', '.join(names)});"
        definitions.append(f"{head} {{\n    {call}\n}}")
        declarations.append(f"{head};")
    return definitions, declarations


def why_not(arguments: dict[str, Any]) -> str | None:
    """Why this ``load_inline`` call (its arguments by name) is not split (None: it is)."""
    try:
        _split(arguments)
    except _Refused as exc:
        return str(exc)
    return None


def split(arguments: dict[str, Any]) -> Split | None:
    """The call's sources split (:class:`Split`), or None where :func:`why_not` refuses."""
    try:
        return _split(arguments)
    except _Refused:
        return None
