#!/usr/bin/env bash
# llama.cpp's llama-quantize and llama-imatrix for the CPU, built from the llama-cpp-python sdist's
# vendor/llama.cpp (from PyPI) into third_party/llama.cpp-cpu (git-ignored): the independent
# quantiser tests/test_quant_models.py compares against (it skips without one). About 30-60
# minutes on 2 busy cores. Then:
#   STRATA_LLAMA_QUANTIZE=third_party/llama.cpp-cpu/build/bin/llama-quantize \
#     python -m pytest tests/test_quant_models.py -k llama_cpp_quantized
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
DEST=third_party/llama.cpp-cpu
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP"
tar xzf "$TMP"/llama_cpp_python-"$VERSION".tar.gz -C "$TMP"
rm -rf "$DEST"; mkdir -p third_party
mv "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST"
cd "$DEST"
cmake -B build -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build build --target llama-quantize llama-imatrix -j "$(nproc)"
echo "built $DEST/build/bin/llama-quantize and llama-imatrix"
