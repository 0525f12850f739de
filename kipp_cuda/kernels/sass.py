"""Compile a Triton kernel for sm_90 on any machine (Triton's own ptxas and cuobjdump, no GPU) and
read its SASS: the opcodes of its K loop and its registers a thread. tools/sweep/gemv_sass.py
prints them for the quantized GEMVs (benchmarks/LOG.md, entry 32405f1); a CI test checks that the
int16-x path lowers to dp2a (IDP)."""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
_COMMON = dict(x_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32", N="i32")
Q8_SIG = dict(
    _COMMON,
    qw_ptr="*i32",
    d_ptr="*fp16",
    num_groups="i32",
    groups_per_split="i32",
    stride_qn="i32",
    stride_dn="i32",
)
AFFINE_SIG = dict(
    _COMMON,
    wq_ptr="*i32",
    s_ptr="*bf16",
    b_ptr="*bf16",
    num_groups="i32",
    groups_per_split="i32",
    stride_wn="i32",
    stride_sn="i32",
    stride_sg="i32",
    stride_bn="i32",
    stride_bg="i32",
)
AFFINE_PACKED_SIG = dict(AFFINE_SIG, s_ptr="*i32", b_ptr="*i32")  # (scale, bias) words


def available() -> bool:
    return CUOBJDUMP.exists()


def _ordered(fn, sig: dict) -> dict:
    # the kernel's parameters in order: pointers and ints from sig, the rest constexpr
    names = fn.arg_names
    return {n: sig.get(n, "constexpr") for n in names}


def loop_sass(fn, sig: dict, consts: dict, num_warps: int) -> tuple[collections.Counter, int]:
    """SASS opcodes between the last backward branch and its target (the K loop), and the
    kernel's registers a thread."""
    sig = _ordered(fn, sig)
    aligned = [n for n, t in sig.items() if t.startswith("*") or n.startswith("stride")]
    attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=1))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        lines = subprocess.run(
            [str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        usage = subprocess.run(
            [str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    addr = re.compile(r"/\*([0-9a-f]{4,})\*/")
    body = lines
    for i in range(len(lines) - 1, -1, -1):
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?(0x[0-9a-f]+)", lines[i])
        here = addr.search(lines[i])
        if m and here and int(m.group(1), 16) < int(here.group(1), 16):
            target = int(m.group(1), 16)
            start = next(j for j, s in enumerate(lines) if re.search(rf"/\*{target:04x}\*/", s))
            body = lines[start : i + 1]
            break
    ops = collections.Counter()
    for s in body:
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)", s)
        if m:
            ops[m.group(1)] += 1
    return ops, regs
