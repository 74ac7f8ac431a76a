#!/usr/bin/env bash
# Timing events on vs off, and peer vs host hand-off, on 2 GPUs (docs/benchmarks.md, issue 3).
# --timing prints each stage's copy total (GPU-timed hand-offs) per run on stderr.
. "$(dirname "$0")/device_env.sh"
B="python3 -m engine.cli.bench -v run --model $M --peak-tflops 794 --gpu-order configured --expert-cache all --prompt-tokens ${SIZES:-32768} --prefill ${CHUNK:-1024} --repeat ${REPEAT:-3}"
G2="devices=cuda:0,cuda:1"
section "events on: peer vs host hand-off"
$B --timing --arm "$G2 handoff=peer" --arm "$G2 handoff=host" 2>&1 | grep -E "^\||^# timing|^ +[0-9]+ +cuda|error|Error"
section "events off"
$B --no-events --arm "$G2 handoff=peer" 2>&1 | grep -E "^\||error|Error"
