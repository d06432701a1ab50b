#!/usr/bin/env bash
# One device call's worth of GPU checks, each step under its own time limit, every output
# in OUT (at most 8 files come back from the device tool, so the steps share a few):
#   bench/gpu_check.sh OUT tests       # GPU tests, then the boxed LLM end-to-end test
#   bench/gpu_check.sh OUT gpu|llm     # only the GPU tests, or only the LLM end-to-end test
#   bench/gpu_check.sh OUT ipc         # the unboxed IPC test alone, with its own limit
#   bench/gpu_check.sh OUT memory      # bench/kernelbench_memory.py on shared-kb/mem
#   bench/gpu_check.sh OUT trust       # bench/trust_table.py and bench/transport.py on cuda:0
#   bench/gpu_check.sh OUT kernelbench # kf run on shared-kb/level1 with the scripted LLM
#   bench/gpu_check.sh OUT kbtable     # bench/kernelbench.py on shared-kb/kb/<level>, resumable
#   bench/gpu_check.sh OUT throughput  # bench/throughput_gpu.py: candidates per minute, its
#                                      # log kept as OUT/throughput_<layout>.db and replayed
#                                      # (--check); throughput-split / throughput-torch name
#                                      # the layout
#   bench/gpu_check.sh OUT box         # the box's probe and its process-limit mode
#   bench/gpu_check.sh OUT phases      # bench/build_phases.py: one build at a time, alone
#   bench/gpu_check.sh OUT extract     # bench/extract_gpu.py: the bf16 decoder block's tasks
#   bench/gpu_check.sh OUT model       # bench/model_gpu.py: extract, run, patch, check the block
#   bench/gpu_check.sh OUT seeds       # the same with the developer-written seeds of
#                                      # bench/seeds/decoder_block (offline mutator, tuned)
#   bench/gpu_check.sh OUT venv        # the carried wheels and kf into the image's own python,
#                                      # so tests' subprocesses (which set their own PYTHONPATH)
#                                      # import everything
#   bench/gpu_check.sh OUT venv boxtests  # then the box's hostile-candidate and uid-mode tests,
#                                      # stop mid-build, torch-free and counters on the GPU
# Sets up like bench/gpu_llm_session.sh (carry .whl, .bwrap and shared-kb). A run's log
# is copied with SQLite's backup API: a plain copy of a log in WAL mode can be empty.
set -uo pipefail
out=${1:?OUT}
shift
mkdir -p "$out"
bash bench/gpu_llm_session.sh setup "$out" > "$out/setup.txt" 2>&1 || { cat "$out/setup.txt"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
[ -x .bwrap/root/usr/bin/bwrap ] && export KF_BWRAP=$PWD/.bwrap/root/usr/bin/bwrap
step() {  # step NAME LIMIT_S COMMAND...: run, note the status and seconds, keep the tail
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}
backup() {  # backup DB DEST: a consistent copy of a SQLite file in WAL mode
  python3 -c "import sqlite3,sys; s=sqlite3.connect(sys.argv[1]); d=sqlite3.connect(sys.argv[2]); s.backup(d); d.close()" "$1" "$2" 2>/dev/null
}
for what in "$@"; do
  case "$what" in
    tests|gpu|llm)
      # -v: a step killed by its limit still names the tests that ran; each test 120 s;
      # the IPC comparison has its own step (ipc)
      [ "$what" != llm ] && step gputests 240 python3 -m pytest -v -p no:cacheprovider --timeout 120 -rfE \
        tests/test_cuda.py tests/test_adversarial_gpu.py tests/test_device_inputs.py \
        --deselect tests/test_cuda.py::test_cuda_verification_over_ipc_matches_bytes_and_still_rejects
      [ "$what" != gpu ] && step llm_gpu 330 python3 -m pytest -v -x -p no:cacheprovider --basetemp=/tmp/bt \
        tests/test_llm_gpu.py
      [ -f /tmp/bt/llmgpu0/run.db ] && backup /tmp/bt/llmgpu0/run.db "$out/llm.db"
      ;;
    ipc)  # the unboxed IPC comparison alone (it outlasted the tests step's limit)
      step ipc "${IPC_LIMIT:-300}" env KF_UNSAFE_NO_SANDBOX=1 python3 -m pytest -v -p no:cacheprovider \
        --timeout "${IPC_LIMIT:-300}" --durations=5 \
        "tests/test_cuda.py::test_cuda_verification_over_ipc_matches_bytes_and_still_rejects"
      ;;
    memory)
      # MEM_TASKS (shared-kb/mem/*.py), MEM_LIMIT (560 s), MEM_TIMEOUT (300 s an eval)
      # env, not a prefix assignment: before a shell function a prefix can outlive the call
      step memory "${MEM_LIMIT:-560}" env KF_COMPILE_BASELINE=0 python3 bench/kernelbench_memory.py \
        ${MEM_TASKS:-shared-kb/mem/*.py} --timeout "${MEM_TIMEOUT:-300}" --out "$out/memory.json"
      ;;
    trust)
      step trust "${TRUST_LIMIT:-300}" python3 bench/trust_table.py --device cuda:0 --out "$out/trust.json"
      [ "${TRUST_TRANSPORT:-1}" = 1 ] && step transport 240 python3 bench/transport.py --device cuda:0 --mb 256 --repeat 1 \
        --out "$out/transport.json"
      ;;
    kernelbench)
      # KB_LIMIT (540 s) and KB_ARGS (more bench/llm_kernelbench.py options)
      step kernelbench "${KB_LIMIT:-540}" python3 bench/llm_kernelbench.py \
        --kernelbench shared-kb/level1 --out "$out/kb" --timeout "$(( ${KB_LIMIT:-540} - 40 ))" \
        ${KB_ARGS:-}
      [ -f "$out/kb/kernelbench_llm.db" ] && backup "$out/kb/kernelbench_llm.db" "$out/kb.db" \
        && rm -rf "$out/kb/kernelbench_tasks" "$out/kb/kernelbench_llm.db"*
      ;;
    kbtable)
      # bench/kernelbench.py's harness check (each reference as its own candidate, eager and
      # torch.compile baselines) on KBT_LEVEL (level1) tasks KBT_TASKS (1-10), stopped after
      # KBT_WALL s (480); a log brought back before (runs/kbt-<level>/kernelbench.db,
      # carried) is resumed, and the log comes back as OUT/kbt-<level>.db
      lvl=${KBT_LEVEL:-level1}
      mkdir -p "$out/kbt"
      [ -f "runs/kbt-$lvl/kernelbench.db" ] && backup "runs/kbt-$lvl/kernelbench.db" "$out/kbt/kernelbench.db"
      step "kbt-$lvl" $(( ${KBT_WALL:-480} + 90 )) python3 bench/kernelbench.py "shared-kb/kb/$lvl" \
        --tasks "${KBT_TASKS:-1-10}" --device cuda:0 --out "$out/kbt" --wall "${KBT_WALL:-480}" --resume
      [ -f "$out/kbt/kernelbench.db" ] && backup "$out/kbt/kernelbench.db" "$out/kbt-$lvl.db" \
        && rm -f "$out/kbt/kernelbench.db"*
      ;;
    throughput|throughput-split|throughput-torch)
      # TP_LAYOUT (split), TP_BUDGET (6 a task), TP_LIMIT (480 s), TP_ARGS: candidates per
      # minute of kf run on shared-kb/kb/level1's elementwise tasks at v0 sizes;
      # throughput-split and throughput-torch name the layout, so one call runs both
      lay=${TP_LAYOUT:-split}
      [ "$what" != throughput ] && lay=${what#throughput-}
      step "throughput-$lay" "${TP_LIMIT:-480}" python3 bench/throughput_gpu.py \
        --kernelbench shared-kb/kb/level1 --out "$out/tp" --layout "$lay" \
        --budget "${TP_BUDGET:-6}" --timeout "$(( ${TP_LIMIT:-480} - 30 ))" ${TP_ARGS:-}
      cp "$out/tp/throughput_gpu_$lay.json" "$out/" 2>/dev/null
      [ -f "$out/tp/throughput_$lay.db" ] && backup "$out/tp/throughput_$lay.db" "$out/throughput_$lay.db" \
        && step "replay-$lay" 120 python3 -m kf.app.cli replay --check "$out/throughput_$lay.db"
      rm -rf "$out/tp"
      ;;
    venv)
      # without PYTHONPATH: pip otherwise finds the wheels' packages in /tmp/site already
      # and installs nothing (a test's subprocess with its own PYTHONPATH then lacked them)
      step venv 180 env -u PYTHONPATH bash -c 'python3 -m pip install -q --no-index --no-deps \
        --no-compile .whl/*.whl && python3 -m pip install -q --no-index --no-deps \
        --no-build-isolation -e . && python3 -c "import structlog, nats, msgspec, kf; print(kf.__file__)"'
      ;;
    boxtests)
      # --tb=short and -rfE: a failure's reason comes back even when the step is cut off
      # BOX_TESTS (space-separated node ids) replaces the list
      step boxtests "${BOX_LIMIT:-420}" python3 -m pytest -v -p no:cacheprovider --timeout 200 -rfE \
        --tb=short ${BOX_TESTS:-tests/test_sandbox_box.py::test_box_hostile_candidate_finds_nothing_to_take \
        tests/test_sandbox_box.py::test_box_uid_mode_builds_and_runs_a_cuda_kernel \
        tests/test_cuda_torchfree.py::test_both_builds_compute_the_same \
        tests/test_counters.py::test_collector_checks_the_output_at_the_runs_recorded_tolerance_on_a_gpu \
        tests/test_stop.py::test_stop_kf_run_mid_load_inline_build_on_the_gpu}
      ;;
    box)
      step box 60 python3 -c "from kf.evaluation.grader import box; print(box.probe() or 'the box works'); print(box.process_limit_note())"
      ;;
    phases)
      step phases "${BP_LIMIT:-300}" python3 bench/build_phases.py --out "$out/bp"
      cp "$out/bp/"*.json "$out/" 2>/dev/null
      rm -rf "$out/bp"
      ;;
    extract)
      # bench/extract_gpu.py: kf extract on the bf16 decoder block (hidden 4096, seq 2048
      # and 1024), coverage by <= 6 tasks, each task run end to end (scripted answers)
      step extract "${EX_LIMIT:-420}" python3 bench/extract_gpu.py --out "$out/ex" --device cuda:0 \
        --top 6 --budget "${EX_BUDGET:-2}"
      cp "$out/ex/extract_gpu.json" "$out/" 2>/dev/null
      rm -rf "$out/ex"
      ;;
    model)
      # bench/model_gpu.py: extract, run, export --model, check-model on the bf16 block;
      # MODEL_ARGS (e.g. --min-speedup 0) passes on
      step model "${MODEL_LIMIT:-540}" python3 bench/model_gpu.py --out "$out/mg" --device cuda:0 \
        ${MODEL_ARGS:-}
      cp "$out/mg/check.json" "$out/mg/model_gpu.json" "$out/" 2>/dev/null
      rm -rf "$out/mg"
      ;;
    seeds)
      # the same with the developer-written seeds of bench/seeds/decoder_block (not a
      # model's): kf's offline mutator runs and tunes them; SEEDS_ARGS passes on
      step seeds "${SEEDS_LIMIT:-580}" python3 bench/model_gpu.py --out "$out/ms" --device cuda:0 \
        --seeds bench/seeds/decoder_block --budget "${SEEDS_BUDGET:-8}" ${SEEDS_ARGS:-}
      cp "$out/ms/check.json" "$out/check_seeds.json" 2>/dev/null
      cp "$out/ms/model_gpu.json" "$out/model_gpu_seeds.json" 2>/dev/null
      rm -rf "$out/ms"
      ;;
    *) echo "unknown step $what" >&2 ;;
  esac
done
tail -n 40 "$out"/summary.txt
