"""Template parameters: parsing the kf:params block, rewriting CONFIG, and search operators."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kf.kernels import params
from kf.kernels.params import ParamsError, ParamSpace

EXAMPLE = '''\
import torch

SRC = r"""
extern "C" void k(const float* x, float* y, long n) { /* uses BLOCK, UNROLL */ }
"""

# --- kf:params ---
SPACE = {"BLOCK": [256, 512, 1024], "UNROLL": [1, 2, 4, 8], "SCHEDULE": ["static", "dynamic"]}
CONFIG = {"BLOCK": 512, "UNROLL": 4, "SCHEDULE": "static"}
# --- kf:end ---


class ModelNew(torch.nn.Module):
    pass
'''


def _module(space: dict[str, list[object]], config_text: str) -> str:
    return (
        "import torch\n\n"
        "# --- kf:params ---\n"
        f"SPACE = {space!r}\n"
        f"{config_text}\n"
        "# --- kf:end ---\n\n"
        "def f(x):\n    return CONFIG\n"
    )


def test_parse_reads_space_and_config_in_order() -> None:
    """The example block yields its space with keys in written order and its config."""
    parsed = params.parse(EXAMPLE)
    assert parsed is not None
    space, config = parsed
    assert space.names == ("BLOCK", "UNROLL", "SCHEDULE")
    assert space.choices("UNROLL") == (1, 2, 4, 8)
    assert config == {"BLOCK": 512, "UNROLL": 4, "SCHEDULE": "static"}


def test_parse_returns_none_without_block() -> None:
    """A module with no kf:params block has no parameters."""
    assert params.parse("import torch\nx = 1\n") is None


def test_parse_accepts_multiline_and_annotated_config() -> None:
    """CONFIG may span several lines and carry a type annotation."""
    source = _module(
        {"A": [1, 2], "B": ["x", "y"]},
        'CONFIG: dict[str, object] = {\n    "A": 2,\n    "B": "y",  # chosen\n}',
    )
    parsed = params.parse(source)
    assert parsed is not None
    assert parsed[1] == {"A": 2, "B": "y"}


def _refused(source: str) -> str:
    """The message of the ParamsError that ``params.parse`` refuses ``source`` with."""
    with pytest.raises(ParamsError) as info:
        params.parse(source)
    return str(info.value)


@pytest.mark.parametrize(
    ("config_text", "fragment"),
    [
        ('CONFIG = {"BLOCK": 300, "UNROLL": 4}', "CONFIG['BLOCK'] = 300"),
        ('CONFIG = {"BLOCK": 256}', "lacks ['UNROLL']"),
        ('CONFIG = {"BLOCK": 256, "UNROLL": 4, "X": 1}', "'X'"),
        ('CONFIG = {"BLOCK": 256, "UNROLL": True}', "CONFIG['UNROLL'] = True"),
        ('CONFIG = {"BLOCK": 256.0, "UNROLL": 4}', "CONFIG['BLOCK'] = 256.0"),
        ('CONFIG = {"BLOCK": __import__("os").getpid(), "UNROLL": 4}', "plain Python literal"),
    ],
)
def test_parse_rejects_config_outside_space(config_text: str, fragment: str) -> None:
    """A bad CONFIG raises ParamsError naming the key, value and CONFIG's line (line 5)."""
    source = _module({"BLOCK": [256, 512], "UNROLL": [1, 4]}, config_text)
    message = _refused(source)
    assert fragment in message and "line 5" in message


@pytest.mark.parametrize(
    ("space_text", "fragment"),
    [
        ('{"BLOCK": []}', "non-empty list"),
        ('{"BLOCK": [1, 1]}', "twice"),
        ('{"BLOCK": [[1]]}', "type list"),
        ('{"not-a-name": [1]}', "not a valid identifier"),
        ('{"BLOCK": [1e999]}', "not finite"),
        ('{"BLOCK": [1], "BLOCK": [2]}', "repeats keys"),
    ],
)
def test_parse_rejects_malformed_space(space_text: str, fragment: str) -> None:
    """A malformed SPACE raises ParamsError saying what is wrong and on which line."""
    source = f"# --- kf:params ---\nSPACE = {space_text}\nCONFIG = {{}}\n# --- kf:end ---\n"
    message = _refused(source)
    assert fragment in message and "line 2" in message


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("# --- kf:params ---\nSPACE = {}\nCONFIG = {}\n", "no '# --- kf:end ---'"),
        ("# --- kf:params ---\nSPACE = {}\n# --- kf:end ---\n", "no CONFIG"),
        ("# --- kf:params ---\nSPACE = {}\nCONFIG = {}\nx = 1\n# --- kf:end ---\n", "line 4"),
        ("# --- kf:params ---\nSPACE = {}; CONFIG = {}\n# --- kf:end ---\n", "lines of its own"),
        ("# --- kf:params ---\nSPACE = {\n# --- kf:end ---\n", "does not parse"),
    ],
)
def test_parse_rejects_malformed_block(source: str, fragment: str) -> None:
    """Structural problems with the block raise ParamsError with a pointed message."""
    assert fragment in _refused(source)


def test_apply_rewrites_only_the_config_line() -> None:
    """apply changes the CONFIG line to canonical form and leaves every other line alone."""
    new = params.apply(EXAMPLE, {"SCHEDULE": "dynamic", "UNROLL": 8, "BLOCK": 1024})
    old_lines, new_lines = EXAMPLE.splitlines(), new.splitlines()
    changed = [i for i, (a, b) in enumerate(zip(old_lines, new_lines, strict=True)) if a != b]
    assert len(changed) == 1
    assert new_lines[changed[0]] == "CONFIG = {'BLOCK': 1024, 'UNROLL': 8, 'SCHEDULE': 'dynamic'}"


def test_apply_collapses_multiline_config() -> None:
    """A multi-line CONFIG becomes one canonical line and the module still parses."""
    source = _module({"A": [1, 2]}, 'CONFIG = {\n    "A": 1,\n}')
    new = params.apply(source, {"A": 2})
    assert "CONFIG = {'A': 2}\n# --- kf:end ---" in new
    assert params.parse(new) is not None


def test_apply_rejects_config_outside_space() -> None:
    """apply refuses a config the space does not allow, and a source with no block."""
    with pytest.raises(ParamsError, match="BLOCK"):
        params.apply(EXAMPLE, {"BLOCK": 7, "UNROLL": 4, "SCHEDULE": "static"})
    with pytest.raises(ParamsError, match="no '# --- kf:params ---' block"):
        params.apply("x = 1\n", {})


def test_family_ignores_config_but_not_code() -> None:
    """Sources that differ only in CONFIG share a family; a code change makes a new one."""
    other = params.apply(EXAMPLE, {"BLOCK": 256, "UNROLL": 1, "SCHEDULE": "dynamic"})
    assert params.family(other) == params.family(EXAMPLE)
    assert params.family(EXAMPLE.replace("pass", "x = 1")) != params.family(EXAMPLE)


def test_family_without_block_hashes_whole_source() -> None:
    """A module with no block is its own family: the SHA-256 of its text."""
    source = "def f():\n    return 1\n"
    assert params.family(source) == hashlib.sha256(source.encode()).hexdigest()


def test_size_and_grid_enumerate_every_config_in_order() -> None:
    """grid yields size() distinct configs, last parameter fastest."""
    space = ParamSpace.from_dict({"A": [1, 2], "B": ["x", "y", "z"]})
    configs = list(params.grid(space))
    assert params.size(space) == 6
    assert len({params.config_key(c) for c in configs}) == 6
    assert configs[:2] == [{"A": 1, "B": "x"}, {"A": 1, "B": "y"}]
    assert configs[-1] == {"A": 2, "B": "z"}


def test_neighbours_step_one_parameter_by_one_position() -> None:
    """Neighbours differ in exactly one parameter, by one step in its list order."""
    space = ParamSpace.from_dict({"A": [1, 2, 4], "B": [True, False]})
    found = params.neighbours(space, {"A": 2, "B": True})
    assert found == [{"A": 1, "B": True}, {"A": 4, "B": True}, {"A": 2, "B": False}]


def test_mutate_on_single_point_space_returns_same_config() -> None:
    """With only one configuration, mutate has nothing to change and returns it."""
    space = ParamSpace.from_dict({"A": [1], "B": ["only"]})
    assert params.mutate(space, {"A": 1, "B": "only"}, random.Random(0)) == {"A": 1, "B": "only"}


def test_mutate_is_determined_by_the_seed() -> None:
    """The same seed gives the same mutation sequence."""
    space = ParamSpace.from_dict({"A": list(range(10)), "B": list(range(10)), "C": [1, 2]})
    config = {"A": 0, "B": 0, "C": 1}
    runs = []
    for _ in range(2):
        rng = random.Random(42)
        runs.append([params.mutate(space, config, rng, n_changes=2) for _ in range(20)])
    assert runs[0] == runs[1]


def test_config_key_is_canonical_and_type_aware() -> None:
    """config_key ignores key order and tells 1, True, 1.0 and '1' apart."""
    assert params.config_key({"B": 1, "A": "x"}) == params.config_key({"A": "x", "B": 1})
    keys = {params.config_key({"A": v}) for v in (1, True, 1.0, "1")}
    assert len(keys) == 4


# --------------------------------------------------------------------------- properties

_values = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.booleans(),
)
_choices = st.lists(_values, min_size=1, max_size=5, unique_by=lambda v: (type(v), v))
_spaces = st.dictionaries(
    st.from_regex(r"[A-Z][A-Z0-9_]{0,5}", fullmatch=True), _choices, min_size=1, max_size=4
)


Case = tuple[ParamSpace, dict[str, object], dict[str, object]]


@st.composite
def _space_and_configs(draw: st.DrawFn) -> Case:
    space = ParamSpace.from_dict(draw(_spaces))
    configs = [{p.name: draw(st.sampled_from(p.choices)) for p in space.params} for _ in range(2)]
    return space, configs[0], configs[1]


@settings(max_examples=80, deadline=None)
@given(_space_and_configs())
def test_apply_then_parse_round_trips(case: Case) -> None:
    """Applying any in-space config and parsing it back gives the same space and config."""
    space, first, second = case
    source = _module(space.as_dict(), f"CONFIG = {first!r}")
    new = params.apply(source, second)
    parsed = params.parse(new)
    assert parsed is not None
    assert parsed[0] == space
    assert params.config_key(parsed[1]) == params.config_key(second)
    assert params.family(new) == params.family(source)


@settings(max_examples=80, deadline=None)
@given(_space_and_configs(), st.integers(0, 2**32), st.integers(1, 4))
def test_mutate_stays_in_space_and_changes_something(case: Case, seed: int, n_changes: int) -> None:
    """A mutation is a valid config that differs from its parent when the space allows it."""
    space, config, _ = case
    child = params.mutate(space, config, random.Random(seed), n_changes=n_changes)
    assert params.validate(space, child) == child
    if params.size(space) > 1:
        assert params.config_key(child) != params.config_key(config)


@settings(max_examples=80, deadline=None)
@given(_space_and_configs(), st.integers(0, 2**32))
def test_crossover_takes_each_value_from_a_parent(case: Case, seed: int) -> None:
    """Every value of a crossover child is the same-typed value of one of its parents."""
    space, a, b = case
    child = params.crossover(space, a, b, random.Random(seed))
    assert list(child) == list(space.names)
    for name, value in child.items():
        assert repr(value) in (repr(a[name]), repr(b[name]))
