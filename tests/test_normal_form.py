"""kf.kernels.normal_form: sources that differ only in comments and spacing share a digest;
sources that compile to different code do not."""

from __future__ import annotations

from kf.kernels.normal_form import digest, normal_c
from tests.scripted_answers import cpp_module


def test_normal_form_ignores_comments_and_spacing() -> None:
    """Python comments, docstrings, blank lines, C comments and spacing change no digest."""
    src = cpp_module()
    noisy = (
        '"""A docstring the model added."""\n# a comment\n'
        + src.replace("#pragma omp parallel for", "#pragma   omp parallel for  // rows")
        .replace("++r) {", "++r)   {  /* each row */\n\n")
        .replace("const float v = x[r * cols + c]", "const float v=x[r*cols+c]")
        .replace("x = x.contiguous()", "x = x.contiguous()  # contiguous")
        .replace("def forward(self, x: torch.Tensor) -> torch.Tensor:",
                 'def forward(self, x: torch.Tensor) -> torch.Tensor:\n        """Run."""')
    )  # fmt: skip
    assert noisy != src
    assert digest(noisy) == digest(src)


def test_normal_form_tells_different_code_apart() -> None:
    """A changed constant, operator spacing that changes tokens, a macro's kind, a string
    literal's text and a name each change the digest."""
    src = cpp_module()
    for changed in (
        cpp_module(factor="1.0f"),
        src.replace('CONFIG = {"CHUNK": 64}', 'CONFIG = {"CHUNK": 16}'),
        src.replace("int64_t r = 0; r < rows; ++r", "int64_t r = 0; r < rows; r++"),
        src.replace("#include <cstdint>", "#include <cstdint>\n#define K (a)"),
        src.replace("const float v", "const float w").replace("v > 0.0f ? v", "w > 0.0f ? w"),
    ):
        assert changed != src and digest(changed) != digest(src), changed[:0]
    assert normal_c("a - -b;") != normal_c("a--b;")
    assert normal_c("#define X (a)") != normal_c("#define X(a)")
    assert normal_c('s = "a // b";') != normal_c('s = "a";')
    assert normal_c("x = 1; /* c */\n\n  y =  2;") == normal_c("x=1;\ny=2; // two")


def test_normal_form_reads_text_that_is_not_python() -> None:
    """A source Python cannot parse is normalised as C text, so its spacing still dedups."""
    assert digest("int main() { return 0 ; }") == digest("int main(){return 0;} // x")
    assert digest("int main() { return 0; }") != digest("int main() { return 1; }")
