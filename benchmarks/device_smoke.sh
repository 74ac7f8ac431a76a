#!/usr/bin/env bash
# First look on the device machine: CUDA tests, topology, and one quick run per stage count.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count())'
python3 -m pytest -q -x tests/test_cuda.py -s 2>&1 | tail -15
python3 -m engine.cli.bench devices --probe
M=synthetic:qwen3-30b-a3b:n_layers=32
n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
ARMS=(--arm "devices=cuda:0" --arm "devices=cuda:0,cuda:1 pf_depth=0" --arm "devices=cuda:0,cuda:1 pf_depth=1")
[ "$n" -ge 4 ] && ARMS+=(--arm "devices=cuda:0,cuda:1,cuda:2,cuda:3 pf_depth=0" --arm "devices=cuda:0,cuda:1,cuda:2,cuda:3 pf_depth=1")
python3 -m engine.cli.bench run --model $M --prompt-tokens 8192 --prefill 4096 --peak-tflops 794 "${ARMS[@]}" --timing
python3 benchmarks/profile_prefill.py --layers 4 --tokens 4096 2>&1 | tail -30
