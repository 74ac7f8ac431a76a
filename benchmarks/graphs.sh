#!/usr/bin/env bash
# CUDA graphs on vs off: the CUDA tests, then one GPU vs 2-stage join/overlap (docs/benchmarks.md).
. "$(dirname "$0")/device_env.sh"
SIZES=${SIZES:-32768,65536}
CHUNKS=${CHUNKS:-2048}
B="python3 -m engine.cli.bench run --model $M --peak-tflops 794 --gpu-order configured"
G1="devices=cuda:0"; G2="devices=cuda:0,cuda:1"
if [ -z "${SKIP_TESTS:-}" ]; then
  section "CUDA tests"; python3 -m pytest -q tests/test_cuda.py -s 2>&1 | grep -E "bf16|grouped|passed|failed|Error|assert" | head -40
fi
# arms of one invocation hold their weights at once: a 1-GPU arm takes the whole model on cuda:0,
# so each 1-GPU arm runs on its own and the three 2-GPU arms together
T="--prompt-tokens $SIZES --repeat 2 --timing"
F='^INFO (engine|strata)\.(topology|experts)'
for c in ${CHUNKS//,/ }; do
  section "chunk $c: one GPU, graphs off"; $B $T --prefill $c --arm "$G1 cuda_graphs=0" 2>&1 | grep -vE "$F"
  section "chunk $c: one GPU, graphs on"; $B $T --prefill $c --arm "$G1" 2>&1 | grep -vE "$F"
  section "chunk $c: two GPUs"
  $B $T --prefill $c --arm "$G2 pf_depth=1 cuda_graphs=0" --arm "$G2 pf_depth=0" --arm "$G2 pf_depth=1" \
     --trace "$OUTDIR/overlap2-graphs-$c.json.gz" 2>&1 | grep -vE "$F"
done
