#!/usr/bin/env bash
# Auto chunk vs fixed chunks, 1/2/4 stages, 8K-64K, in one run (docs/benchmarks.md).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
fi
M=${MODEL:-synthetic:qwen3-30b-a3b:n_layers=32}
SIZES=${SIZES:-8192,16384,32768,65536}
B="python3 -m engine.cli.bench run --model $M --peak-tflops 794 --gpu-order configured --prompt-tokens $SIZES"
G1="devices=cuda:0"; G2="devices=cuda:0,cuda:1"; G4="devices=cuda:0,cuda:1,cuda:2,cuda:3"
echo "## 2 stages, auto"; $B --repeat 2 --arm "$G1" --arm "$G2 pf_depth=0" --arm "$G2 pf_depth=1" -v 2>&1 | grep -E "^\||chunk cost"
echo "## 4 stages, auto"; $B --repeat 2 --arm "$G4 pf_depth=0" --arm "$G4 pf_depth=1" --trace ${OUT:-/tmp}/overlap4-auto.json.gz
echo "## 2 stages, fixed"
$B --arm "$G2 prefill=1024" --arm "$G2 prefill=2048" --arm "$G2 prefill=4096" --arm "$G2 prefill=8192"
echo "## 4 stages, fixed"
$B --arm "$G4 prefill=1024" --arm "$G4 prefill=2048" --arm "$G4 prefill=4096" --arm "$G4 prefill=8192"
