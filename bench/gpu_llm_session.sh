#!/usr/bin/env bash
# The LLM path on a GPU machine with no package registry (the device tool's H200):
#   bench/gpu_llm_session.sh setup            # wheels from .whl/ into /tmp/site, kf editable
#   bench/gpu_llm_session.sh test OUT         # GPU end-to-end test of the seedless LLM path
#   bench/gpu_llm_session.sh kernelbench OUT  # kf run on three KernelBench level-1 tasks
# (.whl/ is filled on a machine with PyPI, .bwrap/ by scripts/fetch-bwrap-deb: see
# docs/gpu.md, "Running on a registry-less GPU machine"; carry both.)
set -uo pipefail
mode=${1:-setup}
out=${2:-bench-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
if ! python3 -c "import importlib.metadata as m; m.version('kf')" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
fi
command -v nats-server >/dev/null || { echo "nats-server not on PATH"; exit 1; }
# the runner box: a bwrap carried as an unpacked .deb (scripts/fetch-bwrap-deb .bwrap)
if [ -z "${KF_BWRAP:-}" ] && [ -x .bwrap/root/usr/bin/bwrap ]; then
  export KF_BWRAP=$PWD/.bwrap/root/usr/bin/bwrap
fi
case "$mode" in
  setup)
    nvidia-smi -L
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
    ;;
  test)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -x tests/test_llm_gpu.py 2>&1 | tail -25
    ;;
  kernelbench)
    python3 bench/llm_kernelbench.py --kernelbench shared-kb/level1 --out "$out" \
      --timeout "${KB_TIMEOUT:-540}" ${KB_ARGS:-}
    ;;
esac
