#!/usr/bin/env bash
# The GPU gate: what must pass on a CUDA machine before a change to a CUDA path lands (CI has no
# GPU). Runs, on every visible GPU count (1, and 2 when there are two):
#   1. tests/test_cuda.py and every family's tests/test_*_cuda.py (the executor's apart, in 4)
#   2. the default `strata-bench run` (chunk auto, CUDA graphs on) as a new user types it
#   3. the app's run path (strata_gui.run.run_job, what the Run button drives) without Qt
#   4. the process executor on CUDA (tests/test_executor_cuda.py; GPU_CHECK_EXECUTOR=0 skips it)
# and ends with one verdict line: `GPU CHECK PASSED`, `GPU CHECK FAILED: <what>`, or
# `GPU CHECK INCOMPLETE: <what was not run>` when the deadline came first.
# Each test file and each command is a unit (benchmarks/gate_units.sh): it runs one pytest (with
# its time and its five slowest tests printed), under the time left before GPU_CHECK_DEADLINE
# (seconds, default 540: inside one device call's 600), and is remembered once it passed on this
# tree (a hash of engine/, strata_gui/, tests/, benchmarks/, pyproject.toml and the carried .whl/). A second call on
# the same warm machine then runs only what was cut or failed; the verdict says how many units
# came from earlier calls. Any change to the tree starts from nothing.
# Usage on the device machine (carry .whl with gguf and platformdirs wheels):
#   CHECK_COMMIT=<sha> bash benchmarks/gpu_check.sh     # log: $OUT/gpu-check.log
# (exit 0 passed, 1 failed, 3 incomplete: call again). Keep the log as
# docs/bench/<date>-gpu-check-<kind>.log.
. "$(dirname "$0")/device_env.sh"
. "$(dirname "$0")/gate_units.sh"
LOG="$OUTDIR/gpu-check.log"
exec > >(tee "$LOG") 2>&1
fails=()
step() {  # step NAME CMD...: run, report, remember a failure (a cut is not one: the verdict says it)
  local name=$1; shift
  section "$name"
  echo "\$ $*"
  "$@"; local rc=$?
  if [ $rc -eq 2 ]; then echo "-> not finished: $name (the deadline)"
  elif [ $rc -ne 0 ]; then fails+=("$name (exit $rc)"); echo "-> FAILED: $name (exit $rc)"; else echo "-> ok: $name"; fi
}
cuda_tests() {  # every CUDA test file as its own unit: 0 all passed, 1 one failed, 2 one was cut
  local worst=0 f rc
  for f in "$@"; do
    unit "$f" python3 -m pytest -q -p no:cacheprovider --durations=5 "$f"; rc=$?
    [ $rc -eq 1 ] && worst=1
    [ $rc -eq 2 ] && [ $worst -eq 0 ] && worst=2
  done
  return $worst
}

date -u; nvidia-smi -L 2>&1 || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
COMMIT=${CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "commit $COMMIT"
GATE_PATHS=(engine strata_gui tests benchmarks pyproject.toml); [ -d .whl ] && GATE_PATHS+=(.whl)  # the carried wheels too
gate_start "${GPU_CHECK_STATE:-/tmp/gpu-check-state}" "${GPU_CHECK_DEADLINE:-540}"
echo "tree $GATE_TREE (state $GATE_STATE)"
n=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${n:-0}" -lt 1 ]; then
  echo "GPU CHECK FAILED: no CUDA device visible"; exit 1
fi
DEV_LISTS=("cuda:0"); [ "$n" -ge 2 ] && DEV_LISTS+=("cuda:0,cuda:1")

CUDA_TESTS=(tests/test_cuda.py); for f in tests/test_*_cuda.py; do [ "$f" = tests/test_executor_cuda.py ] || CUDA_TESTS+=("$f"); done
step "CUDA tests" cuda_tests "${CUDA_TESTS[@]}"
for d in "${DEV_LISTS[@]}"; do
  step "default strata-bench run on $d" unit "bench run on $d" python3 -m engine.cli.bench run --model "${CHECK_MODEL:-synthetic:qwen3-30b-a3b:n_layers=16}" \
    --prompt-tokens 8192,32768 --arm "devices=$d" --peak-tflops 794
done
if [ "${GPU_CHECK_EXECUTOR:-1}" = 1 ]; then  # stage processes on CUDA (gloo on one GPU, NCCL on two)
  step "process executor on CUDA" unit tests/test_executor_cuda.py python3 -m pytest -q -p no:cacheprovider tests/test_executor_cuda.py
fi
APP_ARGS=(); for d in "${DEV_LISTS[@]}"; do APP_ARGS+=(--devices "$d"); done
step "app run path on ${DEV_LISTS[*]}" unit "app run path on ${DEV_LISTS[*]}" python3 benchmarks/app_run_check.py "${APP_ARGS[@]}"

section "Units by time (this call)"
printf '%s\n' "${GATE_TIMES[@]}" | sort -rn
echo
if [ ${#fails[@]} -ne 0 ]; then
  msg=$(IFS='; '; echo "${fails[*]}")
  echo "GPU CHECK FAILED: $msg"
  exit 1
elif [ ${#GATE_CUT[@]} -ne 0 ]; then
  msg=$(IFS='; '; echo "${GATE_CUT[*]}")
  echo "GPU CHECK INCOMPLETE: not run or cut by the deadline: $msg (tree $GATE_TREE: call again on the warm machine to resume)"
  exit 3
else
  echo "GPU CHECK PASSED ($n GPU(s): ${CUDA_TESTS[*]}, default strata-bench run, app run path; commit $COMMIT, tree $GATE_TREE, $GATE_RESUMED unit(s) passed in earlier calls)"
fi
