#!/usr/bin/env bash
# Files quantized by llama.cpp's own quantizer, for tests and benchmarks (issue 33): a random
# qwen3moe written as F32 by `strata-bench make-model`, then `llama-quantize` (built once by
# scripts/llama_quantize.sh, CPU only, from the llama-cpp-python sdist; ~25-60 min on 2 cores).
#   bash scripts/llamacpp_quant_files.sh tests          # tests/data/qwen3moe-2L-iq3_s.llamacpp.gguf (committed)
#   bash scripts/llamacpp_quant_files.sh cpu-bench DIR   # the 8-layer hidden-1024 Q4_K_M file (~129 MiB)
# LLAMA_QUANTIZE=/path/to/llama-quantize skips the build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
Q=${LLAMA_QUANTIZE:-third_party/llama.cpp-cpu/build/bin/llama-quantize}
[ -x "$Q" ] || bash scripts/llama_quantize.sh  # builds it there (the quantiser tests use the same one)
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
case "${1:-tests}" in
  tests)
    "$PY" -m engine.cli.bench make-model "$TMP/f32.gguf" --arch qwen3moe --layers 2 --hidden 256 --heads 4 --kv-heads 2 \
      --head-dim 64 --experts 4 --experts-used 2 --expert-ffn 256 --quant f32 --seed 7
    "$Q" "$TMP/f32.gguf" tests/data/qwen3moe-2L-iq3_s.llamacpp.gguf IQ3_S
    ;;
  cpu-bench)
    out=${2:?a folder for the file}
    "$PY" -m engine.cli.bench make-model "$TMP/f32.gguf" --arch qwen3moe --layers 8 --hidden 1024 --heads 16 --kv-heads 4 \
      --head-dim 64 --experts 16 --experts-used 4 --expert-ffn 512 --quant f32
    "$Q" "$TMP/f32.gguf" "$out/qwen3moe-8L-h1024-q4_k_m.llamacpp.gguf" Q4_K_M
    ;;
  *) echo "usage: $0 tests | cpu-bench DIR" >&2; exit 2 ;;
esac
