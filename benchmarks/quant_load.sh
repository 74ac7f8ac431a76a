#!/usr/bin/env bash
# Issue 17 on one GPU: a Q4_K_M file (Qwen3-30B-A3B shapes, fewer layers) loads from page cache at
# >= 1 GB/s of file, experts resident or streamed as stored; then a prefill on the quantized
# weights (file, and blocks generated on the device at full shapes).
. "$(dirname "$0")/device_env.sh"
F=${QFILE:-/tmp/q4km-${LAYERS:-8}L.gguf}
section "write $F (q4_k_m, ${LAYERS:-8} layers)"
[ -f "$F" ] || python3 -m engine.cli.bench make-model "$F" --preset qwen3-30b-a3b --layers "${LAYERS:-8}" --quant q4_k_m
cat "$F" > /dev/null  # into the page cache: the target is a load from page cache
section "load: experts resident"
python3 -m engine.cli.bench load --model "$F" --devices cuda:0 --expert-cache all
section "load: experts streamed (2 GiB cache, 8 GiB pinned)"
python3 -m engine.cli.bench load --model "$F" --devices cuda:0 --expert-cache 2 --pin-limit-gib 8
section "prefill on the file's blocks"
python3 -m engine.cli.bench run --model "$F" --devices cuda:0 --prompt-tokens 8192 --prefill 2048 --expert-cache all \
  --peak-tflops 794 2>&1 | grep -E "^\||loaded|error|Error"
section "prefill on blocks generated on the device (full shapes, 48 layers)"
python3 -m engine.cli.bench run --model synthetic:qwen3-30b-a3b:quant=q4_k_m --devices cuda:0 --prompt-tokens 8192 \
  --prefill 2048 --peak-tflops 794 2>&1 | grep -E "^\||loaded|error|Error"
