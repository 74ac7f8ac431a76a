#!/usr/bin/env bash
# Issue 33's stream-bound figure in one device call: 16 layers of Qwen3-30B-A3B shapes with a
# 4 GiB expert cache and the arena pinned, IQ3_XXS mix against Q4_K_M (fewer bytes per expert
# should stream faster), with the pinned host->device peak of the same machine measured first.
#   run(command="bash benchmarks/quant_stream.sh", carry=[".whl"])
. "$(dirname "$0")/device_env.sh"
L=${LAYERS:-16}
SIZES=${SIZES:-8192,32768}
section "pinned peak (strata-bench devices --probe)"
python3 -m engine.cli.bench devices --probe
section "streamed prefill, $L layers, 4 GiB expert cache, arena pinned: Q4_K_M vs IQ3_XXS mix"
for q in q4_k_m iq3_xxs; do
  python3 -m engine.cli.bench run -m "synthetic:qwen3-30b-a3b:n_layers=$L,quant=$q" --devices cuda:0 -p "$SIZES" -r 2 \
    --expert-cache 4 --pin-limit-gib 64 -o md -v 2>&1 | grep -E "^\| |copy|GB/s|stream" | grep -v "^|---"
done
