"""Compile the one-token quantized GEMVs for sm_90 on any machine (no GPU needed: Triton's own
ptxas and cuobjdump) and count the SASS instructions in each kernel's K loop, per weight a thread
handles. This is how the decode GEMVs' instruction budget is compared offline (BENCHMARKS.md):
at 4.3 TB/s an H200 issues about 4.5 instructions a weight for affine4's 0.625 bytes a weight.

python scripts/gemv_sass.py [--configs 32x32x4,8x128x4] [--int-x both|on|off]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import q8_0_matmul as qm

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
    stride_bn="i32",
)


def _ordered(fn, sig: dict) -> dict:
    # the kernel's parameters in order: pointers and ints from sig, the rest constexpr
    names = fn.arg_names
    return {n: sig.get(n, "constexpr") for n in names}


def loop_ops(fn, sig: dict, consts: dict, num_warps: int) -> tuple[collections.Counter, int]:
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="32x32x4,16x64x4,8x128x4,16x128x4", help="NxGxWARPS")
    p.add_argument("--int-x", default="both", choices=["both", "on", "off"])
    args = p.parse_args()
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.int_x]
    print(f"triton {triton.__version__}, sm_90; PREFETCH off, PDL on, bf16 x")
    print("| kernel | N x G x warps | INT_X | loop instructions | per weight | registers | top |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.configs.split(","):
        bn, bg, nw = (int(v) for v in spec.split("x"))
        weights = bn * bg * 32 / (32 * nw)  # a thread's weights a K step
        common = dict(BLOCK_N=bn, BLOCK_G=bg, SPLIT_K=1, PDL=True, ASM=True, PREFETCH=False)
        for on in modes:
            for name, fn, sig, extra in (
                ("q8_0", qm._q8_0_gemv_kernel, Q8_SIG, {}),
                ("affine4", am._affine_gemv_kernel, AFFINE_SIG, dict(BITS=4, GROUP=32)),
            ):
                ops, regs = loop_ops(fn, sig, {**common, **extra, "INT_X": on}, nw)
                n = sum(ops.values())
                top = ", ".join(f"{k} {v}" for k, v in ops.most_common(4))
                print(f"| {name} | {spec} | {on} | {n} | {n / weights:.2f} | {regs} | {top} |")


if __name__ == "__main__":
    main()
