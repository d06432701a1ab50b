"""``kf run --config FILE``: kf run's options from a TOML file (examples/run.toml).

Each key is a flag of ``kf run`` without its dashes (``budget = 8``, ``max-in-flight = 4``;
``max_in_flight`` is the same key), at the top level, with the value the flag takes: a
number for ``--budget``, ``true`` for a switch such as ``--resume``, a list for a
repeatable flag such as ``--trust`` or one of two values (``--llm-usd-per-mtok``). The
task path stays on the command line. The file's values become the parser's defaults,
so what the command line gives wins (a repeatable flag's list replaces the file's), the
file wins over kf run's own defaults, and what the run used is what ``run.started``
records (:class:`kf.config.RunConfig`), as for flags.

A file kf run cannot take is refused whole, before anything starts, in one line that
names the file and the key (:class:`ConfigFileError`): a missing or unreadable file,
text that is not TOML, a key that is no flag, a table, a value of another type, a value
that is not one of the flag's choices, a key given twice.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ConfigFileError", "apply_file", "file_defaults"]

#: flags a file does not give: the file itself, and help
_NOT_IN_FILE = frozenset({"config", "help"})


class ConfigFileError(ValueError):
    """A run file kf run cannot take; the message is one line naming the file."""


def apply_file(
    make_parser: Callable[[], argparse.ArgumentParser],
    verb: str,
    argv: Sequence[str],
    args: argparse.Namespace,
) -> argparse.Namespace:
    """``args`` (``argv`` parsed) with ``args.config``'s values under the command line's:
    ``argv`` parsed again by a fresh parser whose ``verb`` takes the file's values as its
    defaults. Raises :class:`ConfigFileError`."""
    parser = make_parser()
    sub = _verb_parser(parser, verb)
    defaults = file_defaults(sub, Path(args.config))
    # a repeatable flag's list, as the command line gave it (its default: none given)
    repeated = {a.dest: a.default for a in sub._actions if isinstance(a, argparse._AppendAction)}
    sub.set_defaults(**defaults)
    merged = parser.parse_args(argv)
    for dest, default in repeated.items():  # given on the command line: its list alone
        given = getattr(args, dest, None)
        if given != default:
            setattr(merged, dest, given)
    return merged


def file_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The file's options as ``parser``'s defaults (flag destination → value), each
    checked against its flag. Raises :class:`ConfigFileError`."""
    table = _read(path)
    flags = _flags(parser)
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("_", "-")
        action = flags.get(name)
        if action is None:
            close = difflib.get_close_matches(name, flags, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            if isinstance(value, dict):
                raise ConfigFileError(
                    f"{path}: {key}: a table, where keys are kf run's flags at the top level "
                    "(budget = 8, not [search] budget = 8)"
                )
            raise ConfigFileError(
                f"{path}: unknown key {key!r}{hint}; the keys are kf run's flags without "
                "their dashes (kf run --help)"
            )
        if action.dest in out:
            raise ConfigFileError(f"{path}: {key}: given twice (as {name} and with _ or -)")
        out[action.dest] = _value(path, key, action, value)
    return out


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes().decode()
    except FileNotFoundError:
        raise ConfigFileError(f"{path}: no such file (--config names a TOML file)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{path}: cannot be read: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path}: not TOML: {exc}") from None


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``parser``'s long flags a file may give, by name without dashes."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for option in action.option_strings:
            name = option.lstrip("-")
            if option.startswith("--") and name not in _NOT_IN_FILE:
                out[name] = action
    return out


def _value(path: Path, key: str, action: argparse.Action, value: Any) -> Any:
    """``value`` as ``action``'s flag would have made it (ConfigFileError if it is not
    one it takes)."""
    flag = action.option_strings[-1]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise _wrong(path, key, flag, value, "true or false")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._AppendAction) or action.nargs not in (None, "?"):
        count = action.nargs if isinstance(action.nargs, int) else None
        want = f"a list of {count} {_kind(action)}s" if count else f"a list of {_kind(action)}s"
        if not isinstance(value, list) or (count is not None and len(value) != count):
            raise _wrong(path, key, flag, value, want)
        return [_one(path, key, flag, action, v, want) for v in value]
    return _one(path, key, flag, action, value, _kind(action))


def _one(path: Path, key: str, flag: str, action: argparse.Action, value: Any, want: str) -> Any:
    """One value of ``action``'s type (an int for an int flag, a number for a float one,
    else a string, converted as the flag converts it) and among its choices."""
    kind = action.type
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise _wrong(path, key, flag, value, want)
    if callable(kind):
        try:
            value = kind(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise ConfigFileError(f"{path}: {key}: {value!r}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        raise ConfigFileError(f"{path}: {key}: {value!r} is not one of {choices}")
    return value


def _kind(action: argparse.Action) -> str:
    """What one value of ``action``'s flag is, in words."""
    if action.type is int:
        return "whole number"
    if action.type is float:
        return "number"
    return "string"


_TOML_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _wrong(path: Path, key: str, flag: str, value: Any, want: str) -> ConfigFileError:
    got = _TOML_KINDS.get(type(value), "a list" if isinstance(value, list) else "a table")
    article = "" if want.startswith(("a ", "an ", "true")) else "a "
    return ConfigFileError(f"{path}: {key}: {got}, where {flag} takes {article}{want}")


def _verb_parser(parser: argparse.ArgumentParser, verb: str) -> argparse.ArgumentParser:
    """``parser``'s sub-parser for ``verb``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[verb]
            return found
    raise LookupError(verb)
