#!/usr/bin/env bash
# The GPU benchmark suite behind docs/benchmarks.md (4x H200: 1-, 2- and 4-stage arms).
# Every table is printed by strata-bench; this script only chooses the arms.
. "$(dirname "$0")/device_env.sh"
SIZES=${SIZES:-8192,16384,32768,65536}
B="python3 -m engine.cli.bench run --model $M --peak-tflops 794 --gpu-order configured"
G1="devices=cuda:0"; G2="devices=cuda:0,cuda:1"; G4="devices=cuda:0,cuda:1,cuda:2,cuda:3"

section "CUDA tests"; python3 -m pytest -q tests/test_cuda.py -s 2>&1 | grep -E "bf16|grouped|passed|failed|Error"
section "profile, 4 layers, one 4096-token chunk"; python3 benchmarks/profile_prefill.py --layers 4 --tokens 4096 2>&1 | grep -v Warn | head -16
section "2 stages, chunk auto, repeat 3"
$B --prompt-tokens $SIZES --repeat 3 --arm "$G1" --arm "$G2 pf_depth=0" --arm "$G2 pf_depth=1" --trace "$OUTDIR/overlap2-64k.json.gz"
section "4 stages, chunk auto, repeat 2"
$B --prompt-tokens $SIZES --repeat 2 --arm "$G1" --arm "$G4 pf_depth=0" --arm "$G4 pf_depth=1" --trace "$OUTDIR/overlap4-64k.json.gz"
section "2 stages at 32K: hand-off peer vs host, prefill-main, events off"
$B --prompt-tokens 32768 --repeat 3 --arm "$G2 handoff=peer" --arm "$G2 handoff=host" --arm "$G2 prefill_main=1"
$B --prompt-tokens 32768 --repeat 3 --arm "$G2" --no-events
for c in 2048 4096 8192; do
  section "2 stages, chunk $c"; $B --prompt-tokens $SIZES --prefill $c --arm "$G1" --arm "$G2 pf_depth=0" --arm "$G2 pf_depth=1"
done
for c in 1024 2048 4096 8192; do
  section "4 stages, chunk $c"; $B --prompt-tokens $SIZES --prefill $c --arm "$G4 pf_depth=0" --arm "$G4 pf_depth=1"
done
