"""The runner box (kf.evaluation.grader.box): a hostile candidate run through the real ``kf eval``
and ``kf run`` stays in it; without bwrap kf refuses, or runs marked when told to."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kf.evaluation.grader import box
from tests.harness import kf_cli, ran

ROOT = Path(__file__).resolve().parent.parent
ADVERSARIAL = ROOT / "tests/fixtures/adversarial"
TASK = ROOT / "tests/fixtures/eval/task_gelu.py"
SECRETS = {
    "KF_NATS_TOKEN": "kf-secret-value-nats",
    "KF_LLM_API_KEY": "kf-secret-value-llm",
    "OPENAI_API_KEY": "kf-secret-value-openai",
}
MARKER = "kf-escape-marker"
SCRATCH_MB = 64
FILE_MB = 16

needs_box = pytest.mark.skipif(box.probe() is not None, reason=f"no runner box here: {box.probe()}")


def _grader_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The grader's environment: kf's secrets set, its own home and temporary folder."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "id_rsa").write_text("-----BEGIN kf-secret-value-ssh-----\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(SECRETS)
    env.update(
        HOME=str(home),
        TMPDIR=str(tmp),
        PYTHONPATH=str(ROOT),
        KF_CACHE_DIR=os.environ.get("KF_CACHE_DIR") or str(ROOT / ".kf-cache"),
        KF_EVAL_THREADS="1",
        KF_EVAL_POOL="1",
        KF_SANDBOX_SCRATCH_MB=str(SCRATCH_MB),
        KF_EVAL_FILE_MB=str(FILE_MB),
        KF_LOG_LEVEL="WARNING",
    )
    env.pop("KF_UNSAFE_NO_SANDBOX", None)
    env.update(extra)
    return env


def _candidate(
    tmp_path: Path,
    *,
    report: bool,
    port: int,
    read_paths: tuple[str, ...] = (),
    import_name: str = "",
    forks: int = 0,
) -> Path:
    """escape.py with its constants filled in for this test."""
    source = (ADVERSARIAL / "escape.py").read_text()
    values = {
        "REPORT": repr(report),
        "MARKER": repr(MARKER),
        "PORT": repr(port),
        "HOME": repr(str(tmp_path / "home")),
        "REPO": repr(str(ROOT)),
        "SECRET_VALUES": repr(tuple(SECRETS.values())),
        "READ_PATHS": repr(("/proc/1/environ", *read_paths)),
        "IMPORT": repr(import_name),
        "FORKS": repr(forks),
    }
    for name, value in values.items():
        source, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", source, count=1, flags=re.M)
        assert n == 1, name
    path = tmp_path / f"escape_{'report' if report else 'run'}.py"
    path.write_text(source)
    return path


PIDS = 64


def _user_folders(tmp_path: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """A grader environment whose PYTHONPATH holds a project folder (a ``.env``, an
    ``.ssh/id_rsa``, a run's log) and a ``pip --target`` folder (a package, and a secret
    beside it), whose LD_LIBRARY_PATH holds a folder with a library and a secret, and
    whose ``CC`` is a compiler in a prefix outside ``/usr`` with a secret at its top;
    the paths a candidate should read, and the ones it should not."""
    project, site, libs, prefix = (tmp_path / n for n in ("project", "site", "libs", "gcc"))
    secret = [project / ".env", project / ".ssh" / "id_rsa", project / "run.db"]
    secret += [site / ".env", site / "notes.txt", libs / "secret.txt", prefix / "secret.txt"]
    for path in secret:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("kf-secret-value-user-file\n")
    (site / "kfprobe_pkg").mkdir()
    (site / "kfprobe_pkg" / "__init__.py").write_text("")
    (site / "kfprobe_pkg-1.0.dist-info").mkdir()
    (site / "kfprobe_pkg-1.0.dist-info" / "RECORD").write_text(
        "kfprobe_pkg/__init__.py,,\nkfprobe_pkg-1.0.dist-info/RECORD,,\n../../bin/x,,\n"
    )
    (libs / "libkfprobe.so.1").write_bytes(b"\x7fELF not loaded")
    (prefix / "bin").mkdir()
    (prefix / "bin" / "kfcc").symlink_to(shutil.which("gcc") or "/usr/bin/gcc")
    env = _grader_env(
        tmp_path,
        PYTHONPATH=os.pathsep.join(map(str, (project, site, ROOT))),
        # the host's own folders stay behind it: a CUDA build of PyTorch may need them to
        # import at all (it did on the H200's image, where kf eval then printed nothing)
        LD_LIBRARY_PATH=os.pathsep.join(
            filter(None, (str(libs), os.environ.get("LD_LIBRARY_PATH")))
        ),
        CC=str(prefix / "bin" / "kfcc"),
        KF_SANDBOX_PIDS=str(PIDS),
    )
    readable = [str(site / "kfprobe_pkg" / "__init__.py"), str(libs / "libkfprobe.so.1")]
    readable.append(str(prefix / "bin" / "kfcc"))
    return env, readable, [str(p) for p in secret]


def _kf_eval(
    tmp_path: Path, candidate: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """``kf eval`` in a grader process whose command line names a run's log, as
    ``kf run --db`` does (the path the forging candidate looked for)."""
    db = tmp_path / f"{MARKER}-run.db"  # the only log the candidate would write to
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, body TEXT)")
    grader = (
        "import sys\nfrom kf.evaluation.grader.cli import main\n"
        "sys.exit(main(sys.argv[2:]))  # argv[1]: the run's log, as kf run's command line has"
    )
    argv = [sys.executable, "-c", grader, str(db), str(TASK), str(candidate), "--json", *args]
    return ran(argv, env=env, cwd=tmp_path, timeout=300)


def _marked_pids() -> list[int]:
    """Host processes whose command line carries the escape marker."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if MARKER.encode() in argv:
                pids.append(int(entry))
    return pids


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP socket listening on 127.0.0.1 that no candidate should reach."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield sock
    finally:
        sock.close()


@pytest.fixture
def cleanup() -> Iterator[None]:
    """Whatever an escape left behind goes, even when an assertion failed."""
    before = hashlib.sha256((ROOT / "kf/app/cli.py").read_bytes()).hexdigest()
    try:
        yield
    finally:
        for pid in _marked_pids():  # started by this test's candidate
            os.kill(pid, signal.SIGKILL)
        (ROOT / "kf/_escaped.py").unlink(missing_ok=True)
        for path in (Path("/var/tmp/kf-escape-fill"), ROOT / "kf-escape-fill"):
            path.unlink(missing_ok=True)
        assert hashlib.sha256((ROOT / "kf/app/cli.py").read_bytes()).hexdigest() == before


def _no_connection(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


#: how a box's processes are bounded: this machine's way (a pids cgroup where kf may make
#: one), and the uid mode, forced with KF_BOX_CGROUP=0 (root without a writable pids cgroup,
#: as on the H200: each box as a host uid of its own, under RLIMIT_NPROC)
LIMITS = [
    pytest.param({}, id="default"),
    pytest.param(
        {"KF_BOX_CGROUP": "0"},
        id="uid-mode",
        marks=pytest.mark.skipif(os.geteuid() != 0, reason="the uid mode is for root"),
    ),
]


def _limit_mode(extra: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """The process limit the grader's boxes get with ``extra`` set (the uid mode asked for
    must be the one in force: on this machine root has a cgroup, so it is forced)."""
    for name, value in extra.items():
        monkeypatch.setenv(name, value)
    limit = box.process_limit()
    if extra:
        assert limit == "uid", box.process_limit_note()
    return limit


@needs_box
@pytest.mark.parametrize("limits", LIMITS)
def test_box_hostile_candidate_finds_nothing_to_take(
    tmp_path: Path,
    listener: socket.socket,
    cleanup: None,
    limits: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A candidate in the box runs as uid 65534 (in the uid mode: a host uid of its box's
    own) and sees no secret, home, log, repository, network or disk outside its
    size-limited scratch folder; its fork bomb stops at the box's process limit."""
    limit = _limit_mode(limits, monkeypatch)
    port = listener.getsockname()[1]
    env, readable, secret = _user_folders(tmp_path)
    env.update(limits)
    candidate = _candidate(
        tmp_path,
        report=True,
        port=port,
        read_paths=(*readable, *secret),
        import_name="kfprobe_pkg",
        forks=400,
    )
    proc = _kf_eval(tmp_path, candidate, env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]  # kf eval's verdict, not a traceback
    result = json.loads(proc.stdout)
    assert result["sandbox"] == "bwrap"
    log = result["compile"]["log"]
    report = re.search(r"ESCAPE-REPORT (\{.*\}) END", log)
    assert report is not None, log[-3000:]
    found = json.loads(report.group(1))

    if limit == "uid":  # a host uid of the box's own, no account's
        first, last = box.box_uids()
        assert first <= found["uid"] == found["gid"] <= last, found
    else:
        assert (found["uid"], found["gid"]) == (box.BOX_UID, box.BOX_UID)
    assert found["env_secrets"] == {}
    assert not set(found["env_names"]) & set(SECRETS)
    assert found["proc_secrets"] == []
    assert len(found["pids_visible"]) <= 3, found["pids_visible"]  # bwrap's init, the runner
    for key in ("home_listing", "ssh_key", "root_ssh", "etc_shadow"):
        assert str(found[key]).startswith("denied"), (key, found[key])
    assert found["run_log"] == {"logs_seen": [], "forged": []}
    assert str(found["repo_write"]).startswith("denied")
    assert str(found["cache_write"]).startswith("denied")
    assert str(found["repo_open_cli"]).startswith("denied")
    assert found["native_connect"] != "connected"
    assert found["scan"]["connected"] == [], found["scan"]  # no port of 127.0.0.1 at all
    assert found["nats_folders"] == []
    # in the box /tmp is the scratch tmpfs itself: a checkout under /tmp (a CI clone) puts
    # the repository's path there, so a write to it lands in scratch, not in the checkout
    for path, verdict in found["fill_outside"].items():
        assert str(verdict).startswith("denied") or path.startswith("/tmp/"), (path, found)
    for key in ("fill_scratch", "fill_tmp"):  # one tmpfs of SCRATCH_MB
        assert found[key]["mb"] <= SCRATCH_MB and "No space left" in found[key]["error"], found
    assert found["fill_shm"]["mb"] <= SCRATCH_MB and "No space left" in found["fill_shm"]["error"]
    # the runner's output log is outside the box: the per-file limit holds it
    assert found["flood_stdout"]["mb"] <= FILE_MB and "too large" in found["flood_stdout"]["error"]
    assert found["orphan"] == "spawned"
    # the grader's PYTHONPATH and LD_LIBRARY_PATH folders and a compiler's prefix: what
    # was installed there is bound, the user's files beside it are not
    reads = found["read_paths"]
    assert not any(v in reads["/proc/1/environ"] for v in SECRETS.values()), reads
    for path in secret:
        assert reads[path].startswith("denied"), (path, reads[path])
    for path in readable:
        assert reads[path].startswith("read"), (path, reads[path])
    assert found["import"] == "kfprobe_pkg"
    for name, value in found["env_paths"].items():  # nothing named that is not there
        assert str(tmp_path / "project") not in value, (name, value)
    # the user's library folder comes through first (the host's own may follow)
    assert found["env_paths"]["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(tmp_path / "libs")
    # a fork bomb stops at the box's own process limit (threads count too), where this
    # machine gives kf a way to set one (docs/sandbox.md, "Processes")
    if limit != "none":
        assert 0 < found["forks"]["forked"] < PIDS, found["forks"]
        assert "Resource temporarily unavailable" in found["forks"]["error"]
    # a build flag that runs a program is refused before any compiler starts
    assert found["wrapper"].startswith("denied") and "refusing compiler flag" in found["wrapper"]
    assert f"{MARKER}-wrapper-ran" not in log

    assert _no_connection(listener)
    assert _marked_pids() == []
    assert list((tmp_path / "tmp").iterdir()) == []  # no runner folder left behind
    with sqlite3.connect(tmp_path / f"{MARKER}-run.db") as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert tables == {"events"}
    assert not (ROOT / "kf/_escaped.py").exists()


@needs_box
def test_box_hostile_candidate_leaves_nothing_behind_after_every_stage(
    tmp_path: Path, listener: socket.socket, cleanup: None
) -> None:
    """A correct candidate that forks a setsid child and fills its disk in every stage
    passes, and no child of it or file of it is left once ``kf eval`` returns."""
    port = listener.getsockname()[1]
    proc = _kf_eval(tmp_path, _candidate(tmp_path, report=False, port=port), _grader_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["correct"] and result["profile"]["ok"]
    stages = [result[s]["sandbox"] for s in ("compile", "verify", "profile")]
    assert stages == ["bwrap"] * 3
    assert not any(f.startswith("unsandboxed") for f in result["flags"])
    assert _marked_pids() == []
    assert _no_connection(listener)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not Path("/var/tmp/kf-escape-fill").exists()


@needs_box
@pytest.mark.parametrize("limits", LIMITS)
def test_box_honest_native_candidate_is_built_by_the_grader(
    tmp_path: Path, limits: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An honest C++ candidate passes in the box; its library was built by the grader, in
    a build box, into the shared cache under the key the grader computed (in the uid mode
    too: the compiler's processes under the limit, the build folder the box's to write)."""
    from kf import native

    _limit_mode(limits, monkeypatch)
    cache = tmp_path / "cache"
    env = _grader_env(tmp_path, KF_CACHE_DIR=str(cache), KF_SANDBOX_PIDS=str(PIDS), **limits)
    proc = _kf_eval(tmp_path, ADVERSARIAL / "honest_cpp.py", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["correct"] and result["sandbox"] == "bwrap"
    namespace: dict[str, object] = {}
    source = (ADVERSARIAL / "honest_cpp.py").read_text()
    exec(compile(source.split("class ModelNew")[0], "honest_cpp", "exec"), namespace)
    key, _, _ = native.build_key(str(namespace["SOURCE"]))
    assert sorted(p.name for p in (cache / "native").glob("*.so")) == [f"{key}.so"]
    assert (cache / "native" / f"{key}.so").stat().st_uid == os.geteuid()  # the grader's
    assert not list((cache / "native").glob("*.build-*"))  # the build folder went


@needs_box
@pytest.mark.skipif(not Path("/dev/nvidia0").exists(), reason="needs a GPU (the H200)")
@pytest.mark.skipif(os.geteuid() != 0, reason="the uid mode is for root")
def test_box_uid_mode_builds_and_runs_a_cuda_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, a box in the uid mode (a host uid of its own, no user namespace, under
    RLIMIT_NPROC) may open the GPU's nodes, builds a load_inline kernel through the
    grader's build box (nvcc's processes under the limit) and verifies and times it."""
    _limit_mode({"KF_BOX_CGROUP": "0"}, monkeypatch)
    env = _grader_env(tmp_path, KF_CACHE_DIR=str(tmp_path / "cache"), KF_BOX_CGROUP="0")
    task = ROOT / "examples/cuda_tasks/gelu_residual.py"
    seed = ROOT / "examples/cuda_tasks/seeds/gelu_residual.py"
    cli = [sys.executable, "-m", "kf.evaluation.grader.cli", str(task), str(seed)]
    proc = ran([*cli, "--device", "cuda:0", "--json"], env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["correct"] and result["profile"]["ok"], result
    assert [result[s]["sandbox"] for s in ("compile", "verify", "profile")] == ["bwrap"] * 3


@needs_box
def test_box_build_service_refuses_a_broken_build_with_the_compiler_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that fails in the build box stores nothing and returns the compiler's log."""
    from kf.evaluation.grader.builds import build_native

    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    reply = build_native('extern "C" int f() { return undeclared_name; }', [], {}, 60.0)
    assert not reply["ok"] and "undeclared_name" in reply["log"]
    assert not list((tmp_path / "cache" / "native").glob("*.so"))
    reply = build_native('extern "C" int f() { return N; }', [], {"N": "7"}, 60.0)
    assert reply["ok"] and Path(reply["path"]).parent == tmp_path / "cache" / "native"


@needs_box
def test_box_build_service_refuses_flags_that_run_programs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grader refuses a candidate's build flag that would run a program, load a
    plugin, read a file of options or change the system root, in one line, and runs no
    compiler: the ``-wrapper`` command never runs (a candidate could skip the runner's
    own check and send such flags over its socket)."""
    from kf.evaluation.grader.builds import build_native

    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    ran = tmp_path / "wrapper-ran"
    source = 'extern "C" int f() { return 1; }'
    for flags in (
        ["-wrapper", f"/bin/sh,-c,touch {ran}"],
        ["-B/tmp"],
        ["-fplugin=/tmp/evil.so"],
        ["--sysroot=/tmp"],
        ["-specs=/tmp/evil.specs"],
        ["@/tmp/options"],
        ["-Wl,-plugin,/tmp/evil.so"],
        ["-I/home"],
    ):
        reply = build_native(source, flags, {}, 60.0)
        assert not reply["ok"] and reply["error"].startswith("kf.native: refusing"), reply
        assert "\n" not in reply["error"]
    reply = build_native(source, ["-O2", "-ffast-math", "-mavx2", "-Wall", "-DK=3", "-lm"], {}, 60)
    assert reply["ok"], reply
    assert not ran.exists()
    assert not list((tmp_path / "cache" / "native").glob("*.build-*"))


@needs_box
def test_box_build_output_is_capped_head_and_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that floods its output (a few MB of warnings here; 1.5 GB once took kf run
    to 4.4 GB of memory) gives the grader only its head and tail, saying how much went;
    the stream itself is read into a bounded buffer."""
    from kf.capture import OUTPUT_CAP_BYTES, run_capped
    from kf.evaluation.grader.builds import build_native

    monkeypatch.setenv("KF_CACHE_DIR", str(tmp_path / "cache"))
    noise = "#warning kf-flood " + "x" * 400 + "\n"
    source = "#warning kf-first-line\n" + noise * 4000 + "int g() { return kf_last_error; }\n"
    reply = build_native(source, [], {}, 120.0)
    assert not reply["ok"]
    log = reply["log"]
    assert len(log) < 21_000 and "dropped" in log
    assert "kf-first-line" in log and "kf_last_error" in log
    # the stream: 50 MB of output read into the cap, the last line kept
    code, text = run_capped(
        ["sh", "-c", "head -c 50000000 /dev/zero | tr '\\0' x; echo; echo kf-the-end"],
        timeout_s=60,
        limit=OUTPUT_CAP_BYTES,
    )
    assert code == 0 and text.rstrip().endswith("kf-the-end")
    assert len(text) < OUTPUT_CAP_BYTES + 200
    assert re.search(r"\[\.\.\. (\d+) bytes of output dropped \.\.\.\]", text)


def test_box_missing_bwrap_refuses_with_one_line(tmp_path: Path) -> None:
    """With bwrap missing, ``kf eval`` refuses in one line that says why and what to do."""
    env = _grader_env(tmp_path, KF_BWRAP=str(tmp_path / "no" / "bwrap"))
    proc = _kf_eval(tmp_path, ADVERSARIAL / "honest_cpp.py", env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "refusing to evaluate" in lines[0] and "bubblewrap not found" in lines[0]
    assert "--unsafe-no-sandbox" in lines[0]
    assert proc.stdout == ""


def test_box_bwrap_not_on_path_refuses(tmp_path: Path) -> None:
    """With no bwrap on PATH (and no KF_BWRAP), ``kf eval`` refuses and says bwrap is missing."""
    env = _grader_env(tmp_path, PATH=str(tmp_path / "empty-bin"))
    env.pop("KF_BWRAP", None)
    proc = _kf_eval(tmp_path, ADVERSARIAL / "honest_cpp.py", env)
    assert proc.returncode == 2
    assert "bubblewrap (bwrap) is not installed" in proc.stderr


def test_box_failing_probe_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bwrap that cannot start a box (here /bin/false) fails the start-up probe: refused."""
    false = shutil.which("false")
    assert false is not None
    monkeypatch.setenv("KF_BWRAP", false)
    monkeypatch.delenv("KF_UNSAFE_NO_SANDBOX", raising=False)
    box.reset()
    try:
        assert "failed its start-up probe" in str(box.probe())
        with pytest.raises(box.SandboxUnavailable, match="refusing to evaluate"):
            box.mode()
    finally:
        monkeypatch.undo()
        box.reset()


def test_box_unsafe_no_sandbox_runs_and_marks_every_stage(tmp_path: Path) -> None:
    """``--unsafe-no-sandbox`` with no bwrap evaluates, and every stage says it was unboxed."""
    env = _grader_env(tmp_path, KF_BWRAP=str(tmp_path / "no" / "bwrap"))
    proc = _kf_eval(tmp_path, ADVERSARIAL / "honest_cpp.py", env, "--unsafe-no-sandbox")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["correct"]
    assert result["sandbox"] == "unsafe-no-sandbox"
    for stage in ("compile", "verify", "profile"):
        assert result[stage]["sandbox"] == "unsafe-no-sandbox"
    assert box.UNSANDBOXED_FLAG in result["flags"]


def test_box_environment_drops_secrets_even_when_allowed(tmp_path: Path) -> None:
    """Names that look like secrets never reach a runner, even through ``$KF_SANDBOX_ENV``."""
    base = {"PATH": "/usr/bin", "KF_NATS_TOKEN": "x", "OPENAI_API_KEY": "y", "CXX": "g++"}
    old = os.environ.get("KF_SANDBOX_ENV")
    os.environ["KF_SANDBOX_ENV"] = "KF_NATS_TOKEN,OPENAI_API_KEY"
    try:
        env = box.environment(base, tmp_path, {})
    finally:
        if old is None:
            os.environ.pop("KF_SANDBOX_ENV")
        else:
            os.environ["KF_SANDBOX_ENV"] = old
    assert "KF_NATS_TOKEN" not in env and "OPENAI_API_KEY" not in env
    assert env["CXX"] == "g++" and env["HOME"] == str(tmp_path)


@needs_box
def test_box_kf_run_hostile_seed_cannot_forge_the_log(
    tmp_path: Path, listener: socket.socket, cleanup: None
) -> None:
    """In a real ``kf run``, a seed that looks for the run's log among the processes it can
    see finds none, writes nothing into it, reaches no port of 127.0.0.1 (the run's
    embedded nats-server listens on one: the seed fails if it connects anywhere), sees
    no nats-server folder (its configuration holds the run's passwords; the seed fails
    if it does), and leaves no process behind; replay holds."""
    tasks = tmp_path / "tasks"
    (tasks / "seeds").mkdir(parents=True)
    shutil.copy(TASK, tasks / "gelu.py")
    seed = _candidate(tmp_path, report=False, port=listener.getsockname()[1])
    shutil.copy(seed, tasks / "seeds" / "gelu.py")
    db = tmp_path / f"{MARKER}-run.db"  # the forging seed writes only to such a log
    env = _grader_env(tmp_path)
    proc = kf_cli(
        "run", str(tasks), "--budget", "1", "--db", str(db), "--json", env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["tasks"][0]["correct"] >= 1
    assert report["unsandboxed_results"] == 0
    with sqlite3.connect(db) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "forged" not in tables
    assert kf_cli("replay", str(db), "--check", env=env, timeout=600).returncode == 0
    assert _marked_pids() == []
    assert _no_connection(listener)


def test_box_kf_run_unsafe_no_sandbox_marks_the_report(tmp_path: Path) -> None:
    """A ``kf run`` without the box (``KF_UNSAFE_NO_SANDBOX=1``) records every stage as
    unsandboxed, and ``kf report`` says so."""
    tasks = tmp_path / "tasks"
    (tasks / "seeds").mkdir(parents=True)
    search = ROOT / "tests/fixtures/search"
    shutil.copy(search / "scale_relu.py", tasks / "scale_relu.py")
    shutil.copy(search / "seeds" / "scale_relu.py", tasks / "seeds" / "scale_relu.py")
    db = tmp_path / "run.db"
    env = _grader_env(tmp_path, KF_BWRAP=str(tmp_path / "no" / "bwrap"), KF_UNSAFE_NO_SANDBOX="1")
    run = ("run", str(tasks), "--budget", "1", "--db", str(db), "--tune-budget", "0")
    proc = kf_cli(*run, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = kf_cli("report", str(db), env=env, timeout=600)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "UNSANDBOXED: 3 stage result(s)" in shown.stdout, shown.stdout
    assert "unsandboxed: the runners ran outside kf's box" in shown.stdout  # the best's flags
    as_json = json.loads(kf_cli("report", str(db), "--json", env=env, timeout=600).stdout)
    assert as_json["unsandboxed_results"] == 3


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (through /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """The pids still alive once all are gone or ``timeout_s`` has passed."""
    import time

    end = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < end:
        alive = [p for p in alive if Path(f"/proc/{p}").exists() and not _zombie(p)]
        if alive:
            time.sleep(0.05)  # polling a condition, not synchronising on time
    return alive


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@needs_box
def test_box_runner_dies_with_a_killed_grader(tmp_path: Path) -> None:
    """When the grader is killed outright (SIGKILL, no clean-up), its boxed runners and
    everything in their boxes go too (``--die-with-parent``)."""
    grader = (
        "import sys\n"
        "from kf.evaluation.grader.sandbox import RunnerHandle\n"
        "h = RunnerHandle(sys.executable, 1)\n"
        "h.wait_ready()\n"
        "print(h.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = _grader_env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", grader],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        bwrap_pid = int(proc.stdout.readline())
        boxed = [bwrap_pid, *_descendants(bwrap_pid)]
        assert len(boxed) >= 3  # bwrap, bwrap's init in the box, the runner
        proc.kill()
        proc.wait(timeout=30)
        assert _wait_gone(boxed) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@needs_box
def test_box_runner_started_from_a_finished_thread_still_answers() -> None:
    """A runner started from a worker thread that has ended still serves (bwrap's
    parent-death signal follows the starting thread, so kf starts runners from one
    thread that lives as long as the grader)."""
    from concurrent.futures import ThreadPoolExecutor

    from kf.evaluation.grader.sandbox import RunnerHandle
    from kf.evaluation.wire.protocol import Ping, Pong

    def start() -> RunnerHandle:
        started = RunnerHandle(sys.executable, 1)
        started.wait_ready()  # bwrap is long past setting its parent-death signal
        return started

    with ThreadPoolExecutor(max_workers=1) as executor:
        handle = executor.submit(start).result()
    try:  # the executor's thread has ended here
        assert isinstance(handle.request(Ping(), 60.0), Pong)
    finally:
        handle.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid mode is root's")
def test_box_uid_mode_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Root without a pids cgroup gets the uid mode unless ``KF_BOX_UIDS=off`` (the way out
    on a host where running boxes as uids of their own breaks something): then no process
    limit, and the note says which setting chose that."""
    monkeypatch.setenv("KF_BOX_CGROUP", "0")
    monkeypatch.setenv("KF_BOX_UIDS", "off")
    assert box.process_limit() == "none"
    assert "KF_BOX_UIDS=off" in box.process_limit_note()
    monkeypatch.setenv("KF_BOX_UIDS", "2100000000-2100065535")
    from kf.evaluation.grader.box_limits import box_tool

    usable = bool(box_tool("setpriv") and box_tool("prlimit"))
    assert box.wanted_limit() == ("uid" if usable else "none")
