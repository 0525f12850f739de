"""L2 prefetch of the weights the next GEMVs read, issued by a latency-bound kernel (sm_90).

In a batch-1 decode step HBM idles while q/k norm + RoPE and decode attention run (~10 us a layer
of the 8B shape), and o_proj's GEMV, which comes next, is too short to reach the stream rate
(4.5 us for 10.5 MB of affine4 weights: 2.3 TB/s). So decode attention's programs, before their
PDL wait, ask for those weights (then a prefix of gate_up's gate and up rows) to be moved into L2,
each program its share of each byte range; the GEMV then reads them from L2. It is a hint: no
result changes (a GPU test compares decode with it and without it, bit for bit).

`weight_ranges` turns modules into a table of (address, bytes) rows, int64 [R, 2], made once per
layer and budget before graph capture (the weights never move). `prefetch_ranges` is the device
side. KIPP_CUDA_L2_PREFETCH_MB sets the budget a layer (0: off), at most the L2's size.
Off under the interpreter (no inline PTX there). The sixteenth session's GEMVs that prefetched
their own weights were slower: those bytes were wanted at once, and gate_up's did not fit in L2.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

DEFAULT_MB = 24.0

# One thread (thread 0 of the program) prefetches [$1, $1 + $2) rounded inward to 16 bytes, as
# cp.async.bulk needs; an empty range issues nothing. $0 is the dummy output inline asm requires.
_BULK_ASM = tl.constexpr("""{
.reg .pred p, q;
.reg .u32 t;
.reg .b64 a, e;
mov.u32 t, %tid.x;
setp.eq.u32 p, t, 0;
add.s64 e, $1, $2;
add.s64 a, $1, 15;
and.b64 a, a, 0xFFFFFFFFFFFFFFF0;
and.b64 e, e, 0xFFFFFFFFFFFFFFF0;
setp.gt.s64 q, e, a;
and.pred p, p, q;
sub.s64 e, e, a;
cvt.u32.u64 t, e;
@p cp.async.bulk.prefetch.L2.global [a], t;
mov.u32 $0, 0;
}""")


@triton.jit
def load_ranges(table_ptr, NUM_RANGES: tl.constexpr):
    """The (address, bytes) rows of table_ptr as a flat tuple of scalars: loaded at a kernel's
    start (they never change), so that a prefetch issued later waits for no load."""
    ranges = ()
    for r in tl.static_range(NUM_RANGES):
        ranges = ranges + (tl.load(table_ptr + 2 * r), tl.load(table_ptr + 2 * r + 1))
    return ranges


@triton.jit
def prefetch_ranges(ranges, p, num_programs, NUM_RANGES: tl.constexpr):
    """Program p of num_programs asks for its share of each range (load_ranges) to be moved
    into L2: one bulk prefetch a range, issued by thread 0."""
    for r in tl.static_range(NUM_RANGES):
        nbytes = ranges[2 * r + 1]
        chunk = (tl.cdiv(nbytes, num_programs) + 127) // 128 * 128
        lo = p.to(tl.int64) * chunk
        tl.inline_asm_elementwise(
            asm=_BULK_ASM,
            constraints="=r,l,l",
            args=[ranges[2 * r] + lo, tl.maximum(tl.minimum(chunk, nbytes - lo), 0)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def budget_bytes(device: torch.device) -> int:
    """The bytes a layer prefetches (KIPP_CUDA_L2_PREFETCH_MB, at most the L2's size; 0 off)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    mb = float(os.environ.get("KIPP_CUDA_L2_PREFETCH_MB", DEFAULT_MB))
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return int(min(mb * 2**20, l2))


def prefetch_at_end() -> bool:
    """Where decode attention prefetches: at its end (default), after its own K/V loads, or at
    its start (KIPP_CUDA_L2_PREFETCH_AT=start), before its PDL wait."""
    return os.environ.get("KIPP_CUDA_L2_PREFETCH_AT", "end").strip() != "start"


def weight_ranges(modules: list[tuple[torch.nn.Module, int]], budget: int) -> list[tuple[int, int]]:
    """(address, bytes) of the rows each module's GEMV reads first, in order, until `budget`
    bytes: a module's weight tensors ([rows, ...], contiguous) are split into `parts` equal row
    blocks (gate_up: 2, its gate and up rows, which its programs read in pairs) and each block's
    first fraction taken, the same fraction for every tensor of the module."""
    ranges = []
    for module, parts in modules:
        tensors = [t for t in (*module.buffers(), *module.parameters()) if t.dim() >= 1]
        total = sum(t.numel() * t.element_size() for t in tensors)
        if budget <= 0 or total == 0:
            break
        frac = min(1.0, budget / total)
        for t in tensors:
            assert t.is_contiguous(), "weights are prefetched as contiguous row blocks"
            rows = t.shape[0] // parts
            row_bytes = t.stride(0) * t.element_size()
            take = int(rows * frac) * row_bytes
            for k in range(parts):
                if take > 0:
                    ranges.append((t.data_ptr() + k * rows * row_bytes, take))
        budget -= int(total * frac)
    return ranges


def prefetch_table(ranges: list[tuple[int, int]], device: torch.device) -> torch.Tensor | None:
    """int64 [R, 2] of (address, bytes) on device, None for no ranges."""
    if not ranges:
        return None
    return torch.tensor(ranges, dtype=torch.int64, device=device)
