#!/usr/bin/env bash
# One call, two commits: the default `strata-bench run` of the GPU gate (chunk auto, CUDA graphs
# on, one GPU) from this tree and from an older tree, alternately ROUNDS times each (A B A B ...:
# drift of the machine hits both), then a table of each prefill size's median tok/s and the ratio.
# Usage on the device (carry .whl): BASE=baseline bash benchmarks/same_call.sh
#   BASE: a folder holding the other commit's files (git archive <sha> | tar -x -C baseline);
#   its CLI is `python3 -m engine.bench` (before issue 31) or `python3 -m engine.cli.bench`.
. "$(dirname "$0")/device_env.sh"
BASE=${BASE:?a folder with the other commit}
ROUNDS=${ROUNDS:-2}
ARGS=(run --model "${CHECK_MODEL:-synthetic:qwen3-30b-a3b:n_layers=16}" --prompt-tokens 8192,32768
      --arm devices=cuda:0 --peak-tflops 794 -o json)
module() { if [ -f "$1/engine/cli/bench.py" ]; then echo engine.cli.bench; else echo engine.bench; fi; }
for r in $(seq "$ROUNDS"); do
  for side in this base; do
    dir=.; [ $side = base ] && dir=$BASE
    ( cd "$dir" && PYTHONPATH=.:/tmp/site python3 -m "$(module .)" "${ARGS[@]}" ) > "$OUTDIR/$side-$r.json" \
      2> /tmp/same-call.err || { echo "$side round $r failed:"; tail -5 /tmp/same-call.err; exit 1; }
    echo "round $r $side done"
  done
done
python3 - "$OUTDIR" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rates(side):
    got = {}
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/{side}-{r}.json")):
            if row.get("row") == "run":  # one row per repeat (the summary rows follow)
                got.setdefault(row["prompt_tokens"], []).append(row["prefill_tok_s"])
    return got
this, base = rates("this"), rates("base")
print("| prompt tokens | this commit tok/s (median) | base tok/s (median) | this / base |")
print("|---:|---:|---:|---:|")
for n in sorted(this):
    a, b = statistics.median(this[n]), statistics.median(base[n])
    print(f"| {n} | {a:,.0f} | {b:,.0f} | {a / b:.3f} |")
PY
