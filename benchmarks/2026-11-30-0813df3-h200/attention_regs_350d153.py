"""Registers and spills of the decode attention kernel at commit 350d153 (FUSED_QKV off and on),
the 8B split config, compiled for sm_90 offline. Run from a checkout of 350d153:
TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=. python attention_regs_350d153.py"""

import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.compiler import ASTSource

from kipp_cuda.kernels import sass
from kipp_cuda.kernels.decode_attention import _paged_decode_attention_kernel as K

TYPES = dict(out_ptr="*bf16", mid_o_ptr="*fp32", mid_lse_ptr="*fp32", counters_ptr="*i32",
             q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", k_scale_ptr="*bf16",
             v_scale_ptr="*bf16", block_tables_ptr="*i32", context_lens_ptr="*i32",
             qw_ptr="*bf16", kw_ptr="*bf16", pos_ptr="*i64", cos_sin_ptr="*fp32",
             slot_ptr="*i64", qk_scale="fp32", eps="fp32", num_splits="i32")  # fmt: skip


def kind(name: str) -> str:
    if name in TYPES:
        return TYPES[name]
    return "i32" if name.startswith("stride") else "constexpr"


sig = {n: kind(n) for n in K.arg_names}
attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t[0] == "*"}
for fused in (False, True):
    consts = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, G=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_N=64,
                  PAGE_SIZE=32, IS_Q8=False, ONE_SPLIT=False, MIN_TILES=2,
                  DOT_DTYPE=tl.bfloat16, PRECISION="tf32", FUSED_MERGE=True, MERGE_H=4,
                  BLOCK_S=64, CHUNK_S=32, PDL=True, PREFETCH=True, FUSED_QKV=fused)  # fmt: skip
    src = ASTSource(fn=K, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=sass.TARGET, options=dict(num_warps=4, num_stages=2))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        dump = [str(sass.CUOBJDUMP), f.name]
        usage = subprocess.run([dump[0], "-res-usage", f.name], capture_output=True, text=True)
        code = subprocess.run([dump[0], "-sass", f.name], capture_output=True, text=True)
    regs = re.search(r"REG:\d+.*?SHARED:\d+", usage.stdout).group(0)
    print("FUSED_QKV", fused, regs, "STL", code.stdout.count("STL"))
