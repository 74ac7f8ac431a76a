"""Every Triton kernel of engine/kernels compiles for sm_90 through ptxas, without a GPU.

Triton's interpreter (TRITON_INTERPRET=1, how tests/test_triton_kernels.py runs these kernels on
CPU) accepts code that the compiler refuses: gpt-oss's clamped SwiGLU once held a
`tl.PropagateNan` in a local, which the interpreter ran and the GPU machine's Triton refused
("cannot convert PROPAGATE_NAN.ALL to tensor").  So each kernel is compiled here for an H100's
target in a process without the interpreter, in bf16 and float32, with the constexprs its
callers pass.  Skipped where triton is not installed (the test extra brings it on Linux, so CI
runs this; the GPU gate runs only the *_cuda.py files).  The quantised kernels have their own such checks (test_qmatvec.py,
test_dequant_triton.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
from triton_compile_support import compiled_lines  # noqa: E402

_COMPILE = """
import sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels import decode_attention, moe_kernels, qk_rope

swiglu, combine, swiglu_oai = moe_kernels._kernels()
rope = qk_rope._compiled()
partial, merge = decode_attention._compiled()


def build(name, fn, types, constexprs, warps=4):
    sig = dict(types, **{k: "constexpr" for k in constexprs})
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    print(name, "cubin", len(c.asm["cubin"]))


for dt in ("*bf16", "*fp32"):
    build(f"swiglu {dt}", swiglu, {"gu_ptr": dt, "out_ptr": dt, "f": "i32", "row_stride": "i32"}, {"BLOCK": 1024})
    for bias in (False, True):
        build(f"combine bias={bias} {dt}", combine,
              {"ys_ptr": dt, "inv_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": dt, "bias_ptr": dt, "e_ptr": "*i64",
               "hidden": "i32"}, {"K": 4, "HAS_BIAS": bias, "BLOCK": 1024})
    build(f"swiglu_oai {dt}", swiglu_oai,
          {"g_ptr": dt, "u_ptr": dt, "e_ptr": "*i64", "gb_ptr": dt, "ub_ptr": dt, "out_ptr": dt, "f": "i32",
           "alpha": "fp32", "limit": "fp32"}, {"BLOCK": 1024})
    for norm, rot in ((True, 128), (False, 64)):
        build(f"qk_norm_rope norm={norm} rot={rot} {dt}", rope,
              {"qkv_ptr": dt, "row_stride": "i32", "w_ptr": dt, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": dt,
               "k_ptr": dt, "n": "i32", "H": "i32", "KV": "i32", "eps": "fp32"},
              {"HD": 128, "HAS_NORM": norm, "ROT": rot})
    build(f"decode_partial {dt}", partial,
          {"q_ptr": dt, "q_stride": "i32", "k_ptr": dt, "v_ptr": dt, "k_stride_s": "i32", "k_stride_h": "i32",
           "v_stride_s": "i32", "v_stride_h": "i32", "pos_ptr": "*i64", "part_ptr": "*fp32", "G": "i32",
           "n_splits": "i32", "scale": "fp32"}, {"SPLIT": 256, "BLOCK": 64, "HD": 128})
    build(f"decode_combine {dt}", merge, {"part_ptr": "*fp32", "out_ptr": dt, "n_splits": "i32"},
          {"HD": 128, "SPLITS": 64})
"""

KERNELS = ["swiglu", "combine bias=False", "combine bias=True", "swiglu_oai", "qk_norm_rope norm=True",
           "qk_norm_rope norm=False", "decode_partial", "decode_combine"]


def test_every_engine_kernel_compiles_for_sm90():
    lines = compiled_lines(_COMPILE, drop_env=("STRATA_MOE_KERNELS",))
    for name in KERNELS:
        for dt in ("*bf16", "*fp32"):
            assert any(line.startswith(name) and f"{dt} cubin" in line for line in lines), (name, dt, lines)
