#!/usr/bin/env bash
# The GPU gate: what must pass on a CUDA machine before a change to a CUDA path lands (CI has no
# GPU). Runs, on every visible GPU count (1, and 2 when there are two):
#   1. tests/test_cuda.py, tests/test_hybrid_cuda.py (Qwen3-Next, Qwen3.5-MoE)
#   2. the default `strata-bench run` (chunk auto, CUDA graphs on) as a new user types it
#   3. the app's run path (strata_gui.run.run_job, what the Run button drives) without Qt
#   4. the process executor on CUDA (tests/test_executor_cuda.py; GPU_CHECK_EXECUTOR=0 skips it)
# and ends with one verdict line: `GPU CHECK PASSED` or `GPU CHECK FAILED: <what>`.
# Usage on the device machine (carry .whl with gguf and platformdirs wheels):
#   CHECK_COMMIT=<sha> bash benchmarks/gpu_check.sh     # log: $OUT/gpu-check.log
# Keep the log as docs/bench/<date>-gpu-check-<kind>.log.
. "$(dirname "$0")/device_env.sh"
LOG="$OUTDIR/gpu-check.log"
exec > >(tee "$LOG") 2>&1
fails=()
step() {  # step NAME CMD...: run, report, remember a failure
  local name=$1; shift
  section "$name"
  echo "\$ $*"
  "$@"; local rc=$?
  if [ $rc -ne 0 ]; then fails+=("$name (exit $rc)"); echo "-> FAILED: $name (exit $rc)"; else echo "-> ok: $name"; fi
}

date -u; nvidia-smi -L 2>&1 || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
COMMIT=${CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "commit $COMMIT"
n=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${n:-0}" -lt 1 ]; then
  echo "GPU CHECK FAILED: no CUDA device visible"; exit 1
fi
DEV_LISTS=("cuda:0"); [ "$n" -ge 2 ] && DEV_LISTS+=("cuda:0,cuda:1")

step "CUDA tests" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_hybrid_cuda.py
for d in "${DEV_LISTS[@]}"; do
  step "default strata-bench run on $d" python3 -m engine.cli.bench run --model "${CHECK_MODEL:-synthetic:qwen3-30b-a3b:n_layers=16}" \
    --prompt-tokens 8192,32768 --arm "devices=$d" --peak-tflops 794
done
if [ "${GPU_CHECK_EXECUTOR:-1}" = 1 ]; then  # stage processes on CUDA (gloo on one GPU, NCCL on two)
  step "process executor on CUDA" python3 -m pytest -q -p no:cacheprovider tests/test_executor_cuda.py
fi
APP_ARGS=(); for d in "${DEV_LISTS[@]}"; do APP_ARGS+=(--devices "$d"); done
step "app run path on ${DEV_LISTS[*]}" python3 benchmarks/app_run_check.py "${APP_ARGS[@]}"

echo
if [ ${#fails[@]} -eq 0 ]; then
  echo "GPU CHECK PASSED ($n GPU(s): tests/test_cuda.py, default strata-bench run, app run path; commit $COMMIT)"
else
  msg=$(IFS='; '; echo "${fails[*]}")
  echo "GPU CHECK FAILED: $msg"
  exit 1
fi
