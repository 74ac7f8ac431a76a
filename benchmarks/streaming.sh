#!/usr/bin/env bash
# Expert streaming under a cache smaller than the model's experts (issue 4; docs/benchmarks.md).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
fi
echo "## CUDA tests"; python3 -m pytest -q tests/test_cuda.py tests/test_experts.py 2>&1 | tail -3
echo "## pinned peak"; python3 -m engine.cli.bench devices --probe
M=${MODEL:-synthetic:qwen3-30b-a3b:n_layers=16}
B="python3 -m engine.cli.bench run --model $M --gpu-order configured --prompt-tokens 16384,32768 --prefill 8192 --warmup 1"
echo "## one GPU: resident vs streamed (4 GiB cache), pin limit full vs 0"
$B --arm "devices=cuda:0 expert_cache=all" --arm "devices=cuda:0 expert_cache=4 pin_limit_gib=20" --arm "devices=cuda:0 expert_cache=4 pin_limit_gib=0"
echo "## two GPUs under streaming: split vs prefill-main"
$B --arm "devices=cuda:0,cuda:1 expert_cache=4 pin_limit_gib=20" --arm "devices=cuda:0,cuda:1 expert_cache=4 pin_limit_gib=20 prefill_main=1" --trace ${OUT:-/tmp}/stream2-prefill-main-32k.json.gz
