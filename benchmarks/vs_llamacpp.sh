#!/usr/bin/env bash
# Issue 17's bar in one device call: llama.cpp's own llama-bench (built here with CUDA from
# third_party/llama.cpp, see benchmarks/llamacpp_source.sh) and our engine prefilling the same
# Q4_K_M file (Qwen3-30B-A3B shapes, LAYERS layers, written by `strata-bench make-model`), at
# 8K and 32K.  llama.cpp runs with flash attention and all layers on the GPU, at its default
# batch and at -b 8192 -ub 4096; its best counts.  Prints one table: ours / llama.cpp.
#   run(command="bash benchmarks/vs_llamacpp.sh", carry=[".whl", "third_party/llama.cpp"])
. "$(dirname "$0")/device_env.sh"
L=${LAYERS:-16}  # the issue-17 shape; make-model writes it in about a minute (2026-12-01: ~127 MB/s)
SIZES=${SIZES:-8192,32768}
F=/tmp/q4km-${L}L.gguf
BUILD=/tmp/llama-build
[ -d third_party/llama.cpp ] || { echo "third_party/llama.cpp missing: run benchmarks/llamacpp_source.sh and carry it"; exit 2; }
section "write $F in the background (q4_k_m, $L layers) while llama-bench builds"
( [ -f "$F" ] || python3 -m engine.cli.bench make-model "$F" --preset qwen3-30b-a3b --layers "$L" --quant q4_k_m \
    > /tmp/make-model.log 2>&1 ) &
MAKER=$!
section "build llama-bench (CUDA, sm_90)"
t0=$(date +%s)
cmake -S third_party/llama.cpp -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF > /tmp/llama-cmake.log 2>&1 || { tail -30 /tmp/llama-cmake.log; exit 1; }
cmake --build "$BUILD" --target llama-bench -j "$(nproc)" > /tmp/llama-build.log 2>&1 || { tail -30 /tmp/llama-build.log; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s: $(nvcc --version | tail -1)"
wait $MAKER || { cat /tmp/make-model.log; exit 1; }
ls -l "$F"
section "llama.cpp llama-bench"
LB="$BUILD/bin/llama-bench -m $F -p $SIZES -n 0 -fa 1 -ngl 99 -r 3 -o json"
$LB > /tmp/lb-default.json 2>/tmp/lb-default.err || tail -20 /tmp/lb-default.err
$LB -b 8192 -ub 4096 > /tmp/lb-big.json 2>/tmp/lb-big.err || tail -20 /tmp/lb-big.err
section "ours (strata-bench run, chunk auto, experts resident)"
python3 -m engine.cli.bench run -m "$F" --devices cuda:0 -p "$SIZES" -r 3 --expert-cache all \
  -o json > /tmp/ours.json 2>/tmp/ours.err || tail -20 /tmp/ours.err
cp /tmp/lb-*.json /tmp/ours.json "${OUT:-/tmp}/" 2>/dev/null
python3 - "$F" <<'PY'
import json, sys
def rows(path):
    try:
        return json.load(open(path))
    except Exception as exc:
        print(f"{path}: {exc}"); return []
llama = {}
for name in ("/tmp/lb-default.json", "/tmp/lb-big.json"):
    for r in rows(name):
        if r.get("n_gen", 0) == 0:
            n = r["n_prompt"]
            if r["avg_ts"] > llama.get(n, (0, ""))[0]:
                llama[n] = (r["avg_ts"], f"b {r['n_batch']} ub {r['n_ubatch']}")
ours = {}
for r in rows("/tmp/ours.json"):  # -o json: one array, as llama-bench's
    if r.get("row") == "run":
        ours[r["prompt_tokens"]] = max(ours.get(r["prompt_tokens"], 0), r["prefill_tok_s"])
print(f"\nfile {sys.argv[1]}\n")
print("| prompt | llama.cpp best tok/s (batch) | ours tok/s | ours / llama.cpp |")
print("|---:|---:|---:|---:|")
for n in sorted(set(llama) | set(ours)):
    l, how = llama.get(n, (0, "—"))
    o = ours.get(n, 0)
    print(f"| {n:,} | {l:,.0f} ({how}) | {o:,.0f} | {o / l:.2f} |" if l and o else f"| {n:,} | {l:,.0f} | {o:,.0f} | — |")
PY
