"""Compile a Triton kernel for sm_90 on any machine (Triton's own ptxas and cuobjdump, no GPU) and
read its SASS: the opcodes of its K loop and its registers a thread. scripts/gemv_sass.py prints
them for the quantized GEMVs (BENCHMARKS.md); a CI test checks that the int16-x path lowers to
dp2a (IDP)."""

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


class Capture:
    """Stands in for a @triton.jit kernel in its module while an op runs (on meta tensors, say):
    `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, fn):
        self.fn, self.args, self.kwargs = fn, None, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.args, self.kwargs = args, kwargs

        return launch


def compile_launch(cap: Capture, **constexprs):
    """Compile a recorded launch for sm_90 as Triton's JIT would specialize it at that launch:
    each pointer and int argument typed and marked 16-divisible (or folded, an int of 1) by
    Triton's own rule on its value (meta tensors count as aligned, as CUDA allocations are);
    `constexprs` override the launch's (PDL=True, which a launch off the GPU cannot take)."""
    from triton.backends.compiler import BaseBackend
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    backend = make_backend(TARGET)
    values = dict(zip(cap.fn.arg_names, cap.args))
    values.update({k: v for k, v in cap.kwargs.items() if k in cap.fn.arg_names})
    values.update(constexprs)
    sig, consts, attrs = {}, {}, {}
    for i, (name, p) in enumerate(zip(cap.fn.arg_names, cap.fn.params)):
        kind, spec = "constexpr", values[name]
        if not p.is_constexpr:
            kind, spec = native_specialize_impl(BaseBackend, values[name], False, True, True)
        sig[name] = kind
        if kind == "constexpr":
            consts[name] = values[name]
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = backend.parse_attr(spec)
    options = {k: cap.kwargs[k] for k in ("num_warps", "num_stages") if k in cap.kwargs}
    src = ASTSource(fn=cap.fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options)


def resources(kernel) -> dict:
    """A compiled kernel's registers a thread, stack bytes (spills and locals), spill stores and
    SASS instructions, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage, code = (
            subprocess.run([str(CUOBJDUMP), flag, f.name], capture_output=True, text=True).stdout
            for flag in ("-res-usage", "-sass")
        )
    ins = [s for s in code.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", s)]
    return {
        "regs": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "spill_stores": sum(" STL" in s for s in ins),
        "instructions": len(ins),
    }
