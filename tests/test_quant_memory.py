"""Host memory of a quantized model: the experts are held once, as stored, never expanded.

The issue asks for a 1 GB Q4_K_M file to raise RSS by at most 1.2 GB.  Writing a 1 GB file
takes minutes on the 2-core CI machine, so this checks the same ratio (1.2x the file) on a
~240 MB Q4_K_M MoE file whose experts are 95% of it, measured in a fresh subprocess (VmRSS
after library warm-up, after the session loaded, after a run), with a fixed 32 MiB allowance
for what the allocator keeps of freed temporaries (it does not grow with the file).
Measured here: +269 MiB after load, +275 MiB after a run, for a 237 MiB file (1.16x)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.io import gguf_model, synth
from engine.io.gguf_model import GGUFError

BIG = dict(arch="qwen3moe", n_layers=8, hidden=512, n_heads=8, n_kv_heads=2, head_dim=64, n_experts=64,
           n_experts_used=4, expert_ffn=512, quant="q4_k_m")

FIXED = 32 * 2**20

MEASURE = r"""
import json, resource, sys, time
import torch
from engine.io import gguf_model
from engine.config import EngineConfig
from engine.pipeline.session import Session
from engine.io.prompt import synthetic

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

torch.set_num_threads(1)
m = gguf_model.load(sys.argv[1])
# library set-up that any first run pays (kernels, thread pools, lazily loaded code) is not
# the model's memory: warm up on a model-free computation first
x = torch.randn(64, 512)
torch.nn.functional.silu(torch.nn.functional.linear(x, torch.randn(256, 512))).sum()
torch.nn.functional.scaled_dot_product_attention(x.view(1, 8, 64, 64), x.view(1, 8, 64, 64), x.view(1, 8, 64, 64),
                                                 is_causal=True)
import torch.nn.attention.bias  # noqa: E402,F401  (the engine imports it at its first chunk: torch._dynamo, ~150 MB)
m.tensor("blk.0.attn_q.weight")
before = rss()
t0 = time.perf_counter()
cache = sys.argv[2] if sys.argv[2] in ("all", "auto") else float(sys.argv[2])
sess = Session(m, EngineConfig(devices=["cpu"], chunk_tokens=16, expert_cache=cache))
load_s = time.perf_counter() - t0
after_load = rss()
res = sess.run(synthetic(32, m.spec.vocab, nonce=1), decode_tokens=2)
after_run = rss()
print(json.dumps(dict(before=before, after_load=after_load, after_run=after_run, load_s=load_s,
                      digest=res.report.digest)))
"""


@pytest.fixture(scope="module")
def big_q4(tmp_path_factory) -> Path:
    return synth.write_model(tmp_path_factory.mktemp("big") / "big-q4_k_m.gguf", synth.recipe_from_args("demo", **BIG))


def _measure(path: Path, expert_cache: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path), expert_cache], capture_output=True, text=True,
                         cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
@pytest.mark.parametrize("expert_cache", ["all", "0.01"])
def test_loading_a_q4_k_m_file_raises_rss_by_at_most_1_2x_its_size(big_q4, expert_cache):
    size = big_q4.stat().st_size
    m = gguf_model.load(big_q4)
    experts = sum(m.nbytes(n) for n in m.tensor_names() if "_exps" in n)
    assert experts > 0.9 * size and size > 100 * 2**20
    r = _measure(big_q4, expert_cache)
    loaded = (r['after_load'] - r['before']) / 2**20
    print(f"{size / 2**20:.0f} MiB file, expert_cache={expert_cache}: RSS +{loaded:.0f} "
          f"MiB after load ({r['load_s']:.2f} s), +{(r['after_run'] - r['before']) / 2**20:.0f} MiB after a run")
    grew = max(r["after_load"], r["after_run"]) - r["before"]
    # 1.2x the file, plus a fixed 32 MiB that does not scale with it (glibc keeps freed
    # dequantisation temporaries of the dense weights: ~15-20 MiB here), plus the one batch of
    # expanded experts a CPU stage holds while it runs them (the memory plan's scratch, capped at
    # routed_experts.REFERENCE_SCRATCH_BYTES whatever the model's size)
    from engine.plan.memory_plan import plan_memory

    cache = expert_cache if expert_cache == "all" else float(expert_cache)
    scratch = plan_memory(m, EngineConfig(devices=["cpu"], chunk_tokens=16, expert_cache=cache), 34).devices[0].scratch
    bound = 1.2 * size + FIXED + scratch
    assert grew <= bound, f"RSS grew {grew / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file ({r}; bound {bound / 2**20:.0f})"
    # and it holds the experts: not a vacuous bound
    assert r["after_load"] - r["before"] >= 0.8 * experts


def test_truncated_quantized_tensor_is_a_gguf_error_naming_it(tmp_path, big_q4):
    data = big_q4.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: len(data) - 5000])  # inside the last tensor's blocks
    last = gguf_model.scan(big_q4).tensors[-1].name
    with pytest.raises(GGUFError) as ei:
        gguf_model.load(p)
    assert "truncated" in str(ei.value) and last in str(ei.value)
