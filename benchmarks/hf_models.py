"""transformers models of a synthetic preset's shapes, for benchmarks/vs_hf.py (and its test).

Qwen3-MoE and the hybrids (Qwen3-Next, Qwen3.5-MoE): the transformers class built from the
spec with transformers' own random init (the same shapes as our synthetic weights, not the same
values).  gpt-oss: `GptOssForCausalLM` built from the spec and then given our `SyntheticSource`'s
weights, tensor by tensor (`fill_gpt_oss`): both sides run the same values, so the comparison
also holds the routing (which experts get how many rows) equal.  tests/test_vs_hf_gpt_oss.py
checks the bridge: fp32 logits of both on CPU equal to 1e-4.

gpt-oss's attention has per-head sinks: transformers 5.17 and 5.24 refuse sdpa for it
(`_supports_sdpa = False`; it stays first in the order, in case a later version takes it) and
their flash-attention path drops the sinks where the kernel takes none (left out), so of the
rest flex_attention (sinks through the log-sum-exp, CUDA only) and eager qualify;
`choose_attention` takes the first of the order that runs a short probe, and says why each
earlier one did not.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

# transformers' GptOss attention implementations that apply the sinks (see the docstring)
GPT_OSS_ATTENTION = ("sdpa", "flex_attention", "eager")
PROBE_TOKENS = 256  # longer than the 128-token window: the probe runs a sliding layer's mask too


def hf_qwen3moe(spec, device: str):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        moe_intermediate_size=spec.expert_ffn, num_experts=spec.n_experts, num_experts_per_tok=spec.n_experts_used,
        norm_topk_prob=True, rope_theta=spec.rope_base, rms_norm_eps=spec.rms_eps,
        max_position_embeddings=max(spec.context_length, 131072), decoder_sparse_step=1, mlp_only_layers=[],
        intermediate_size=6144, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    return model, transformers.__version__


def _hybrid_config(cls, spec, **extra):
    """A transformers config of a hybrid spec (engine/models/qwen3next.py HybridSpec)."""
    return cls(
        vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        linear_conv_kernel_dim=spec.conv_kernel, linear_key_head_dim=spec.linear_head_k,
        linear_value_head_dim=spec.linear_head_v, linear_num_key_heads=spec.linear_k_heads,
        linear_num_value_heads=spec.linear_v_heads, moe_intermediate_size=spec.expert_ffn,
        shared_expert_intermediate_size=spec.shared_ffn, num_experts=spec.n_experts,
        num_experts_per_tok=spec.n_experts_used, rms_norm_eps=spec.rms_eps,
        max_position_embeddings=max(spec.context_length, 131072), tie_word_embeddings=False,
        layer_types=["linear_attention" if r else "full_attention" for r in spec.recurrent],
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_base,
                         "partial_rotary_factor": spec.rotary_dim / spec.head_dim, **extra},
        attn_implementation="sdpa")


def hf_hybrid(spec, device: str):
    """Qwen3-Next or Qwen3.5-MoE (whichever family the spec's value-head order is)."""
    import transformers

    if spec.v_tiled:
        from engine.models.qwen35moe import mrope_sections

        cfg = _hybrid_config(transformers.Qwen3_5MoeTextConfig, spec, mrope_section=mrope_sections(spec.rotary_dim)[:3],
                             mrope_interleaved=True)
        cls = transformers.Qwen3_5MoeForCausalLM
    else:
        cfg = _hybrid_config(transformers.Qwen3NextConfig, spec)
        cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers = True, 1, []
        cls = transformers.Qwen3NextForCausalLM
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16).eval()
    try:
        import fla  # noqa: F401

        gdn = "flash-linear-attention"
    except ImportError:
        gdn = "torch fallback (no flash-linear-attention)"
    return model, f"{transformers.__version__}, GDN: {gdn}"


# ----------------------------------------------------------------------------- gpt-oss
def gpt_oss_config(spec):
    """transformers' GptOssConfig of a gpt-oss spec (engine/models/gpt_oss.py GptOssSpec): the
    window and which layers slide, YaRN as the spec holds it, biases everywhere (GptOss's
    default), the clamped SwiGLU's alpha and limit as our layer's constants (config fields from
    transformers 5.24; earlier versions hold the same numbers as constants: `hf_gpt_oss` checks)."""
    import transformers

    from engine.models.gpt_oss_layer import SWIGLU_ALPHA, SWIGLU_LIMIT

    sc = spec.rope_scaling
    if sc is None or sc.kind != "yarn":
        raise ValueError(f"a gpt-oss spec with YaRN RoPE expected, not {sc}")
    return transformers.GptOssConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.expert_ffn,
        num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.head_dim, num_local_experts=spec.n_experts, num_experts_per_tok=spec.n_experts_used,
        sliding_window=spec.sliding_window, layer_types=["sliding_attention" if s else "full_attention"
                                                         for s in spec.sliding],
        max_position_embeddings=spec.context_length, rms_norm_eps=spec.rms_eps, attention_bias=True,
        swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT, tie_word_embeddings=spec.tied_embeddings,
        rope_parameters={"rope_type": "yarn", "rope_theta": spec.rope_base, "factor": sc.factor,
                         "beta_fast": sc.beta_fast, "beta_slow": sc.beta_slow, "truncate": sc.truncate,
                         "original_max_position_embeddings": sc.original_context})


def _gpt_oss_layer_map(i: int) -> dict[str, Callable]:
    """HF parameter name -> fill(param, get) for layer i; get(gguf name) is our tensor in the
    parameter's dtype and device.  Linear weights keep their [out, in] layout; the experts go
    from llama.cpp's split [E, f, d] gate / up and [E, d, f] down to transformers' [E, d, 2f]
    gate_up (gate in the even columns, up in the odd ones) and [E, f, d] down."""
    hf, b = f"model.layers.{i}.", f"blk.{i}."

    def same(ours: str) -> Callable:
        return lambda p, get: p.copy_(get(b + ours))

    def interleaved(gate: str, up: str, transpose: bool) -> Callable:
        def fill(p: torch.Tensor, get: Callable) -> None:
            for name, col in ((gate, 0), (up, 1)):
                t = get(b + name)
                p[..., col::2].copy_(t.transpose(-2, -1) if transpose else t)
        return fill

    m = {hf + "input_layernorm.weight": same("attn_norm.weight"),
         hf + "post_attention_layernorm.weight": same("post_attention_norm.weight"),
         hf + "self_attn.sinks": same("attn_sinks.weight"),
         hf + "mlp.router.weight": same("ffn_gate_inp.weight"), hf + "mlp.router.bias": same("ffn_gate_inp.bias"),
         hf + "mlp.experts.gate_up_proj": interleaved("ffn_gate_exps.weight", "ffn_up_exps.weight", True),
         hf + "mlp.experts.gate_up_proj_bias": interleaved("ffn_gate_exps.bias", "ffn_up_exps.bias", False),
         hf + "mlp.experts.down_proj": lambda p, get: p.copy_(get(b + "ffn_down_exps.weight").transpose(-2, -1)),
         hf + "mlp.experts.down_proj_bias": same("ffn_down_exps.bias")}
    for proj, ours in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        m[hf + f"self_attn.{proj}.weight"] = same(ours + ".weight")
        m[hf + f"self_attn.{proj}.bias"] = same(ours + ".bias")
    return m


def fill_gpt_oss(model, src) -> None:
    """Give a GptOssForCausalLM our source's weights (a SyntheticSource or a loaded file), one
    tensor at a time on the parameter's device; every parameter must be named by the map."""
    params = dict(model.named_parameters())
    fills: dict[str, Callable] = {"model.embed_tokens.weight": lambda p, get: p.copy_(get("token_embd.weight")),
                                  "model.norm.weight": lambda p, get: p.copy_(get("output_norm.weight"))}
    if not src.spec.tied_embeddings:
        fills["lm_head.weight"] = lambda p, get: p.copy_(get("output.weight"))
    for i in range(src.spec.n_layers):
        fills |= _gpt_oss_layer_map(i)
    missing = sorted(set(params) - set(fills))
    if missing:
        raise ValueError(f"transformers' parameters the bridge does not fill: {', '.join(missing[:8])}")
    with torch.no_grad():
        for name, fill in fills.items():
            p = params[name]
            fill(p, lambda n, p=p: src.tensor(n, device=p.device, dtype=p.dtype))


def choose_attention(model, order: Sequence[str], vocab: int) -> tuple[str, list[str]]:
    """The first implementation of `order` that runs a short forward (PROBE_TOKENS) on the
    model's device, and why each earlier one did not (transformers refuses flex_attention's
    sinks on the CPU, a device may lack what torch.compile needs)."""
    device = next(model.parameters()).device
    probe = torch.arange(PROBE_TOKENS, device=device).remainder(vocab).view(1, -1)
    skipped: list[str] = []
    for impl in order:
        try:
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                model(input_ids=probe, logits_to_keep=1)
        except Exception as exc:  # noqa: BLE001  (any refusal moves on to the next; the reason is kept)
            skipped.append(f"{impl}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            log.info("HF attention %s refused: %s", impl, exc)
            continue
        return impl, skipped
    raise RuntimeError("no attention implementation of GptOss ran: " + "; ".join(skipped))


def hf_gpt_oss(src, device: str, dtype: torch.dtype = torch.bfloat16,
               attention: Sequence[str] = GPT_OSS_ATTENTION):
    """GptOssForCausalLM of `src`'s spec holding `src`'s weights, in `dtype` on `device` (made
    there in `dtype`: no float32 copy of the whole model first), with the first attention of
    `attention` that runs.  Returns (model, transformers version, attention used, skipped)."""
    import transformers

    cfg = gpt_oss_config(src.spec)
    with torch.device(device):
        model = transformers.GptOssForCausalLM._from_config(cfg, dtype=dtype).eval()
    from engine.models.gpt_oss_layer import SWIGLU_ALPHA, SWIGLU_LIMIT

    for layer in model.model.layers:
        got = (layer.mlp.experts.alpha, layer.mlp.experts.limit)
        if got != (SWIGLU_ALPHA, SWIGLU_LIMIT):
            raise ValueError(f"transformers' GptOss SwiGLU alpha, limit {got}, ours {(SWIGLU_ALPHA, SWIGLU_LIMIT)}")
    fill_gpt_oss(model, src)
    impl, skipped = choose_attention(model, attention, src.spec.vocab)
    return model, transformers.__version__, impl, skipped
