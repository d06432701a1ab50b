"""Template parameters: a kernel's declared parameter space and its chosen configuration.

A candidate module may declare, between two marker comments, the space of its template
parameters and the configuration it currently uses::

    # --- kf:params ---
    SPACE = {"BLOCK": [256, 512, 1024], "UNROLL": [1, 2, 4, 8], "SCHEDULE": ["static", "dynamic"]}
    CONFIG = {"BLOCK": 512, "UNROLL": 4, "SCHEDULE": "static"}
    # --- kf:end ---

Both are Python literals, read with :func:`ast.literal_eval` (the module is never
executed). Values are ``int``, ``float`` (finite), ``str`` or ``bool``; each ``SPACE``
entry is a non-empty list without duplicates, keyed by a C identifier (the module
usually passes ``CONFIG`` to :func:`kf.native.build` as ``-D`` defines); ``CONFIG``
holds exactly ``SPACE``'s keys, each with one of its values. Values compare by type as
well as value, so ``True`` is not ``1`` and ``1.0`` is not ``1``.

Besides the two assignments the block may hold only comments and blank lines. The
``CONFIG`` statement must sit on lines of its own: :func:`apply` rewrites those lines.

Search operators (:func:`neighbours`, :func:`mutate`, :func:`crossover`, :func:`grid`)
are deterministic: they walk parameters in ``SPACE`` order and draw randomness only from
the :class:`random.Random` the caller passes in.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import math
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import msgspec

__all__ = [
    "Config",
    "Param",
    "ParamSpace",
    "ParamsError",
    "Value",
    "apply",
    "config_key",
    "crossover",
    "family",
    "grid",
    "mutate",
    "neighbours",
    "parse",
    "size",
    "validate",
]

Value = int | float | str | bool
Config = dict[str, Value]

_START = re.compile(r"^[ \t]*#[ \t]*---[ \t]*kf:params[ \t]*---[ \t]*$")
_END = re.compile(r"^[ \t]*#[ \t]*---[ \t]*kf:end[ \t]*---[ \t]*$")
_CONFIG_PLACEHOLDER = "<kf:config>"


class ParamsError(ValueError):
    """A parameter block, space or configuration is malformed; the message says where."""


class Param(msgspec.Struct, frozen=True):
    """One template parameter: its name and its choices, in the order they were written."""

    name: str
    choices: tuple[Value, ...]


class ParamSpace(msgspec.Struct, frozen=True):
    """A kernel's parameter space: parameters in the order ``SPACE`` lists them."""

    params: tuple[Param, ...]

    @classmethod
    def from_dict(cls, space: Mapping[str, Sequence[Value]]) -> ParamSpace:
        """Build and validate a space from ``{name: [choice, ...]}``."""
        if not isinstance(space, Mapping):
            raise ParamsError(f"SPACE must be a dict of name -> list, got {type(space).__name__}")
        params = []
        for name, choices in space.items():
            _check_name(name, "SPACE")
            if not isinstance(choices, list | tuple) or not choices:
                raise ParamsError(
                    f"SPACE[{name!r}] must be a non-empty list of values, got {choices!r}"
                )
            seen: list[Value] = []
            for value in choices:
                _check_value(value, f"SPACE[{name!r}]")
                if any(_same(value, other) for other in seen):
                    raise ParamsError(f"SPACE[{name!r}] lists {value!r} twice; remove the repeat")
                seen.append(value)
            params.append(Param(name, tuple(choices)))
        return cls(tuple(params))

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in ``SPACE`` order."""
        return tuple(p.name for p in self.params)

    def choices(self, name: str) -> tuple[Value, ...]:
        """The choices of parameter ``name``; raises :class:`ParamsError` if there is none."""
        for param in self.params:
            if param.name == name:
                return param.choices
        raise ParamsError(f"no parameter {name!r} in the space (known: {list(self.names)})")

    def as_dict(self) -> dict[str, list[Value]]:
        """The space as the ``SPACE`` literal would write it."""
        return {p.name: list(p.choices) for p in self.params}


# --------------------------------------------------------------------------- validation


def _same(a: Value, b: Value) -> bool:
    return type(a) is type(b) and a == b


def _index(choices: Sequence[Value], value: Value) -> int:
    for i, choice in enumerate(choices):
        if _same(choice, value):
            return i
    return -1


def _check_name(name: object, where: str) -> None:
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        raise ParamsError(
            f"{where} key {name!r} is not a valid identifier; "
            "parameter names become -D defines, so use letters, digits and _"
        )


def _check_value(value: object, where: str) -> None:
    if not isinstance(value, int | float | str | bool):
        raise ParamsError(
            f"{where} value {value!r} has type {type(value).__name__}; "
            "use an int, float, str or bool"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ParamsError(f"{where} value {value!r} is not finite; use a finite float")


def validate(space: ParamSpace, config: Mapping[str, object]) -> Config:
    """``config`` checked against ``space`` and returned with keys in ``SPACE`` order.

    Raises :class:`ParamsError` naming the missing, unknown or out-of-space key.
    """
    if not isinstance(config, Mapping):
        raise ParamsError(f"CONFIG must be a dict, got {type(config).__name__}")
    missing = [n for n in space.names if n not in config]
    if missing:
        raise ParamsError(f"CONFIG lacks {missing}; give every SPACE key a value")
    unknown = sorted(repr(k) for k in config if k not in space.names)
    if unknown:
        raise ParamsError(f"CONFIG has keys {unknown} that SPACE does not declare")
    checked: Config = {}
    for param in space.params:
        value = config[param.name]
        if _index(param.choices, value) < 0:  # type: ignore[arg-type]
            raise ParamsError(
                f"CONFIG[{param.name!r}] = {value!r} is not one of {list(param.choices)}"
            )
        checked[param.name] = value  # type: ignore[assignment]
    return checked


# --------------------------------------------------------------------------- the block


@dataclass(frozen=True)
class _Block:
    space_node: ast.expr
    space_line: int  # 1-based line of SPACE in the source
    config_node: ast.expr
    config_line: int
    config_first: int  # 0-based index of the CONFIG statement's first line in the source
    config_last: int  # 0-based index of its last line (inclusive)
    config_prefix: str  # the text before the value on its first line: indent + "CONFIG = "


def _find_block(lines: Sequence[str]) -> tuple[int, int] | None:
    """0-based indices of the start and end marker lines, or None when there is no block."""
    starts = [i for i, line in enumerate(lines) if _START.match(line.rstrip("\r\n"))]
    if not starts:
        return None
    if len(starts) > 1:
        raise ParamsError(
            f"more than one '# --- kf:params ---' marker (lines {[s + 1 for s in starts]}); "
            "keep one block"
        )
    start = starts[0]
    for i in range(start + 1, len(lines)):
        if _END.match(lines[i].rstrip("\r\n")):
            return start, i
    raise ParamsError(
        f"'# --- kf:params ---' on line {start + 1} has no '# --- kf:end ---' after it"
    )


def _margin(lines: Sequence[str]) -> str:
    """The leading whitespace common to every non-blank line."""
    indents = [re.match(r"[ \t]*", ln).group(0) for ln in lines if ln.strip()]  # type: ignore[union-attr]
    if not indents:
        return ""
    margin = indents[0]
    for indent in indents[1:]:
        while not indent.startswith(margin):
            margin = margin[:-1]
    return margin


def _read_block(source: str) -> _Block | None:
    lines = source.splitlines(keepends=True)
    found = _find_block(lines)
    if found is None:
        return None
    start, end = found
    body = lines[start + 1 : end]
    margin = _margin(body)
    text = "".join(ln[len(margin) :] if ln.strip() else "\n" for ln in body)
    offset = start + 1  # source line index of the block's first body line
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        line = (exc.lineno or 1) + offset
        raise ParamsError(f"kf:params block does not parse at line {line}: {exc.msg}") from exc
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        raise ParamsError(f"kf:params block at line {start + 1} does not parse: {exc}") from exc
    nodes: dict[str, ast.Assign | ast.AnnAssign] = {}
    for stmt in tree.body:
        target: ast.expr | None = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            target = stmt.target
        name = target.id if isinstance(target, ast.Name) else None
        if name not in ("SPACE", "CONFIG") or not isinstance(stmt, ast.Assign | ast.AnnAssign):
            raise ParamsError(
                f"line {stmt.lineno + offset}: a kf:params block holds only "
                "'SPACE = {...}' and 'CONFIG = {...}'"
            )
        assert name is not None
        if name in nodes:
            raise ParamsError(f"line {stmt.lineno + offset}: {name} is assigned twice in the block")
        nodes[name] = stmt
    for name in ("SPACE", "CONFIG"):
        if name not in nodes:
            raise ParamsError(f"kf:params block at line {start + 1} has no {name} assignment")
    space_stmt, config_stmt = nodes["SPACE"], nodes["CONFIG"]
    assert space_stmt.value is not None
    assert config_stmt.value is not None
    body_lines = text.splitlines(keepends=True)
    first = config_stmt.lineno - 1
    last = (config_stmt.end_lineno or config_stmt.lineno) - 1
    first_line = body_lines[first].encode()
    last_line = body_lines[last].encode()
    before = first_line[: config_stmt.col_offset].decode()
    after = last_line[config_stmt.end_col_offset or 0 :].decode().strip()
    if before.strip() or (after and not after.startswith("#")):
        raise ParamsError(
            f"line {config_stmt.lineno + offset}: put the CONFIG assignment on lines of its own"
        )
    annotation = (
        f": {ast.unparse(config_stmt.annotation)}" if isinstance(config_stmt, ast.AnnAssign) else ""
    )
    prefix = f"{margin}CONFIG{annotation} = "
    return _Block(
        space_node=space_stmt.value,
        space_line=space_stmt.lineno + offset,
        config_node=config_stmt.value,
        config_line=config_stmt.lineno + offset,
        config_first=first + offset,
        config_last=last + offset,
        config_prefix=prefix,
    )


def _literal(node: ast.expr, name: str, line: int) -> object:
    if isinstance(node, ast.Dict):
        keys = [ast.literal_eval(k) for k in node.keys if isinstance(k, ast.Constant)]
        repeated = sorted({repr(k) for k in keys if keys.count(k) > 1})
        if repeated:
            raise ParamsError(f"line {line}: {name} repeats keys {repeated}")
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ParamsError(f"line {line}: {name} must be a plain Python literal ({exc})") from exc


def parse(source: str) -> tuple[ParamSpace, Config] | None:
    """The declared space and configuration of ``source``, or None when it has no block.

    Raises :class:`ParamsError` when the block is malformed or ``CONFIG`` is not in
    ``SPACE``.
    """
    block = _read_block(source)
    if block is None:
        return None
    raw_space = _literal(block.space_node, "SPACE", block.space_line)
    raw_config = _literal(block.config_node, "CONFIG", block.config_line)
    try:
        space = ParamSpace.from_dict(raw_space)  # type: ignore[arg-type]
    except ParamsError as exc:
        raise ParamsError(f"line {block.space_line}: {exc}") from None
    try:
        config = validate(space, raw_config)  # type: ignore[arg-type]
    except ParamsError as exc:
        raise ParamsError(f"line {block.config_line}: {exc}") from None
    return space, config


def _canonical(config: Mapping[str, Value]) -> str:
    return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in config.items()) + "}"


def _replace_config(source: str, block: _Block, value_text: str) -> str:
    lines = source.splitlines(keepends=True)
    last = lines[block.config_last]
    ending = last[len(last.rstrip("\r\n")) :] or "\n"
    new_line = f"{block.config_prefix}{value_text}{ending}"
    return "".join([*lines[: block.config_first], new_line, *lines[block.config_last + 1 :]])


def apply(source: str, config: Mapping[str, object]) -> str:
    """``source`` with its ``CONFIG`` rewritten to ``config``, canonically, on one line.

    Keys come in ``SPACE`` order and values as ``repr`` writes them; nothing else in the
    source changes. Raises :class:`ParamsError` when ``source`` has no block or
    ``config`` is not in its space.
    """
    parsed = parse(source)
    if parsed is None:
        raise ParamsError("source has no '# --- kf:params ---' block to apply a config to")
    space, _ = parsed
    checked = validate(space, config)
    block = _read_block(source)
    assert block is not None
    return _replace_config(source, block, _canonical(checked))


def family(source: str) -> str:
    """SHA-256 hex of ``source`` with its ``CONFIG`` value blanked out.

    Candidates that differ only in ``CONFIG`` (value or layout) share a family. A source
    without a block, or whose block cannot be read, hashes as it is.
    """
    try:
        block = _read_block(source)
    except ParamsError:
        block = None
    text = source if block is None else _replace_config(source, block, _CONFIG_PLACEHOLDER)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# --------------------------------------------------------------------------- operators


def size(space: ParamSpace) -> int:
    """The number of configurations in ``space``."""
    return math.prod(len(p.choices) for p in space.params)


def grid(space: ParamSpace) -> Iterator[Config]:
    """Every configuration, in ``SPACE`` order with the last parameter varying fastest."""
    names = space.names
    for values in itertools.product(*(p.choices for p in space.params)):
        yield dict(zip(names, values, strict=True))


def neighbours(space: ParamSpace, config: Mapping[str, object]) -> list[Config]:
    """Configurations one step away in one parameter's list order (previous, then next)."""
    base = validate(space, config)
    found: list[Config] = []
    for param in space.params:
        i = _index(param.choices, base[param.name])
        for j in (i - 1, i + 1):
            if 0 <= j < len(param.choices):
                found.append({**base, param.name: param.choices[j]})
    return found


def mutate(
    space: ParamSpace, config: Mapping[str, object], rng: random.Random, n_changes: int = 1
) -> Config:
    """``config`` with ``n_changes`` parameters (fewer if fewer can vary) set to other values.

    Always differs from ``config`` when the space has more than one point.
    """
    if n_changes < 1:
        raise ValueError(f"n_changes must be at least 1, got {n_changes}")
    result = validate(space, config)
    variable = [p for p in space.params if len(p.choices) > 1]
    for param in rng.sample(variable, min(n_changes, len(variable))):
        current = _index(param.choices, result[param.name])
        pick = rng.randrange(len(param.choices) - 1)
        result[param.name] = param.choices[pick if pick < current else pick + 1]
    return result


def crossover(
    space: ParamSpace, a: Mapping[str, object], b: Mapping[str, object], rng: random.Random
) -> Config:
    """Uniform crossover: each parameter's value from ``a`` or ``b`` with equal odds."""
    left, right = validate(space, a), validate(space, b)
    return {n: (left[n] if rng.random() < 0.5 else right[n]) for n in space.names}


def config_key(config: Mapping[str, Value]) -> str:
    """A canonical string for ``config``: ``NAME=repr`` pairs sorted by name, comma-joined."""
    return ",".join(f"{name}={config[name]!r}" for name in sorted(config))
