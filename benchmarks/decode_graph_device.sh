#!/usr/bin/env bash
# Issue 32 item 2 in one device call: decode (llama-bench's tg128) with each stage's decode step
# as ONE CUDA graph (--cuda-graphs 1) against the eager static-shape step (--cuda-graphs 0), at
# depth 0 (-p 0: a one-token prompt) and 4096 (-p 4096 then -n 128), bf16 and Q4_K_M weights
# (synthetic Qwen3-30B-A3B shapes, LAYERS layers, experts resident), one stage and two stages
# on the one GPU.  Prints the capture lines and one table.  With llama.cpp's build at
# $LLAMA_BENCH and its file at $Q4_FILE, llama-bench's tg128 (-d 0,4096) on that file too.
#   run(command="bash benchmarks/decode_graph_device.sh", carry=[".whl"])
. "$(dirname "$0")/device_env.sh"
L=${LAYERS:-16}
N=${DECODE:-128}
R=${REPEAT:-2}
DEPTHS=${DEPTHS:-0,4096}
D=${DEVICE:-cuda:0}
BASE=${BASE:-synthetic:qwen3-30b-a3b:n_layers=$L}  # BASE=synthetic:demo:n_layers=2 DEVICE=cpu: a smoke run
OUTS=()
for w in bf16 q4_k_m; do
  m="$BASE"; [ "$w" = bf16 ] || m="$m,quant=$w"
  for devs in "$D" "$D,$D"; do
    for g in 1 0; do
      tag="$w-$(echo "$devs" | tr -cd ',' | wc -c)-$g"
      section "$w, devices $devs, --cuda-graphs $g"
      python3 -m engine.cli.bench run -v -m "$m" --devices "$devs" -p "$DEPTHS" -n "$N" -r "$R" --expert-cache all \
        --cuda-graphs "$g" -o json > "/tmp/dg-$tag.json" 2> "/tmp/dg-$tag.err" || { tail -20 "/tmp/dg-$tag.err"; continue; }
      grep -h "captured the decode step\|decode: \|decode on " "/tmp/dg-$tag.err" | sed 's/^.*INFO[^:]*: //' | sort | uniq -c | head -8
      OUTS+=("$w" "$devs" "$g" "/tmp/dg-$tag.json")
    done
  done
done
section "q4_k_m, one stage, graphs on, STRATA_DECODE_ATTENTION=torch (does the split-K kernel earn its place?)"
STRATA_DECODE_ATTENTION=torch python3 -m engine.cli.bench run -m "$BASE,quant=q4_k_m" --devices "$D" -p "$DEPTHS" -n "$N" \
  -r "$R" --expert-cache all -o json > /tmp/dg-torch-attn.json 2> /tmp/dg-torch-attn.err || tail -20 /tmp/dg-torch-attn.err
python3 - /tmp/dg-torch-attn.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
for r in rows:
    if "model_type" in r:
        print(f"depth {r['n_prompt']}: tg with torch decode attention {r['decode_tok_s']:.0f} tok/s")
print("kernels:", next((r["kernels"] for r in rows if r.get("kernels")), "?"))
PY
cp /tmp/dg-*.json "$OUTDIR/" 2>/dev/null
section "tg$N (tok/s, median of $R after a warm-up)"
python3 - "${OUTS[@]}" <<'PY'
import json, sys
args = sys.argv[1:]
cells = {}
for i in range(0, len(args), 4):
    w, devs, g, path = args[i:i + 4]
    for r in json.load(open(path)):
        if "model_type" in r:  # the summary rows
            cells[(w, devs, g, r["n_prompt"])] = (r["decode_tok_s"], r.get("roofline_tok_s"))
print("| weights | stages | depth | graph on | graph off | on/off | roofline tok/s |")
print("|---|---|---|---:|---:|---:|---:|")
for (w, devs, g, d) in sorted(k for k in cells if k[2] == "1"):
    on, roof = cells[(w, devs, "1", d)]
    off = cells.get((w, devs, "0", d), (0.0, None))[0]
    ratio = f"{on / off:.2f}x" if off else "—"
    print(f"| {w} | {devs.count(',') + 1} | {d} | {on:.0f} | {off:.0f} | {ratio} | {f'{roof:.0f}' if roof else 'unknown'} |")
PY
if [ -n "${LLAMA_BENCH:-}" ] && [ -x "${LLAMA_BENCH}" ] && [ -f "${Q4_FILE:-}" ]; then
  section "llama.cpp llama-bench on $Q4_FILE (CUDA, flash attention, all layers on the GPU)"
  "$LLAMA_BENCH" -m "$Q4_FILE" -p 0 -n "$N" -d 0,4096 -fa 1 -ngl 99 -r 2 -o md 2>&1 | grep -E "^\|"
  section "ours on the same file (graphs on)"
  python3 -m engine.cli.bench run -m "$Q4_FILE" --devices cuda:0 -p 0,4096 -n "$N" -r "$R" --expert-cache all -o md 2>&1 \
    | grep -E "^\| |^roofline|^decode" | grep -v "^|---"
fi
