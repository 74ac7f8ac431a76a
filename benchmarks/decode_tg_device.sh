#!/usr/bin/env bash
# Issue 32's tg figures in one short device call (decode_graph_device.sh is the full A/B): the
# CUDA decode tests, then tg128 at depth 0 and 4096 on 16 layers of Qwen3-30B-A3B shapes with the
# experts resident: Q4_K_M one stage with the decode graph on and off, Q4_K_M two stages on the
# one GPU, and bf16 one stage; each with its capture notes.
#   run(command="bash benchmarks/decode_tg_device.sh", carry=[".whl"])
. "$(dirname "$0")/device_env.sh"
section tests; python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "decode or stored_block" 2>&1 | tail -3
B=synthetic:qwen3-30b-a3b:n_layers=16
run1() { tag=$1; shift; section "$tag"; python3 -m engine.cli.bench run -v "$@" -p 0,4096 -n 128 -r 2 --expert-cache all -o md 2> /tmp/$tag.err | grep -E "^\| qwen|^decode|^roofline|^kernels"; grep -h "captured the decode\|decode: \|keeps torch\|capture failed" /tmp/$tag.err | sed 's/^.*INFO[^:]*: //' | sort | uniq -c | head -5; }
run1 q4-1-on -m $B,quant=q4_k_m --devices cuda:0 --cuda-graphs 1
run1 q4-1-off -m $B,quant=q4_k_m --devices cuda:0 --cuda-graphs 0
run1 q4-2-on -m $B,quant=q4_k_m --devices cuda:0,cuda:0 --cuda-graphs 1
run1 bf16-1-on -m $B --devices cuda:0 --cuda-graphs 1
