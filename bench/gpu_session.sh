#!/usr/bin/env bash
# What the GPU figures in README.md came from: run on a machine with an NVIDIA GPU, from
# the repository root, with kf importable (pip install -e . or PYTHONPATH=.).
#   bench/gpu_session.sh check OUT   # tests, kf eval (load_inline)
#   bench/gpu_session.sh final OUT   # bandwidth, kf run, reduced pipeline benchmark
set -uo pipefail
mode=${1:-check}
out=${2:-bench-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ "$mode" = check ]; then
  nvidia-smi -L
  $PY -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)"
  [ "${RUN_TESTS:-1}" = 1 ] && timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "not load_inline" 2>&1 | tail -15
  echo "== kf eval (KernelBench-style load_inline candidate)"
  timeout 150 $PY -m kf.cli eval examples/cuda_tasks/gelu_residual.py \
    examples/cuda_candidates/gelu_residual_load_inline.py --device cuda:0 --json > "$out/eval_load_inline.json"
  echo "exit $?"
else
  echo "== bandwidth"
  timeout 80 $PY bench/gpu_pipeline.py --out "$out" --skip pipeline --skip sequential --configs 1 2>&1 | tail -3
  cp "$out/gpu_pipeline.json" "$out/bandwidth.json"
  echo "== kf run"
  timeout 150 $PY -m kf.cli run examples/cuda_tasks/gelu_residual.py --device cuda:0 \
    --budget "${BUDGET:-3}" --db "$out/run.db" 2>&1 | tail -15
  echo "== pipeline benchmark"
  timeout 330 $PY bench/gpu_pipeline.py --out "$out" --candidates "${CANDIDATES:-16}" \
    --sequential "${SEQ:-2}" --batch 512 --pipeline-timeout 200 --skip bandwidth 2>&1 | tail -8
fi
