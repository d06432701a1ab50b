"""What the test suite's time goes to, file by file: wall seconds against CPU seconds.

Run the suite with ``KF_TEST_PROFILE=/tmp/prof scripts/test`` (tests/conftest.py then
writes one JSON line per test to ``/tmp/prof.<worker>.jsonl``: its wall seconds, setup to
teardown, and the CPU seconds of the pytest worker and the children it reaped meanwhile),
then ``python bench/suite_profile.py /tmp/prof``. A file whose CPU seconds are far below
its wall seconds waits (on timeouts, polls, other processes' work it does not reap, or
the other worker's load); one near or above computes (builds, whole runs on both cores).
Children still running at a test's end (a module's shared nats-server, say) are counted
by the test that reaps them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prefix", help="the $KF_TEST_PROFILE prefix of the run")
    ap.add_argument("--top", type=int, default=30, help="files shown, by wall seconds")
    args = ap.parse_args()
    rows = [
        json.loads(line)
        for path in sorted(glob.glob(f"{args.prefix}.*.jsonl"))
        for line in Path(path).read_text().splitlines()
        if line.strip()
    ]
    if not rows:
        print(f"no lines at {args.prefix}.*.jsonl: run the suite with KF_TEST_PROFILE set")
        return 1
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    workers: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        f = files[row["file"]]
        f[0] += row["wall_s"]
        f[1] += row["cpu_s"]
        f[2] += 1
        workers[row["worker"]][0] += row["wall_s"]
        workers[row["worker"]][1] += row["cpu_s"]
    wall = sum(r["wall_s"] for r in rows)
    cpu = sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} tests in {len(files)} files: {wall:.0f} test-wall s, {cpu:.0f} CPU s")
    for name, (w, c) in sorted(workers.items()):
        print(f"  worker {name}: {w:.0f} wall s, {c:.0f} CPU s ({c / max(w, 1e-9):.0%})")
    print(f"\n{'file':44} {'tests':>5} {'wall s':>8} {'CPU s':>8} {'CPU/wall':>8}")
    for name, (w, c, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{name:44} {int(n):5d} {w:8.1f} {c:8.1f} {c / max(w, 1e-9):8.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
