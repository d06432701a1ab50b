"""Reading the code out of compiled objects, for tests that two builds compile the same:
an x86-64 object's functions (bytes and relocation targets) and, from the cubins nvcc
embeds in its ``.nv_fatbin`` section, each kernel's SASS and resources. Plain ELF64
parsing, so no CUDA binary utilities (cuobjdump) are needed."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

_SYMTAB, _RELA, _NOBITS = 2, 4, 8
_FUNC, _SECTION = 2, 3
#: .nv.info attributes whose value starts with a symbol index (REGCOUNT, FRAME_SIZE,
#: MIN_STACK_SIZE, MAX_STACK_SIZE, PARAM_CBANK)
_SYMBOL_ATTRS = frozenset({0x2F, 0x11, 0x12, 0x23, 0x0A})
#: the per-file part of nvcc's names for internal entities
_INTERNAL = re.compile(r"_INTERNAL_[0-9a-f]+_\d+_\w+?_[0-9a-f]{8,}")


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    link: int
    info: int
    data: bytes


@dataclass(frozen=True)
class Symbol:
    name: str
    kind: int
    section: int
    value: int
    size: int


def sections(data: bytes) -> list[Section]:
    """The sections of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * entsize) for i in range(count)]
    names = data[raw[names_index][4] : raw[names_index][4] + raw[names_index][5]]
    out = []
    for name_at, kind, _flags, _addr, offset, size, link, info, _align, _entsize in raw:
        name = names[name_at : names.index(b"\0", name_at)].decode()
        body = b"" if kind == _NOBITS else data[offset : offset + size]
        out.append(Section(name, kind, link, info, body))
    return out


def symbols(secs: list[Section]) -> list[Symbol]:
    """The symbol table; a section's symbol is named ``[<section name>]``."""
    table = next(s for s in secs if s.type == _SYMTAB)
    strings = secs[table.link].data
    out = []
    for i in range(len(table.data) // 24):
        name_at, info, _other, shndx, value, size = struct.unpack_from(
            "<IBBHQQ", table.data, i * 24
        )
        name = strings[name_at : strings.index(b"\0", name_at)].decode()
        if not name and info & 0xF == _SECTION and shndx < len(secs):
            name = f"[{secs[shndx].name}]"
        out.append(Symbol(name, info & 0xF, shndx, value, size))
    return out


def _name(symbol: Symbol) -> str:
    return _INTERNAL.sub("_INTERNAL_", symbol.name)


def _relocations(
    secs: list[Section], syms: list[Symbol], target: int
) -> list[tuple[int, int, Symbol, int]]:
    out = []
    for sec in secs:
        if sec.type == _RELA and sec.info == target:
            for i in range(len(sec.data) // 24):
                offset, info, addend = struct.unpack_from("<QQq", sec.data, i * 24)
                out.append((offset, info & 0xFFFFFFFF, syms[info >> 32], addend))
    return out


def functions(data: bytes) -> dict[str, tuple[bytes, tuple[Any, ...]]]:
    """An x86-64 object's functions: name → (bytes, relocations), each relocation as
    (offset in the function, type, target), a target in a data section given by the 16
    bytes it points at (a constant's value, not its place)."""
    secs = sections(data)
    syms = symbols(secs)
    out: dict[str, tuple[bytes, tuple[Any, ...]]] = {}
    for sym in syms:
        if sym.kind != _FUNC or not 0 < sym.section < len(secs):
            continue
        code = secs[sym.section].data[sym.value : sym.value + sym.size]
        relocs = []
        for offset, kind, target, addend in _relocations(secs, syms, sym.section):
            if not sym.value <= offset < sym.value + sym.size:
                continue
            where: Any = _name(target)
            if target.kind == _SECTION and not secs[target.section].name.startswith(".text"):
                at = target.value + addend + 4  # a constant's value, not its place
                width = _operand_width(secs[sym.section].data, offset)
                where = (where, secs[target.section].data[max(0, at) : at + width].hex())
                relocs.append((offset - sym.value, kind, where, 0))
            else:
                relocs.append((offset - sym.value, kind, where, addend))
        out[_name(sym)] = (code, tuple(relocs))
    return out


def _operand_width(code: bytes, displacement: int) -> int:
    """How many bytes an SSE instruction whose RIP-relative displacement starts at
    ``displacement`` reads: 4 after an ``F3`` prefix (``movss``), 8 after ``F2``
    (``movsd``), else 16 (packed)."""
    for back in range(2, 7):
        at = displacement - back
        if at >= 1 and code[at] == 0x0F:
            prefix = code[at - 1]
            if 0x40 <= prefix <= 0x4F and at >= 2:  # a REX prefix before the opcode
                prefix = code[at - 2]
            return {0xF3: 4, 0xF2: 8}.get(prefix, 16)
    return 16


def cubins(data: bytes) -> list[bytes]:
    """The ELF images (cubins) in an object's ``.nv_fatbin`` section (uncompressed)."""
    fatbin = next((s.data for s in sections(data) if s.name == ".nv_fatbin"), b"")
    out = []
    at = fatbin.find(b"\x7fELF")
    while at >= 0:
        (shoff,) = struct.unpack_from("<Q", fatbin, at + 0x28)
        entsize, count = struct.unpack_from("<HH", fatbin, at + 0x3A)
        end = at + shoff + entsize * count
        out.append(fatbin[at:end])
        at = fatbin.find(b"\x7fELF", end)
    return out


def _info_records(body: bytes) -> list[tuple[int, int, bytes]]:
    out = []
    i = 0
    while i + 2 <= len(body):
        fmt, attr = body[i], body[i + 1]
        if fmt == 4:  # a value with its size
            (size,) = struct.unpack_from("<H", body, i + 2)
            out.append((fmt, attr, body[i + 4 : i + 4 + size]))
            i += 4 + size
        elif fmt == 3:  # a 16-bit value
            out.append((fmt, attr, body[i + 2 : i + 4]))
            i += 4
        else:
            out.append((fmt, attr, b""))
            i += 2
    return out


def _named_info(body: bytes, syms: list[Symbol]) -> list[Any]:
    """.nv.info records with symbol indices replaced by the symbols' names."""
    out: list[Any] = []
    for fmt, attr, value in _info_records(body):
        if attr in _SYMBOL_ATTRS and len(value) >= 4:
            (index,) = struct.unpack_from("<I", value)
            out.append((fmt, attr, _name(syms[index]), value[4:].hex()))
        else:
            out.append((fmt, attr, value.hex()))
    return out


def kernels(cubin: bytes) -> dict[str, dict[str, Any]]:
    """Each kernel (``.text.<name>``) of a cubin: its SASS bytes, its relocations, its
    parameter bank, its attributes (``.nv.info.<name>``) and the resources the module's
    ``.nv.info`` gives it (registers, stack), with symbol indices named."""
    secs = sections(cubin)
    syms = symbols(secs)
    by_name = {s.name: (i, s) for i, s in enumerate(secs)}
    module_info = _named_info(by_name[".nv.info"][1].data, syms) if ".nv.info" in by_name else []
    out: dict[str, dict[str, Any]] = {}
    for index, sec in enumerate(secs):
        if not sec.name.startswith(".text."):
            continue
        kernel = sec.name[len(".text.") :]
        relocs = [
            (offset, kind, _name(target), addend)
            for offset, kind, target, addend in _relocations(secs, syms, index)
        ]
        own = f".nv.info.{kernel}"
        out[_INTERNAL.sub("_INTERNAL_", kernel)] = {
            "sass": sec.data,
            "relocations": relocs,
            "constant0": by_name[f".nv.constant0.{kernel}"][1].data
            if f".nv.constant0.{kernel}" in by_name
            else b"",
            "info": _named_info(by_name[own][1].data, syms) if own in by_name else [],
            "resources": [r for r in module_info if len(r) == 4 and r[2] == kernel],
        }
    return out
