#!/usr/bin/env bash
# Issues 32 and 33 on one device call: decode (tg) and the new quant types against llama.cpp's
# CUDA llama-bench on the same files, the dequantiser per new type, the routed-experts switch
# point, and resident prefill of an IQ3_XXS mix against F16.  llama-bench builds in the
# background (third_party/llama.cpp, benchmarks/llamacpp_source.sh) while the GPU-only parts run.
#   run(command="bash benchmarks/decode_quant_device.sh", carry=[".whl", "third_party/llama.cpp"])
. "$(dirname "$0")/device_env.sh"
L=${LAYERS:-16}
Q4=/tmp/q4km-${L}L.gguf IQ=/tmp/iq3s-${L}L.gguf
BUILD=/tmp/llama-build
section "make-model ($L layers: q4_k_m and iq3_s) and the llama-bench build, in the background"
( python3 -m engine.cli.bench make-model "$Q4" --preset qwen3-30b-a3b --layers "$L" --quant q4_k_m > /tmp/mm-q4.log 2>&1 ) &
M1=$!
( python3 -m engine.cli.bench make-model "$IQ" --preset qwen3-30b-a3b --layers "$L" --quant iq3_s > /tmp/mm-iq.log 2>&1 ) &
M2=$!
( cmake -S third_party/llama.cpp -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF > /tmp/llama-cmake.log 2>&1 && cmake --build "$BUILD" --target llama-bench -j 12 \
    > /tmp/llama-build.log 2>&1; echo "build rc $?" >> /tmp/llama-build.log ) &
B=$!
section "dequantiser: the new types (torch path on CUDA) against the write ceiling"
python3 benchmarks/dequant_bench.py --types low-bit --repeat 10 2>&1 | tail -25
section "routed experts: full vs compact expansion (the switch point)"
python3 benchmarks/routed_experts_bench.py --device cuda:0 --repeat 10 2>&1 | tail -20
section "resident prefill, $L layers: IQ3_XXS mix vs F16 (synthetic, experts resident)"
for q in f16 iq3_xxs; do
  python3 -m engine.cli.bench run -m "synthetic:qwen3-30b-a3b:n_layers=$L,quant=$q" --devices cuda:0 -p 8192,32768 -r 2 \
    --expert-cache all -o md 2>&1 | grep -E "^\| |^kernels" | grep -v "^|---"
done
wait $M1 $M2; tail -1 /tmp/mm-q4.log /tmp/mm-iq.log
wait $B; tail -3 /tmp/llama-build.log
for g in 1 0; do  # each stage's decode step as one CUDA graph, and eager (benchmarks/decode_graph_device.sh: more)
  section "decode, ours, --cuda-graphs $g: $Q4 (-p 0 and 4096, -n 128) and bf16 weights"
  python3 -m engine.cli.bench run -m "$Q4" --devices cuda:0 -p 0,4096 -n 128 -r 2 --expert-cache all --cuda-graphs $g \
    -o md 2>&1 | grep -E "^\| |^roofline|^decode" | grep -v "^|---"
  python3 -m engine.cli.bench run -m "synthetic:qwen3-30b-a3b:n_layers=$L" --devices cuda:0 -p 0,4096 -n 128 -r 2 \
    --cuda-graphs $g -o md 2>&1 | grep -E "^\| |^roofline|^decode" | grep -v "^|---"
done
section "prefill, ours: $IQ"
python3 -m engine.cli.bench run -m "$IQ" --devices cuda:0 -p 8192,32768 -r 2 --expert-cache all -o md 2>&1 | grep -E "^\| |^kernels" | grep -v "^|---"
if [ -x "$BUILD/bin/llama-bench" ]; then
  section "llama.cpp llama-bench (CUDA, flash attention, all layers on the GPU)"
  "$BUILD/bin/llama-bench" -m "$Q4" -p 0 -n 128 -d 0,4096 -fa 1 -ngl 99 -r 2 -o md 2>&1 | grep -E "^\|"
  "$BUILD/bin/llama-bench" -m "$IQ" -p 8192,32768 -n 0 -fa 1 -ngl 99 -r 2 -b 8192 -ub 4096 -o md 2>&1 | grep -E "^\|"
fi
