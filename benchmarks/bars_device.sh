#!/usr/bin/env bash
# Issues 32-35's bars on one GPU in as few device calls as they fit (two, on one warm machine):
#   run(command="bash benchmarks/bars_device.sh", carry=[".whl", "third_party/llama.cpp"])
# then the same command again at once (the machine stays warm 30 s): a call resumes where the last
# one stopped.  With llama-bench's binaries from an earlier call (llama-bin.tar.xz.part* copied into
# .whl/) carry only .whl: no build, and the whole runs in about two calls of ~400 s.  What it measures, each step a plain command (its log under /tmp/bars/logs):
#   - llama.cpp's llama-bench, built here with CUDA (sm_90) in the background (setsid, nice 19:
#     it outlives the first call) unless LLAMA_BIN names a built one (a later session carries the
#     binaries this script leaves in $OUT as llama-bin.tar.xz.part*);
#   - the family files (FAMILIES, as benchmarks/families_vs_llamacpp.sh takes them) and a 16-layer
#     Qwen3-30B-A3B Q4_K_M file for tg, written in the background (setsid, nice 10);
#   - meanwhile on the GPU, the steps that need no llama.cpp: gpt-oss and qwen3-next against HF
#     (benchmarks/vs_hf.py; qwen3-next at HF_LAYERS, 16 on an H200, 8 where 80 GB is all: HF runs
#     out of memory at 64K above that), issue 33's IQ3 mixes against F16 resident, tg of bf16 and
#     Q4_K_M (one stage and two on one GPU), the GDN layer's kernels, the stream-bound IQ3_XXS vs
#     Q4_K_M at 32 layers (at 16 the IQ3 mix's experts fit the 4 GiB cache), the prefill and decode
#     profiles;
#   - once the build and the files are done: families_vs_llamacpp.sh on the files and llama-bench's
#     tg against ours on the Q4_K_M file, with nothing else running.
# Call 1 of session 18 shared the CPU with the build and the writers (load 9-17), so the steps
# that ran then are same-call ratios; the llama.cpp comparisons always run alone.
# Every log goes back as one file, $OUT/bars-logs.tgz (a call returns a limited number of files).
# MAKE_ARGS adds make-model flags to every file (a smoke test of the script at small shapes).
. "$(dirname "$0")/device_env.sh"
T0=$(date +%s); LIMIT=${LIMIT:-560}
el() { echo $(( $(date +%s) - T0 )); }
stamp() { echo "[+$(el) s] $*"; }
left() { echo $(( LIMIT - $(el) )); }
W=/tmp/bars; LOGS=$W/logs; mkdir -p "$LOGS" "$W/done"
FAMILIES=${FAMILIES:-"gpt-oss-20b:24:mxfp4 deepseek-v3:4:q4_k_m glm-4.5-air:4:q4_k_m qwen3-next-80b-a3b:8:q4_k_m"}
TG=$W/q4km-16L.gguf
gib=$(python3 -c 'import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 2**30))' 2>/dev/null || echo 0)
HF_LAYERS=${HF_LAYERS:-$([ "$gib" -ge 120 ] && echo 16 || echo 8)}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
python3 -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -1
finish() {
  ( cd "$LOGS" && tar czf "$OUTDIR/bars-logs.tgz" . )
  if [ -f "$W/llama-bin.tar.xz" ]; then split -b 15M -d "$W/llama-bin.tar.xz" "$OUTDIR/llama-bin.tar.xz.part"; fi
  stamp "end (logs in bars-logs.tgz)"
}
trap finish EXIT

bg() {  # bg NAME NICE CMD: once per machine, in its own session so that it outlives this call
  local n=$1 nv=$2; shift 2
  [ -f "$W/$n.started" ] && return
  touch "$W/$n.started"
  setsid nohup nice -n "$nv" bash -c "{ $*; } > $LOGS/$n.log 2>&1; echo \$? > $W/$n.rc" > /dev/null 2>&1 < /dev/null &
}
if [ -n "${LLAMA_BIN:-}" ]; then
  LB=$LLAMA_BIN
elif [ -n "$(ls .whl/llama-bin.tar.xz.part* 2>/dev/null)" ]; then  # binaries an earlier session left
  mkdir -p "$W/lb" && cat .whl/llama-bin.tar.xz.part* | xz -d | tar xf - -C "$W/lb" && echo 0 > "$W/build.rc"
  LB=$W/lb
else
  [ -d third_party/llama.cpp ] || { echo "third_party/llama.cpp missing: run benchmarks/llamacpp_source.sh and carry it"; exit 2; }
  B=$W/llama-build
  bg build 19 "cmake -S third_party/llama.cpp -B $B -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF && cmake --build $B --target llama-bench -j $(nproc) \
    && (cd $B/bin && tar cf - llama-bench ./*.so* | xz -T0 -6 > $W/llama-bin.tar.xz)"
  LB=$B/bin
fi
for f in $FAMILIES; do
  IFS=: read -r p l q <<< "$f"
  bg "make-$p-${l}L-$q" 10 "python3 -m engine.cli.bench make-model /tmp/fam-$p-${l}L-$q.gguf --preset $p --layers $l --quant $q ${MAKE_ARGS:-}"
done
bg make-tg 10 "python3 -m engine.cli.bench make-model $TG --preset qwen3-30b-a3b --layers 16 --quant q4_k_m ${MAKE_ARGS:-}"
stamp "llama-bench: $LB; files: $FAMILIES and $TG; HF comparisons at $HF_LAYERS qwen3-next layers ($gib GiB)"

step() {  # step SECONDS NAME CMD...: once per machine, cut at its own limit and the call's
  local s=$1 n=$2; shift 2
  [ -f "$W/done/$n" ] && return
  local lim=$(( s < $(left) ? s : $(left) ))
  [ "$lim" -gt 20 ] || { stamp "not run this call: $n ($(left) s left)"; return; }
  stamp "$n (limit $lim s, load $(cut -d' ' -f1-3 /proc/loadavg))"
  timeout "$lim" "$@" > "$LOGS/$n.log" 2>&1; local rc=$?
  echo "rc $rc" >> "$LOGS/$n.log"
  [ $rc = 0 ] && touch "$W/done/$n"
  grep -E "^\||^rc |Error|tok/s|GB/s" "$LOGS/$n.log" | grep -v "^|---" | head -40
}
ready() { [ -f "$W/$1.rc" ] && [ "$(cat "$W/$1.rc")" = 0 ]; }
failed() {  # a background job that ended with an error (its log's tail is printed once)
  local f
  for f in "$W"/*.rc; do
    [ -f "$f" ] && [ "$(cat "$f")" != 0 ] || continue
    [ -f "$f.said" ] || { echo "$(basename "$f" .rc) failed:"; tail -15 "$LOGS/$(basename "$f" .rc).log"; touch "$f.said"; }
    return 0
  done
  return 1
}
alone() {  # the llama.cpp comparisons: once the build and every file are done
  ready build || [ -n "${LLAMA_BIN:-}" ] || return 1
  for f in $FAMILIES; do IFS=: read -r p l q <<< "$f"; ready "make-$p-${l}L-$q" || return 1; done
  ready make-tg
}
Q=synthetic:qwen3-30b-a3b:n_layers=16
gpu_steps() {
  step 200 vs_hf_gpt_oss python3 benchmarks/vs_hf.py --preset gpt-oss-20b --layers 24 --sizes 8192,32768 --repeat 3
  step 240 vs_hf_qwen3next python3 benchmarks/vs_hf.py --preset qwen3-next-80b-a3b --layers "$HF_LAYERS" --sizes 8192,32768,65536 --repeat 3
  for q in f16 iq3_xxs iq3_s; do
    step 90 "resident_$q" python3 -m engine.cli.bench run -m "$Q,quant=$q" --devices cuda:0 -p 8192,32768 -r 2 --expert-cache all -o md
  done
  step 90 tg_bf16 python3 -m engine.cli.bench run -m "$Q" --devices cuda:0 -p 0,4096 -n 128 -r 2 --expert-cache all -o md
  step 90 tg_q4_k_m_split python3 -m engine.cli.bench run -m "$Q,quant=q4_k_m" --devices cuda:0,cuda:0 -p 0,4096 -n 128 -r 2 --expert-cache all -o md
  step 130 gdn_bench python3 benchmarks/gdn_bench.py --sizes 8192,32768
  step 150 quant_stream_32L env LAYERS=32 bash benchmarks/quant_stream.sh
  step 90 profile_decode python3 benchmarks/profile_decode.py --layers 16 --quant q4_k_m --steps 64
  step 90 profile_gpt_oss python3 benchmarks/profile_prefill.py --preset gpt-oss-20b --layers 24 --tokens 32768
  step 120 profile_qwen3next python3 benchmarks/profile_prefill.py --preset qwen3-next-80b-a3b --layers 16 --tokens 32768
}
llama_steps() {
  step 60 tg_llamacpp env LD_LIBRARY_PATH="$LB" "$LB/llama-bench" -m "$TG" -p 0 -n 128 -d 0,4096 -fa 1 -ngl 99 -r 2 -o md
  step 80 tg_ours python3 -m engine.cli.bench run -m "$TG" --devices cuda:0 -p 0,4096 -n 128 -r 2 --expert-cache all -o md
  # families_vs_llamacpp.sh keeps its own results (/tmp/fam-results) and resumes from them
  [ "$(left)" -gt 60 ] || { stamp "not run this call: families ($(left) s left)"; return; }
  stamp "families (deadline $(( $(left) - 30 )) s)"
  LLAMA_BIN="$LB" KEEP_BIN=0 FAMILIES="$FAMILIES" DEADLINE=$(( $(left) - 30 )) \
    bash benchmarks/families_vs_llamacpp.sh > "$LOGS/families.log" 2>&1
  sed -n '/^### /,$p' "$LOGS/families.log"
}
if alone; then llama_steps; fi
gpu_steps
if ! alone && [ "$(left)" -gt 120 ]; then  # the GPU steps are done: wait for the build and the files
  stamp "waiting for the build and the files"
  while ! alone && ! failed && [ "$(left)" -gt 100 ]; do sleep 5; done
fi
if alone; then
  llama_steps
elif failed; then
  stamp "a background job failed (above): the llama.cpp comparisons cannot run"
else
  stamp "the build or a file is not done: run this script again (same warm machine)"
fi
