#!/usr/bin/env bash
# llama.cpp's source for benchmarks/vs_llamacpp.sh, small enough to travel to the device machine:
# the llama-cpp-python sdist's vendor/llama.cpp (from PyPI), without models/, docs/, tests, the
# other tools and the non-CUDA GPU backends (~176 MB -> ~20 MB). Writes third_party/llama.cpp
# (git-ignored); carry it to the device: run(carry=["third_party/llama.cpp"]).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON:-0.3.36}
DEST=third_party/llama.cpp
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$TMP"
tar xzf "$TMP"/llama_cpp_python-"$VERSION".tar.gz -C "$TMP"
rm -rf "$DEST"; mkdir -p third_party
mv "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST"
cd "$DEST"
rm -rf models docs media benches tests conversion gguf-py examples scripts .github
find tools -mindepth 1 -maxdepth 1 -type d ! -name llama-bench -exec rm -rf {} +
printf 'add_subdirectory(llama-bench)\n' > tools/CMakeLists.txt
for d in ggml/src/ggml-*/; do
  case "$(basename "$d")" in ggml-cuda|ggml-cpu) ;; *) rm -rf "$d" ;; esac
done
echo "llama.cpp from llama-cpp-python $VERSION in $DEST: $(du -sh . | cut -f1)"
