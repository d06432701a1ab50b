"""Machine-readable schemas of every event, generated from the code into ``schemas/``.

``python -m kf.schemas`` rewrites the files; a test fails when they are stale. Files for
older schema versions are never deleted: old events stay readable forever.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from kf.events import BUILTIN_EVENT_MODULES, Envelope, registry

__all__ = ["EVENT_MODULES", "generate", "schema_dir", "write"]

# Modules that define kf's own event types (plugins' events are their own business).
EVENT_MODULES = BUILTIN_EVENT_MODULES


def schema_dir() -> Path:
    """The repository's ``schemas/`` folder."""
    return Path(__file__).resolve().parent.parent / "schemas"


def generate() -> dict[str, str]:
    """File name → JSON text for the envelope and every registered kf event type."""
    for mod in EVENT_MODULES:
        importlib.import_module(mod)
    out: dict[str, str] = {"envelope.json": _dump(msgspec.json.schema(Envelope))}
    for tag, cls in registry().items():
        if not cls.__module__.startswith("kf."):
            continue
        schema: dict[str, Any] = msgspec.json.schema(cls)
        schema["x-kf"] = {
            "tag": tag,
            "version": cls.version,
            "kind": "decision" if _is_decision(cls) else "observation",
            "class": f"{cls.__module__}.{cls.__qualname__}",
        }
        out[f"{tag}.v{cls.version}.json"] = _dump(schema)
    return out


def _is_decision(cls: type) -> bool:
    from kf.events import Decision

    return issubclass(cls, Decision)


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def write(folder: Path | None = None) -> list[Path]:
    """Write the generated schemas; return the files that changed."""
    folder = folder or schema_dir()
    folder.mkdir(parents=True, exist_ok=True)
    changed: list[Path] = []
    for name, text in generate().items():
        path = folder / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


if __name__ == "__main__":
    for p in write():
        print(f"wrote {p}", file=sys.stderr)
