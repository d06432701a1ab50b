"""schemas/ is generated from the code and must not be stale."""

from __future__ import annotations

from kf.schemas import generate, schema_dir


def test_schemas_are_up_to_date() -> None:
    """Every generated schema file matches schemas/ (run `python -m kf.schemas` to refresh)."""
    folder = schema_dir()
    generated = generate()
    stale = [
        name
        for name, text in generated.items()
        if not (folder / name).exists() or (folder / name).read_text() != text
    ]
    assert not stale, f"stale schemas (run `python -m kf.schemas`): {stale}"
    assert "envelope.json" in generated
    assert any(name.startswith("run.started.") for name in generated)
