#!/usr/bin/env bash
# Files quantized by llama.cpp's own quantizer, for tests and benchmarks (issue 33): a random
# qwen3moe written as F32 by `strata-bench make-model`, then `llama-quantize` (built here, CPU
# only, from the llama-cpp-python sdist's vendor/llama.cpp; ~25-40 min on 2 cores, once).
#   bash scripts/llamacpp_quant_files.sh tests          # tests/data/qwen3moe-2L-iq3_s.llamacpp.gguf (committed)
#   bash scripts/llamacpp_quant_files.sh cpu-bench DIR   # the 8-layer hidden-1024 Q4_K_M file (~129 MiB)
# LLAMA_QUANTIZE=/path/to/llama-quantize skips the build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
build_quantize() {
  local src=${LLAMA_SRC:-/tmp/llama-cpp-src}
  if [ ! -x "$src/build/bin/llama-quantize" ]; then
    mkdir -p "$src"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$src"
    tar xzf "$src/llama_cpp_python-$VERSION.tar.gz" -C "$src"
    local tree="$src/llama_cpp_python-$VERSION/vendor/llama.cpp"
    cmake -S "$tree" -B "$src/build" -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release > "$src/cmake.log"
    cmake --build "$src/build" --target llama-quantize -j "$(nproc)" > "$src/build.log"
  fi
  echo "$src/build/bin/llama-quantize"
}
Q=${LLAMA_QUANTIZE:-$(build_quantize)}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
case "${1:-tests}" in
  tests)
    "$PY" -m engine.bench make-model "$TMP/f32.gguf" --arch qwen3moe --layers 2 --hidden 256 --heads 4 --kv-heads 2 \
      --head-dim 64 --experts 4 --experts-used 2 --expert-ffn 256 --quant f32 --seed 7
    "$Q" "$TMP/f32.gguf" tests/data/qwen3moe-2L-iq3_s.llamacpp.gguf IQ3_S
    ;;
  cpu-bench)
    out=${2:?a folder for the file}
    "$PY" -m engine.bench make-model "$TMP/f32.gguf" --arch qwen3moe --layers 8 --hidden 1024 --heads 16 --kv-heads 4 \
      --head-dim 64 --experts 16 --experts-used 4 --expert-ffn 512 --quant f32
    "$Q" "$TMP/f32.gguf" "$out/qwen3moe-8L-h1024-q4_k_m.llamacpp.gguf" Q4_K_M
    ;;
  *) echo "usage: $0 tests | cpu-bench DIR" >&2; exit 2 ;;
esac
