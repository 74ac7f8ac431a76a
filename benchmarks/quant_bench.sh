#!/usr/bin/env bash
# Issue 17's GPU figures in one call (one H200): prefill on bf16 vs Q8_0 vs Q4_K_M experts
# (Qwen3-30B-A3B shapes, 16 layers, blocks generated on the device), every expert resident and
# then streamed through a 4 GiB cache with the whole arena pinned; then the load rate and host
# RSS of a Q4_K_M file written on the device's disk.
. "$(dirname "$0")/device_env.sh"
L=${LAYERS:-16}
section "8K one GPU: default, then each Triton kernel off (is a fixed per-run cost in one of them?)"
for env in "" "STRATA_QK_KERNEL=torch" "STRATA_MOE_KERNELS=torch"; do
  echo "-- ${env:-default}"
  env $env python3 -m engine.cli.bench run --model "synthetic:qwen3-30b-a3b:n_layers=$L" --devices cuda:0 \
    --prompt-tokens 8192 --repeat 3 --peak-tflops 794 2>&1 | grep -E "^\| dev|^model:|error|Error"
done
SIZES=${SIZES:-8192,32768}
B="python3 -m engine.cli.bench run --peak-tflops 794 --prompt-tokens $SIZES --repeat 2"
for q in f16 q8_0 q4_k_m; do
  section "resident experts, $q ($L layers)"
  $B --model "synthetic:qwen3-30b-a3b:n_layers=$L,quant=$q" --devices cuda:0 --expert-cache all 2>&1 \
    | grep -E "^\||error|Error"
done
for q in f16 q4_k_m; do
  section "streamed experts, $q: 4 GiB cache, whole arena pinned"
  $B --model "synthetic:qwen3-30b-a3b:n_layers=$L,quant=$q" --devices cuda:0 --expert-cache 4 --pin-limit-gib 100 \
    --timing 2>&1 | grep -E "^\||GB/s|error|Error|VRAM|expert"
done
python3 - <<'EOF'
import torch
free, total = torch.cuda.mem_get_info(0)
print(f"VRAM now: {(total - free) / 2**30:.1f} GiB used of {total / 2**30:.1f}")
EOF
timed() {  # wall time and peak RSS of a command (no /usr/bin/time on the device image)
  python3 -c 'import resource, subprocess, sys, time
t = time.time(); rc = subprocess.run(sys.argv[1:]).returncode
print(f"elapsed {time.time() - t:.2f} s, peak RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20:.2f} GiB, rc {rc}")' "$@"
}
F=/tmp/q4km-${FILE_LAYERS:-16}L.gguf
section "write $F (q4_k_m, ${FILE_LAYERS:-16} layers) and load it from page cache"
[ -f "$F" ] || timed python3 -m engine.cli.bench make-model "$F" --preset qwen3-30b-a3b --layers "${FILE_LAYERS:-16}" \
  --quant q4_k_m
ls -l "$F"; cat "$F" > /dev/null
timed python3 -m engine.cli.bench load --model "$F" --devices cuda:0 --expert-cache all 2>/dev/null
timed python3 -m engine.cli.bench load --model "$F" --devices cuda:0 --expert-cache 2 --pin-limit-gib 8 2>/dev/null
