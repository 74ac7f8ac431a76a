#!/usr/bin/env bash
# One GPU vs 2-stage join vs 2-stage overlap, per chunk schedule (docs/benchmarks.md, issue 3).
# Each invocation holds its arms' weights at once; expert_cache=all keeps every expert resident
# (the auto cache would leave a later arm too little room and stream).
. "$(dirname "$0")/device_env.sh"
SIZES=${SIZES:-8192,16384,32768,65536}
B="python3 -m engine.cli.bench -v run --model $M --peak-tflops 794 --gpu-order configured --expert-cache all --prompt-tokens $SIZES --repeat ${REPEAT:-2}"
G1="devices=cuda:0"; G2="devices=cuda:0,cuda:1"
if [ -z "${SKIP_TESTS:-}" ]; then
  section "CUDA tests"; python3 -m pytest -q tests/test_cuda.py -s 2>&1 | grep -E "bf16|grouped|passed|failed|Error|assert" | head -40
fi
for c in ${CHUNKS:-2048}; do
  for sched in ${SCHEDULES-fixed balanced}; do
    section "chunk $c, schedule $sched"
    $B --prefill $c --chunk-schedule $sched --arm "$G1" --arm "$G2 pf_depth=0" --arm "$G2 pf_depth=1" \
       --trace "$OUTDIR/overlap2-$sched-$c.json.gz" 2>&1 | grep -E "^\||chunk cost|error|Error"
  done
done
[ -n "${SKIP_AUTO:-}" ] && exit 0
section "chunk auto"
$B --arm "$G1" --arm "$G2 pf_depth=0" --arm "$G2 pf_depth=1" 2>&1 | grep -E "^\||chunk cost|auto:|error|Error"
