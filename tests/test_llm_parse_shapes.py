"""Answers shaped the way real models write them: each shape parses, or fails saying why."""

from __future__ import annotations

import pytest

from kf.llm.parse import ResponseError, parse_edit

MODULE = (
    "import torch\nfrom torch import nn\n\n\nclass ModelNew(nn.Module):\n"
    "    def forward(self, x):\n        return x * 3\n"
)
PARENT = MODULE.replace("x * 3", "x * 2")


def test_parse_takes_the_block_defining_model_new_among_several() -> None:
    """Of a C++ block, a helper block and the module, the module is taken and noted."""
    answer = (
        "```cpp\n__global__ void k() {}\n```\nA helper:\n```python\nx = 1\n```\n"
        f"```python\n{MODULE}```"
    )
    edit = parse_edit(answer, None)
    assert edit.source == MODULE and "block 3 of 3" in edit.notes[0]


def test_parse_takes_the_last_of_two_modules() -> None:
    """A draft followed by a final version: the final one wins."""
    final = MODULE.replace("x * 3", "x * 3.0")
    edit = parse_edit(f"Draft:\n```python\n{MODULE}```\nFinal:\n```python\n{final}```", None)
    assert edit.source == final


@pytest.mark.parametrize("fence", ["```python", "```py", "```Python3", "```", "~~~python"])
def test_parse_accepts_python_py_and_bare_fences(fence: str) -> None:
    """Every common spelling of a Python fence is read."""
    close = "~~~" if fence.startswith("~") else "```"
    assert parse_edit(f"{fence}\n{MODULE}{close}\n", None).source == MODULE


def test_parse_drops_think_blocks_even_with_code_inside() -> None:
    """Reasoning, including a code block of its own, is not mistaken for the answer."""
    answer = (
        "<think>\nmaybe\n```python\nclass ModelNew: pass\n```\n</think>\nHere:\n"
        f"```python\n{MODULE}```"
    )
    edit = parse_edit(answer, None)
    assert edit.source == MODULE and any("reasoning removed" in n for n in edit.notes)


def test_parse_refuses_an_answer_that_never_closes_its_reasoning() -> None:
    """A <think> opened and never closed (the model ran out of tokens thinking) is named."""
    with pytest.raises(ResponseError, match="never closed"):
        parse_edit("<think>\nlet me consider the tiling " * 20, None)


def test_parse_ignores_prose_around_the_code() -> None:
    """Explanations before and after the block do not matter."""
    answer = f"Sure! The fused kernel:\n\n```python\n{MODULE}```\n\nThis avoids a pass."
    assert parse_edit(answer, None).source == MODULE


def test_parse_normalises_crlf_line_ends() -> None:
    """An answer with Windows line ends parses to a module with plain newlines."""
    answer = f"```python\n{MODULE}```".replace("\n", "\r\n")
    edit = parse_edit(answer, None)
    assert edit.source == MODULE and "\r" not in edit.source


def test_parse_names_an_answer_cut_off_at_the_token_limit() -> None:
    """An unclosed block with finish_reason=length says the answer was cut off."""
    with pytest.raises(ResponseError, match=r"cut off at the token limit \(finish_reason=length\)"):
        parse_edit(f"```python\n{MODULE[:50]}", None, finish_reason="length")


def test_parse_accepts_a_complete_answer_that_hit_the_limit_after_its_code() -> None:
    """A closed block followed by cut-off prose is usable, and the note says it was cut."""
    edit = parse_edit(f"```python\n{MODULE}```\nThis kernel is fa", None, finish_reason="length")
    assert edit.source == MODULE and any("finish_reason=length" in n for n in edit.notes)


def test_parse_takes_a_bare_module_without_fences() -> None:
    """Some models answer with the code alone."""
    assert parse_edit(MODULE, None).source == MODULE


def test_parse_refuses_a_diff_for_a_first_kernel() -> None:
    """A SEARCH/REPLACE answer has nothing to apply to when there is no parent."""
    diff = "<<<<<<< SEARCH\nx * 2\n=======\nx * 3\n>>>>>>> REPLACE\n"
    with pytest.raises(ResponseError, match="need a parent"):
        parse_edit(diff, None)
    assert parse_edit(diff, PARENT).source == MODULE
