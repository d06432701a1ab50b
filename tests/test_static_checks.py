"""Static checks: source patterns that usually mean a kernel cheats, found without running it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kf.kernels.static_checks import CODES, check_source

ADVERSARIAL = Path(__file__).parent / "fixtures" / "adversarial"
SEEDS = Path(__file__).parent.parent / "examples" / "tasks" / "seeds"


def codes(source: str) -> set[str]:
    return {w.split(":", 1)[0] for w in check_source(source)}


@pytest.mark.parametrize("path", sorted(SEEDS.glob("*.py")), ids=lambda p: p.stem)
def test_static_checks_example_seeds_are_clean(path: Path) -> None:
    """Every shipped seed kernel (C++ called from forward) draws no warning."""
    assert check_source(path.read_text()) == ()


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("torch_reference", "torch_compute"),
        ("torch_reference", "no_custom_kernel"),
        ("never_calls_kernel", "kernel_never_called"),
        ("try_fallback", "try_fallback"),
        ("timer_patch", "timer_patching"),
        ("grader_gc", "introspection"),
        ("grader_stack", "introspection"),
    ],
)
def test_static_checks_flag_cheating_fixture(name: str, code: str) -> None:
    """Each cheating fixture draws the warning for its pattern."""
    assert code in codes((ADVERSARIAL / f"{name}.py").read_text())


def test_static_checks_honest_fixture_is_clean() -> None:
    """The honest fixture draws no warning."""
    assert check_source((ADVERSARIAL / "honest_cpp.py").read_text()) == ()


def test_static_checks_streams_threads_and_layers() -> None:
    """Side streams, threads, nn layers used in forward and the @ operator are all reported."""
    source = """
import threading
import torch
from torch import nn

class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.s = torch.cuda.Stream()

    def forward(self, x, w):
        return self.proj(x) @ w
"""
    found = check_source(source)
    assert {"thread", "stream", "torch_compute", "no_custom_kernel"} <= codes(source)
    assert any("self.proj" in w and "@" in w for w in found)


def test_static_checks_warning_names_line() -> None:
    """A warning names the line it was found on."""
    source = "import time\ntime.perf_counter = lambda: 0.0\n"
    assert check_source(source) == ("timer_patching: assigns time.perf_counter (line 2)",)


def test_static_checks_unparsable_source_yields_nothing() -> None:
    """Source that does not parse yields no warnings (compilation reports it)."""
    assert check_source("def (") == ()


def test_static_checks_codes_are_documented() -> None:
    """Every code the checks emit is listed in CODES and explained by kf eval."""
    from kf.reports import FLAG_REASONS

    assert set(CODES) <= set(FLAG_REASONS)


def test_gpu_backends_count_as_native_kernels() -> None:
    """kf.cuda.compile(...).function(...) (NVRTC), @triton.jit launched as kernel[grid](...)
    and load_inline are native kernels that forward calls: no warning for any of them."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "examples"
    for path in (
        root / "cuda_tasks" / "seeds" / "gelu_residual.py",
        root / "cuda_tasks" / "seeds" / "gelu_residual.triton.py",
        root / "cuda_candidates" / "gelu_residual_load_inline.py",
    ):
        assert check_source(path.read_text()) == (), path.name


HONEST = Path(__file__).parent / "fixtures" / "honest"
IMPORT_F = "import torch.nn.functional as F"


@pytest.mark.parametrize("path", sorted(HONEST.glob("*.py")), ids=lambda p: p.stem)
def test_static_checks_honest_idioms_are_clean(path: Path) -> None:
    """Kernels kept as attributes, aliased, launched from wrappers, autograd Functions,
    sub-modules and lazy builds (CPU, Triton and load_inline) draw no warning."""
    assert check_source(path.read_text()) == ()


def test_static_checks_never_names_local_variables() -> None:
    """A built-but-unused Triton kernel is reported by its own name, never by the
    kernel's locals (``a``, ``b``, ``vals``, loaded with ``tl.load``)."""
    source = (HONEST / "triton_wrapper.py").read_text()
    cheat = source.replace("return fused(x, self.bias)", "return F.gelu(x + self.bias)")
    cheat = cheat.replace(
        "from torch import nn", "from torch import nn\nimport torch.nn.functional as F"
    )
    found = [w for w in check_source(cheat) if w.startswith("kernel_never_called")]
    assert len(found) == 1
    assert "gelu_bias_kernel" in found[0]
    for local in ("a,", "b,", "vals", "(a", "out"):
        assert local not in found[0].split("(", 1)[1].split(")")[0]


@pytest.mark.parametrize(
    "forward",
    [
        "return F.gelu(x + self.bias)",  # the kernel sits on self.op, unused
        "y = torch.empty_like(x)\n        _unused(x)\n        return F.gelu(x + self.bias)",
    ],
)
def test_static_checks_module_attribute_cheat_still_caught(forward: str) -> None:
    """A library kept as ``self.op`` (or reached only by a function forward never calls)
    and a forward that computes with PyTorch instead is still ``kernel_never_called``."""
    source = (HONEST / "module_attr.py").read_text()
    head, _, _ = source.partition("    def forward")
    cheat = (
        head.replace(
            "from torch import nn", "from torch import nn\nimport torch.nn.functional as F"
        )
        + "    def forward(self, x):\n        "
        + forward
        + "\n\n\ndef _never(x):\n    return gelu_lib.gelu_bias(x)\n"
        + "\n\ndef _unused(x):\n    return x\n"
    )
    assert "kernel_never_called" in codes(cheat)


def test_static_checks_uncertain_call_is_no_warning() -> None:
    """Where forward calls something kf cannot follow (``getattr(...)``, a callable passed
    in), it does not claim the kernel is never called."""
    source = (HONEST / "module_attr.py").read_text()
    dynamic = source.replace(
        "self.op.gelu_bias(x.data_ptr()", 'getattr(self, "o" + "p").gelu_bias(x.data_ptr()'
    )
    assert "kernel_never_called" not in codes(dynamic)
    assert check_source(source) == ()
