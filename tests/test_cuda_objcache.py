"""kf.cuda.objcache, the direct-mode object cache builds run through, and how
kf.cuda.inline uses it: shared module names, side-by-side imports, launchers.

The launcher tests compile tiny files with g++ (and nvcc where installed, compile only,
no GPU needed); the load_inline tests build real CPU extensions and are marked slow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kf.cuda import objcache
from kf.cuda.inline import binding_key, cache_key

GXX = shutil.which("g++") or shutil.which("c++")
NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None
)
needs_gxx = pytest.mark.skipif(GXX is None, reason="needs g++")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")

SOURCE = '#include "value.h"\nint value() { return VALUE; }\n#warning from the cached source\n'


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private ``KF_CACHE_DIR``; the object cache is its ``objects`` folder."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KF_CACHE_DIR", str(root))
    monkeypatch.delenv("KF_OBJCACHE", raising=False)
    return root / "objects"


def _old(path: Path) -> Path:
    """Date ``path`` a minute back: newer dependencies are not trusted for the cache."""
    past = time.time() - 60
    os.utime(path, (past, past))
    return path


def _write_header(folder: Path, value: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "value.h").write_text(f"#define VALUE {value}\n")
    return _old(folder / "value.h")


def _build_dir(tmp_path: Path, name: str, source: str = SOURCE) -> Path:
    """A private build folder holding ``main.cpp``, as PyTorch's would."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "main.cpp").write_text(source)
    return folder


def _compile(
    folder: Path, *extra: str, compiler: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Compile ``folder/main.cpp`` through the launcher the way PyTorch's ninja rule does."""
    command = [sys.executable, "-m", "kf.cuda.objcache", compiler or str(GXX)]
    command += ["-MMD", "-MF", "main.o.d", *extra, "-c", str(folder / "main.cpp")]
    command += ["-o", "main.o", "-fPIC", "-O2"]
    proc = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _verdicts(stderr: str) -> list[str]:
    return [
        line.split()[1] for line in stderr.splitlines() if line.startswith("kf.cuda.objcache: ")
    ]


# --- parsing --------------------------------------------------------------------------


def test_parse_compile_accepts_pytorch_rules_and_passes_others_through(tmp_path: Path) -> None:
    """The g++ and nvcc ninja rules are cached; links, queries and odd compiles are not."""
    src = tmp_path / "main.cpp"
    src.write_text("int x;\n")
    gxx = ["-MMD", "-MF", "main.o.d", "-DTORCH_EXTENSION_NAME=m", "-isystem", "/usr/include"]
    gxx += ["-fPIC", "-std=c++20", "-c", str(src), "-o", "main.o"]
    job = objcache.parse_compile(gxx)
    assert job is not None
    assert (job.source, job.output, job.depfile) == (str(src), "main.o", "main.o.d")
    assert "<kf:source>" in job.keyed_args() and str(src) not in job.keyed_args()
    assert "-MD" in job.run_args() and "-MMD" not in job.run_args()
    nvcc = ["-MD", "-MF", "k.cuda.o.d", "--expt-relaxed-constexpr"]
    nvcc += ["-gencode=arch=compute_90,code=sm_90", "--compiler-options", "-fPIC"]
    nvcc += ["-std=c++20", "-c", str(src), "-o", "k.cuda.o"]
    assert objcache.parse_compile(nvcc) is not None
    for other in (
        ["-v"],
        ["--version"],
        ["-dumpfullversion", "-dumpversion"],
        ["main.o", "-shared", "-o", "lib.so"],  # a link
        ["-MMD", "-MF", "d", "-E", "-c", str(src), "-o", "x"],
        ["-M", "-MF", "d", "-c", str(src), "-o", "x"],
        ["-MMD", "-MF", "d", "-c", str(src), str(src), "-o", "x"],  # two sources
        ["-MMD", "-MF", "d", "-c", "-", "-o", "x"],
        ["-MMD", "-MF", "d", "-c", str(tmp_path / "missing.cpp"), "-o", "x"],
        ["-c", str(src), "-o", "x"],  # no depfile: nothing to check headers against
        ["-MD", "-c", str(src), "-o", "x"],  # -MD without -MF
        ["-MD", "-MF", "d", "-arch=native", "-c", str(src), "-o", "x"],
        ["@response", "-c", str(src), "-o", "x"],
    ):
        assert objcache.parse_compile(other) is None, other


def test_parse_depfile_reads_gcc_and_nvcc_layouts() -> None:
    """Continuations, escaped spaces and nvcc's ``target : deps`` spacing all parse."""
    gcc = "main.o: /b/main.cpp /usr/include/a.h \\\n /opt/with\\ space/b.h\n"
    assert objcache.parse_depfile(gcc) == [
        (["main.o"], ["/b/main.cpp", "/usr/include/a.h", "/opt/with space/b.h"])
    ]
    nvcc = "k.cuda.o : /b/k.cu \\\n    /usr/include/x.h \\\n    /b/k.cuh\n"
    assert objcache.parse_depfile(nvcc) == [
        (["k.cuda.o"], ["/b/k.cu", "/usr/include/x.h", "/b/k.cuh"])
    ]
    rules = [(["out dir/main.o"], ["/a b/c.h", "/x$y.h"])]
    assert objcache.parse_depfile(objcache.format_depfile(rules)) == rules


# --- the launcher around g++ ------------------------------------------------------------


@needs_gxx
def test_miss_then_hit_copies_the_object_and_rewrites_the_depfile(
    tmp_path: Path, cache: Path
) -> None:
    """A second build folder compiling the same source hits: same object, its own depfile,
    the compiler's warning replayed."""
    include = tmp_path / "include"
    _write_header(include, 7)
    first, second = _build_dir(tmp_path, "build-1"), _build_dir(tmp_path, "build-2")
    miss = _compile(first, f"-I{include}")
    assert _verdicts(miss.stderr) == ["miss"]
    assert "from the cached source" in miss.stderr
    hit = _compile(second, f"-I{include}")
    assert _verdicts(hit.stderr) == ["hit"]
    assert "warning" in hit.stderr and "from the cached source" in hit.stderr
    assert (first / "main.o").read_bytes() == (second / "main.o").read_bytes()
    ((targets, deps),) = objcache.parse_depfile((second / "main.o.d").read_text())
    assert targets == ["main.o"]
    assert str(second / "main.cpp") in deps and str(include / "value.h") in deps
    assert not any(str(first) in dep for dep in deps)
    assert len(list(cache.glob("*.o"))) == 1


@needs_gxx
def test_a_changed_dependency_is_a_miss(tmp_path: Path, cache: Path) -> None:
    """A header with another size or mtime elsewhere, or other bytes beside the source,
    makes the next lookup a miss, and the recompiled entry serves the one after."""
    include = tmp_path / "include"
    header = _write_header(include, 7)
    assert _verdicts(_compile(_build_dir(tmp_path, "a"), f"-I{include}").stderr) == ["miss"]
    header.write_text("#define VALUE 8\n")
    _old(header)
    assert _verdicts(_compile(_build_dir(tmp_path, "b"), f"-I{include}").stderr) == ["miss"]
    assert _verdicts(_compile(_build_dir(tmp_path, "c"), f"-I{include}").stderr) == ["hit"]
    os.utime(header, (time.time() - 30, time.time() - 30))  # same bytes, other mtime
    assert _verdicts(_compile(_build_dir(tmp_path, "d"), f"-I{include}").stderr) == ["miss"]

    # a header in the (per-build) source folder is checked by content
    beside_one, beside_two = _build_dir(tmp_path, "e"), _build_dir(tmp_path, "f")
    _write_header(beside_one, 1)
    _write_header(beside_two, 1)
    assert _verdicts(_compile(beside_one).stderr) == ["miss"]
    assert _verdicts(_compile(beside_two).stderr) == ["hit"]
    ((_, deps),) = objcache.parse_depfile((beside_two / "main.o.d").read_text())
    assert str(beside_two / "value.h") in deps
    beside_three = _build_dir(tmp_path, "g")
    _write_header(beside_three, 2)
    assert _verdicts(_compile(beside_three).stderr) == ["miss"]


@needs_gxx
def test_a_too_new_dependency_is_not_stored(tmp_path: Path, cache: Path) -> None:
    """A header written just now may have changed while it was read: not cached."""
    include = tmp_path / "include"
    include.mkdir()
    (include / "value.h").write_text("#define VALUE 1\n")
    proc = _compile(_build_dir(tmp_path, "a"), f"-I{include}")
    assert _verdicts(proc.stderr) == ["miss"] and "not stored" in proc.stderr
    assert not list(cache.glob("*.json"))


@needs_gxx
def test_a_failing_compile_passes_its_status_through_and_is_not_cached(
    tmp_path: Path, cache: Path
) -> None:
    """g++'s status and errors come through; the failure is compiled again next time."""
    broken = "int value() { return nope; }\n"
    direct = subprocess.run(
        [str(GXX), "-c", "-x", "c++", "-", "-o", os.devnull],
        input=broken,
        capture_output=True,
        text=True,
    )
    for name in ("a", "b"):
        proc = _compile(_build_dir(tmp_path, name, broken), check=False)
        assert proc.returncode == direct.returncode != 0
        assert "nope" in proc.stderr and _verdicts(proc.stderr) == ["miss"]
        assert "failed" in proc.stderr
    assert not list(cache.glob("*.json")) and not list(cache.glob("*.o"))


#: a source whose compile grows g++'s heap past its own collector threshold (128 MiB): with
#: g++'s defaults the collector runs in it, through the launcher it does not
BIG_SOURCE = """#include <bits/stdc++.h>
std::map<std::string, std::vector<std::regex>> m;
int f(const std::string& s) {
    std::regex r("a+b");
    std::smatch x;
    return std::regex_search(s, x, r);
}
std::unordered_map<int, std::function<double(double)>> g;
"""


@needs_gxx
def test_the_collector_threshold_changes_nothing_in_the_object(tmp_path: Path, cache: Path) -> None:
    """g++ through the launcher collects garbage first at 1 GiB (kf.cuda.objcache.gc_args):
    less CPU for a big compile, and the object byte for byte g++'s own without it."""
    assert GXX is not None
    assert objcache.gc_args(os.path.realpath(GXX)) == ["--param", "ggc-min-heapsize=1048576"]
    assert objcache.gc_args("/usr/local/cuda/bin/nvcc") == []
    folder = _build_dir(tmp_path, "big", BIG_SOURCE)
    std = ("-std=c++20",)
    proc = _compile(folder, *std)
    assert _verdicts(proc.stderr) == ["miss"]
    plain = subprocess.run(
        [str(GXX), *std, "-c", "main.cpp", "-o", "plain.o", "-fPIC", "-O2"],
        cwd=folder,
        capture_output=True,
    )
    assert plain.returncode == 0, plain.stderr
    assert (folder / "main.o").read_bytes() == (folder / "plain.o").read_bytes()


@needs_gxx
def test_queries_links_and_preprocessing_pass_straight_through(tmp_path: Path, cache: Path) -> None:
    """``-v``, ``--version``, ``-dumpfullversion``, ``-E`` and links run the real compiler."""
    launch = [sys.executable, "-m", "kf.cuda.objcache", str(GXX)]
    for args in (["-v"], ["--version"], ["-dumpfullversion", "-dumpversion"]):
        through = subprocess.run(launch + args, capture_output=True, text=True)
        direct = subprocess.run([str(GXX), *args], capture_output=True, text=True)
        assert (through.returncode, through.stdout, through.stderr) == (
            direct.returncode,
            direct.stdout,
            direct.stderr,
        )
    folder = _build_dir(tmp_path, "link")
    _write_header(folder, 3)
    _compile(folder)
    link = subprocess.run(
        [*launch, "-shared", "main.o", "-o", "libvalue.so"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert link.returncode == 0, link.stderr
    assert (folder / "libvalue.so").exists() and not _verdicts(link.stderr)
    pre = subprocess.run([*launch, "-E", "main.cpp"], cwd=folder, capture_output=True, text=True)
    assert "int value() { return 3; }" in pre.stdout and not _verdicts(pre.stderr)


@needs_gxx
def test_concurrent_launches_of_one_key_compile_once(tmp_path: Path, cache: Path) -> None:
    """Four builds asking for one object at once: one compiles, three wait and hit."""
    include = tmp_path / "include"
    _write_header(include, 5)
    folders = [_build_dir(tmp_path, f"b{i}") for i in range(4)]
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "kf.cuda.objcache", str(GXX), "-MMD", "-MF", "main.o.d"),
                *(f"-I{include}", "-c", str(folder / "main.cpp"), "-o", "main.o", "-O2"),
            ],
            cwd=folder,
            stderr=subprocess.PIPE,
            text=True,
        )
        for folder in folders
    ]
    verdicts: list[str] = []
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        verdicts += _verdicts(err)
    assert sorted(verdicts) == ["hit", "hit", "hit", "miss"]
    objects = {(folder / "main.o").read_bytes() for folder in folders}
    assert len(objects) == 1


@needs_gxx
def test_objcache_off_runs_the_compiler_only(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KF_OBJCACHE=0``: every compile runs the compiler and nothing is stored."""
    monkeypatch.setenv("KF_OBJCACHE", "0")
    folder = _build_dir(tmp_path, "a")
    _write_header(folder, 1)
    proc = _compile(folder)
    assert not _verdicts(proc.stderr) and (folder / "main.o").exists()
    assert not cache.exists() or not list(cache.glob("*.o"))


# --- the launcher around nvcc -----------------------------------------------------------

KERNEL = '#include "scale.cuh"\n__global__ void scale(float* x) { x[threadIdx.x] *= SCALE; }\n'


@needs_nvcc
def test_nvcc_compile_hits_from_another_build_folder(tmp_path: Path, cache: Path) -> None:
    """nvcc's ``-MD -MF`` depfile (``target : deps``) is read and rewritten the same way."""
    outputs = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "cuda.cu").write_text(KERNEL)
        (folder / "scale.cuh").write_text("#define SCALE 2.0f\n")
        _old(folder / "scale.cuh")
        command = [sys.executable, "-m", "kf.cuda.objcache", str(NVCC), "-MD", "-MF"]
        command += ["cuda.cuda.o.d", "-DTORCH_EXTENSION_NAME=ext", "--expt-relaxed-constexpr"]
        command += ["-gencode=arch=compute_80,code=sm_80", "--compiler-options", "-fPIC"]
        command += ["-std=c++17", "-c", str(folder / "cuda.cu"), "-o", "cuda.cuda.o"]
        proc = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        outputs.append(_verdicts(proc.stderr))
        rules = objcache.parse_depfile((folder / "cuda.cuda.o.d").read_text())
        deps = [dep for _, ds in rules for dep in ds]
        assert str(folder / "cuda.cu") in deps and str(folder / "scale.cuh") in deps
        assert any("cuda_runtime.h" in dep for dep in deps)
    assert outputs == [["miss"], ["hit"]]
    assert (tmp_path / "a" / "cuda.cuda.o").read_bytes() == (
        tmp_path / "b" / "cuda.cuda.o"
    ).read_bytes()


# --- kf.cuda.inline ---------------------------------------------------------------------


def test_binding_key_leaves_out_what_main_cpp_does_not_see() -> None:
    """Candidates differing only in CUDA sources, CUDA flags or link flags share a module
    name; anything in main.cpp or its compile command gives another."""
    env = {"torch": "2.11", "cuda": "13.0", "arch": "9.0"}
    args = {
        "name": "k",
        "cpp_sources": "torch::Tensor f(torch::Tensor x);",
        "cuda_sources": "kernel one",
        "functions": ["f"],
        "extra_cflags": None,
        "extra_cuda_cflags": None,
        "extra_ldflags": None,
        "with_cuda": None,
    }
    key = binding_key(args, env)
    for same in (
        {"cuda_sources": "kernel two"},
        {"extra_cuda_cflags": ["-O3"]},
        {"extra_ldflags": ["-lcublas"]},
        {"verbose": True},
        {"with_cuda": True},  # what PyTorch infers from the CUDA sources anyway
    ):
        assert binding_key({**args, **same}, env) == key, same
        assert cache_key({**args, **same}, env) != cache_key(args, env) or "verbose" in same
    for other in (
        {"name": "j"},
        {"cpp_sources": "torch::Tensor g(torch::Tensor x);"},
        {"functions": ["f", "g"]},
        {"extra_cflags": ["-O3"]},
        {"cuda_sources": ""},  # no CUDA: main.cpp gets the CPU include paths
    ):
        assert binding_key({**args, **other}, env) != key, other
    assert binding_key(args, {**env, "torch": "2.12"}) != key


@needs_gxx
def test_build_launchers_wrap_the_real_compilers_and_are_put_back(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During a build CXX is a launcher PyTorch accepts as gcc; afterwards it is restored."""
    import torch.utils.cpp_extension as ext

    from kf.cuda import inline

    monkeypatch.setenv("CXX", "g++")
    monkeypatch.delenv("PYTORCH_NVCC", raising=False)
    with inline._object_cache():
        launcher = os.environ["CXX"]
        assert Path(launcher).parent == cache / "bin"
        text = Path(launcher).read_text()
        assert text.startswith("#!/bin/sh\n") and "-m kf.cuda.objcache" in text
        assert str(shutil.which("g++")) in text
        assert ext.check_compiler_ok_for_platform(launcher)
        ok, version = ext.get_compiler_abi_compatibility_and_version(launcher)
        assert ok and str(version) != "0.0.0"
        if ext.CUDA_HOME:
            assert "kf.cuda.objcache" in Path(os.environ["PYTORCH_NVCC"]).read_text()
    assert os.environ["CXX"] == "g++" and "PYTORCH_NVCC" not in os.environ
    monkeypatch.setenv("KF_OBJCACHE", "0")
    with inline._object_cache():
        assert os.environ["CXX"] == "g++" and "PYTORCH_NVCC" not in os.environ


DECLARATION = "int which();"


def _helper_object(folder: Path, value: int) -> str:
    """An object file defining ``which()``, linked into an extension by extra_ldflags."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"which{value}.cpp"
    source.write_text(f"int which() {{ return {value}; }}\n")
    obj = folder / f"which{value}.o"
    subprocess.run([str(GXX), "-fPIC", "-c", str(source), "-o", str(obj)], check=True)
    return str(obj)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the load_inline tests, so the second reuses the first's builds."""
    return tmp_path_factory.mktemp("inline-cache")


@needs_gxx
@pytest.mark.slow
def test_extensions_sharing_a_module_name_share_main_cpp_and_import_side_by_side(
    shared_cache: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two builds whose main.cpp is the same (they differ in link flags only): one module
    name, main.cpp compiled once, and both libraries import into one process with their
    own ``PyInit_`` and answer for themselves."""
    from kf.cuda.inline import builds, load_inline

    monkeypatch.setenv("KF_CACHE_DIR", str(shared_cache))
    monkeypatch.delenv("KF_OBJCACHE", raising=False)
    helpers = shared_cache / "helpers"
    common = {"name": "kf_objcache_probe", "cpp_sources": DECLARATION, "functions": ["which"]}
    one = load_inline(**common, extra_ldflags=[_helper_object(helpers, 1)], verbose=True)
    first = capfd.readouterr()
    two = load_inline(**common, extra_ldflags=[_helper_object(helpers, 2)], verbose=True)
    second = capfd.readouterr()
    log_one, log_two = first.out + first.err, second.out + second.err
    assert "kf.cuda.objcache: miss main.cpp" in log_one, log_one
    assert "kf.cuda.objcache: hit main.cpp" in log_two, log_two
    assert [b["cached"] for b in builds()[-2:]] == [False, False]
    assert builds()[-1]["key"] != builds()[-2]["key"]
    assert Path(one.__file__).name == Path(two.__file__).name  # one TORCH_EXTENSION_NAME
    assert Path(one.__file__).parent != Path(two.__file__).parent
    assert one is not two
    assert (one.which(), two.which()) == (1, 2)
    assert sys.modules[one.__name__] is one and sys.modules[two.__name__] is two


@needs_gxx
@pytest.mark.slow
def test_an_identical_load_in_a_fresh_process_is_a_cache_hit(
    shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process asking for the same build imports the finished library."""
    from kf.cuda.inline import load_inline

    monkeypatch.setenv("KF_CACHE_DIR", str(shared_cache))
    helper = _helper_object(shared_cache / "helpers", 1)
    arguments = {
        "name": "kf_objcache_probe",
        "cpp_sources": DECLARATION,
        "functions": ["which"],
        "extra_ldflags": [helper],
    }
    assert load_inline(**arguments).which() == 1  # built already by the test above, or now
    script = textwrap.dedent(
        f"""
        from kf.cuda.inline import load_inline
        print("which", load_inline(**{arguments!r}).which())
        """
    )
    env = {**os.environ, "KF_CUDA_REPORT": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "kf_objcache_probe" in proc.stdout and "cache hit" in proc.stdout, proc.stdout
    assert "which 1" in proc.stdout


@needs_gxx
def test_verdicts_are_also_appended_to_the_named_log(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KF_OBJCACHE_LOG`` (a runner's log) gets each verdict too: ninja hides stderr."""
    log = tmp_path / "runner.log"
    log.write_text("runner output before the build\n")
    monkeypatch.setenv("KF_OBJCACHE_LOG", str(log))
    include = tmp_path / "include"
    _write_header(include, 3)
    _compile(_build_dir(tmp_path, "build-1"), f"-I{include}")
    _compile(_build_dir(tmp_path, "build-2"), f"-I{include}")
    lines = log.read_text().splitlines()
    assert lines[0] == "runner output before the build"
    assert _verdicts("\n".join(lines)) == ["miss", "hit"]
