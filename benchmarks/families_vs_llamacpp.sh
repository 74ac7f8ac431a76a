#!/usr/bin/env bash
# Issues 33, 34 and 35's llama.cpp bars in one device call: for each model family a GGUF file written
# by `strata-bench make-model` (full shapes, LAYERS layers, the family's published quant mix), then
#   ours resident   `strata-bench run -m F --devices cuda:0 -p SIZES --expert-cache all`
#   ours streamed   the same with a 4 GiB expert cache and the arena pinned (copy GB/s vs the pinned
#                   peak `strata-bench devices --probe` measures first, in the same call)
#   llama.cpp       its own llama-bench, built here with CUDA (sm_90) from third_party/llama.cpp
#                   (benchmarks/llamacpp_source.sh), flash attention, every layer on the GPU, best of
#                   its default batch and -b 8192 -ub 4096
# and one table per family.  The files are written while llama-bench builds, and ours runs on each
# as soon as it exists (the GPU is idle during the build); llama-bench runs after both, alone.
#   run(command="bash benchmarks/families_vs_llamacpp.sh", carry=[".whl", "third_party/llama.cpp"])
# FAMILIES: space-separated PRESET:LAYERS:QUANT; SIZES: prompt sizes; STREAM=0 skips the streamed runs.
# A prebuilt llama-bench (LLAMA_BIN=dir holding llama-bench and its libraries) skips the build;
# MAKE_ARGS adds make-model flags (a smoke test of the script at small shapes).
# A second call on the same warm machine resumes: files already written and runs already measured
# (results kept per file under /tmp/fam-results) are not made or run again; RESUME=0 starts afresh.
# DROP_FILES=1 deletes a file once ours and llama-bench have measured it (the device's 64 GB disk
# holds no 16-layer glm-4.5-air, qwen3-next and deepseek-v3 files at once).
. "$(dirname "$0")/device_env.sh"
SIZES=${SIZES:-8192,32768}
FAMILIES=${FAMILIES:-"qwen3-30b-a3b:16:iq3_s mixtral-8x7b:4:q4_k_m glm-4.5-air:4:q4_k_m qwen3-next-80b-a3b:4:q4_k_m minimax-m2-230b-a10b:3:q4_k_m deepseek-v3:4:q4_k_m gpt-oss-20b:24:mxfp4"}
DEADLINE=${DEADLINE:-540}  # seconds: later steps are skipped (and said so) so that the tables still print
STREAM=${STREAM:-1}
DEVICES=${DEVICES:-cuda:0}  # cpu: a smoke test of the script where there is no GPU
BUILD=/tmp/llama-build
RES=/tmp/fam-results; [ "${RESUME:-1}" = 1 ] || rm -rf "$RES"; mkdir -p "$RES"
t_start=$(date +%s); df -h /tmp . | tail -2
stamp() { echo "[+$(( $(date +%s) - t_start )) s] $*"; }
late() { [ $(( $(date +%s) - t_start )) -lt "$DEADLINE" ] && return 1; stamp "past ${DEADLINE} s: skipped"; return 0; }

file_of() { local p l q; IFS=: read -r p l q <<< "$1"; echo "/tmp/fam-$p-${l}L-$q.gguf"; }
tag_of() { local p l q; IFS=: read -r p l q <<< "$1"; echo "$p-${l}L-$q"; }
have() {  # have FILE: a result of an earlier call (non-empty JSON): not measured again
  [ -s "$1" ] && python3 -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1])) else 1)' "$1" 2>/dev/null \
    && stamp "kept from an earlier call: $1"
}
measured_all() {  # measured_all TAG: every result of that file is kept (ours, streamed, both llama-bench runs)
  have "$RES/ours-$1.json" && { [ "$STREAM" != 1 ] || have "$RES/stream-$1.json"; } \
    && have "$RES/lb-default-$1.json" && have "$RES/lb-big-$1.json"
}

section "write the files in the background (nice), one process each"
declare -A MAKER
for f in $FAMILIES; do
  IFS=: read -r p l q <<< "$f"; F=$(file_of "$f"); t=$(tag_of "$f")
  ( [ -f "$F" ] || measured_all "$t" > /dev/null || nice -n 10 python3 -m engine.cli.bench make-model "$F" --preset "$p" --layers "$l" --quant "$q" ${MAKE_ARGS:-} \
      > "$RES/make-$t.log" 2>&1 ) &
  MAKER[$f]=$!
done

if [ -n "${LLAMA_BIN:-}" ]; then
  LB_BIN=$LLAMA_BIN/llama-bench; BUILDER=""
  stamp "llama-bench prebuilt: $LB_BIN"
else
  [ -d third_party/llama.cpp ] || { echo "third_party/llama.cpp missing: run benchmarks/llamacpp_source.sh and carry it"; exit 2; }
  section "build llama-bench (CUDA, sm_90) in the background"
  ( cmake -S third_party/llama.cpp -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF > /tmp/llama-cmake.log 2>&1 \
    && cmake --build "$BUILD" --target llama-bench -j "$(nproc)" > /tmp/llama-build.log 2>&1 ) &
  BUILDER=$!
  LB_BIN=$BUILD/bin/llama-bench
fi

section "pinned host->device peak (strata-bench devices --probe)"
have "$RES/probe.json" || python3 -m engine.cli.bench devices --probe --format json > "$RES/probe.json" 2> "$RES/probe.err" \
  || tail -5 "$RES/probe.err"
head -c 600 "$RES/probe.json"; echo

built() { [ -x "$LB_BIN" ] && { [ -z "$BUILDER" ] || ! kill -0 "$BUILDER" 2>/dev/null; }; }
declare -A LB_DONE
llama_one() {  # llama-bench on one family's file, once, while the deadline allows
  local f=$1 p l q F t; IFS=: read -r p l q <<< "$f"; F=$(file_of "$f"); t=$(tag_of "$f")
  [ -f "$F" ] && [ -z "${LB_DONE[$f]:-}" ] || return 0
  LB_DONE[$f]=1
  # a prebuilt llama-bench finds its own shared libraries beside it (libllama-bench-impl.so: session 20
  # lost every row to "cannot open shared object file")
  local LB="env LD_LIBRARY_PATH=$(dirname "$LB_BIN")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} $LB_BIN -m $F -p $SIZES -n 0 -fa 1 -ngl 99 -r 2 -o json"
  if ! have "$RES/lb-default-$t.json"; then
    late && return 0
    stamp "llama-bench: $F"
    $LB > "$RES/lb-default-$t.json" 2> "$RES/lb-default-$t.err" || tail -5 "$RES/lb-default-$t.err"
  fi
  if ! have "$RES/lb-big-$t.json"; then
    late && return 0
    stamp "llama-bench -b 8192 -ub 4096: $F"
    $LB -b 8192 -ub 4096 > "$RES/lb-big-$t.json" 2> "$RES/lb-big-$t.err" || tail -5 "$RES/lb-big-$t.err"
  fi
  if [ "${DROP_FILES:-0}" = 1 ] && [ -f "$F" ] && measured_all "$t" > /dev/null; then
    rm -f "$F" && stamp "measured by both, deleted: $F"
  fi
}
ours_one() {  # our resident (and streamed) runs on one family's file
  local f=$1 p l q F t; IFS=: read -r p l q <<< "$f"; F=$(file_of "$f"); t=$(tag_of "$f")
  have "$RES/ours-$t.json" && { [ "$STREAM" != 1 ] || have "$RES/stream-$t.json"; } && return 0
  tail -1 "$RES/make-$t.log" 2>/dev/null
  [ -f "$F" ] || { echo "no file for $f: $(tail -3 "$RES/make-$t.log")"; return 0; }
  if ! have "$RES/ours-$t.json"; then
    late && return 0
    stamp "ours resident: $F"
    python3 -m engine.cli.bench run -m "$F" --devices "$DEVICES" -p "$SIZES" -r 2 --expert-cache all -o json \
      > "$RES/ours-$t.json" 2> "$RES/ours-$t.err" || tail -5 "$RES/ours-$t.err"
  fi
  if [ "$STREAM" = 1 ] && ! have "$RES/stream-$t.json"; then
    late && return 0
    stamp "ours streamed (4 GiB expert cache, arena pinned): $F"
    python3 -m engine.cli.bench run -m "$F" --devices "$DEVICES" -p "$SIZES" -r 1 --expert-cache 4 --pin-limit-gib 64 \
      -o json > "$RES/stream-$t.json" 2> "$RES/stream-$t.err" || tail -5 "$RES/stream-$t.err"
  fi
}

section "each file as soon as it is written: ours, then llama-bench once it is built (the GPU runs one at a time)"
pending=($FAMILIES); measured=()
while [ ${#pending[@]} -gt 0 ]; do
  rest=()
  for f in "${pending[@]}"; do
    if kill -0 "${MAKER[$f]}" 2>/dev/null; then rest+=("$f"); continue; fi
    ours_one "$f"; measured+=("$f")
    if built; then for m in "${measured[@]}"; do llama_one "$m"; done; fi
  done
  pending=("${rest[@]}")
  [ ${#pending[@]} -gt 0 ] && sleep 2
done

if [ -n "$BUILDER" ]; then
  wait "$BUILDER" || { tail -30 /tmp/llama-cmake.log /tmp/llama-build.log; }
  stamp "llama-bench built: $(nvcc --version | tail -1)"
  if [ "${KEEP_BIN:-1}" = 1 ]; then  # the binaries, for a later call of the session to carry (LLAMA_BIN)
    ( cd "$BUILD/bin" && tar cf - llama-bench ./*.so* 2>/dev/null | xz -T0 -6 > /tmp/llama-bin.tar.xz ) \
      && ls -l /tmp/llama-bin.tar.xz && split -b 15M -d /tmp/llama-bin.tar.xz "$OUTDIR/llama-bin.tar.xz.part"
  fi
fi
section "llama.cpp llama-bench on the files not yet measured"
for f in $FAMILIES; do llama_one "$f"; done
stamp "done"
( cd "$RES" && tar czf "$OUTDIR/families-results.tar.gz" . )

python3 - "$RES" $FAMILIES <<'PY'
import json, sys
from pathlib import Path
res, families = Path(sys.argv[1]), sys.argv[2:]
def rows(name):
    try:
        return json.loads((res / name).read_text())
    except Exception as exc:
        return []
try:
    peak = max(d.get("h2d_gbs") or 0.0 for d in json.loads((res / "probe.json").read_text())["devices"])
except Exception:
    peak = 0.0
for fam in families:
    preset, layers, quant = fam.split(":")
    tag = f"{preset}-{layers}L-{quant}"
    llama = {}
    for kind in ("default", "big"):
        for r in rows(f"lb-{kind}-{tag}.json"):
            if r.get("n_gen", 0) == 0 and r.get("avg_ts"):
                n = r["n_prompt"]
                if r["avg_ts"] > llama.get(n, (0, ""))[0]:
                    llama[n] = (r["avg_ts"], f"b {r['n_batch']} ub {r['n_ubatch']}")
    ours = {r["prompt_tokens"]: r for r in rows(f"ours-{tag}.json") if r.get("row") == "summary"}
    stream = {r["prompt_tokens"]: r for r in rows(f"stream-{tag}.json") if r.get("row") == "summary"}
    print(f"\n### {preset}, {layers} layers, {quant} (file /tmp/fam-{preset}-{layers}L-{quant}.gguf)\n")
    print("| prompt | llama.cpp best tok/s (batch) | ours resident tok/s | ours / llama.cpp | ours streamed tok/s "
          "(4 GiB cache) | streamed GiB | H2D GB/s (of pinned peak) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in sorted(set(llama) | set(ours) | set(stream)):
        l, how = llama.get(n, (0.0, "—"))
        o = ours.get(n, {}).get("prefill_tok_s", 0.0)
        s = stream.get(n, {})
        e = s.get("experts") or {}
        ratio = f"**{o / l:.2f}**" if l and o else "—"
        share = f" ({e['gbs'] / peak * 100:.0f}%)" if e.get("gbs") and peak else ""
        print(f"| {n:,} | {l:,.0f} ({how}) | {o:,.0f} | {ratio} | {s.get('prefill_tok_s', 0):,.0f} | "
              f"{e.get('gib', 0):.1f} | {e.get('gbs', 0):.1f}{share} |")
print(f"\npinned peak from the probe: {peak:.1f} GB/s")
PY
