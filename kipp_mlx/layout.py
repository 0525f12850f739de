"""Weight layout for MLX's CPU build, a module swap applied after loading (the model stays plain).

Three measured facts about MLX on the CPU (Linux wheels, which call the single-threaded reference
BLAS; 0.6B shapes, 2 cores):
- `x @ W.T` hands BLAS a transposed operand; the same values stored [in, out] multiply 1.3-1.8x
  faster.
- a bfloat16/float16 gemm converts both operands to float32 on every call and rounds the result;
  holding the weight in float32 gives bit-identical outputs 3.5x faster for one row (decode), at
  twice the weight memory. It is done when the float32 copy fits in `UPCAST_RAM_FRACTION` of RAM.
- one gemm uses one core; splitting W's columns into one part per core, each multiplied on its
  own CPU stream (MLX runs streams on separate threads), is 1.5-2.4x faster on 2 cores. Each
  output column is the same dot product as before, so the result is unchanged.
A tied embedding keeps only its transposed copy, which also serves the lookup. On Metal and CUDA
the HF layout stays.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

log = logging.getLogger("kipp")

UPCAST_RAM_FRACTION = 0.4
MAX_STREAMS = 8
_streams: list = []


def cpu_streams(n: int) -> list:
    """`n` CPU streams shared by every split weight; thread-local, because MLX binds a stream to
    the thread that made it and the server steps the engine from a worker thread."""
    while len(_streams) < n:
        _streams.append(mx.new_thread_local_stream(mx.cpu))
    return _streams[:n]


def num_parts() -> int:
    return max(1, min(MAX_STREAMS, os.cpu_count() or 1))


class TransposedLinear(nn.Module):
    """A bias-free linear holding W.T ([in, out], `store_dtype`) as `parts`, column blocks that
    are multiplied on separate CPU streams; the output has the input's dtype."""

    def __init__(self, weight: mx.array, store_dtype=None, num_parts: int = 1):
        super().__init__()
        w = weight.T.astype(store_dtype or weight.dtype)
        n = w.shape[1]
        cuts = [n * i // num_parts for i in range(num_parts + 1)]
        self.parts = [mx.contiguous(w[:, a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]

    def __call__(self, x: mx.array) -> mx.array:
        if len(self.parts) == 1:
            y = x @ self.parts[0]
        else:
            streams = cpu_streams(len(self.parts))
            y = mx.concatenate(
                [mx.matmul(x, w, stream=s) for w, s in zip(self.parts, streams)], axis=-1
            )
        return y.astype(x.dtype)


class TransposedEmbedding(TransposedLinear):
    """An embedding held as column parts of W.T [hidden, vocab]: lookups gather columns;
    `as_linear` is the tied head."""

    def __init__(self, weight: mx.array, store_dtype=None, num_parts: int = 1):
        super().__init__(weight, store_dtype, num_parts)
        self.dtype = weight.dtype

    def __call__(self, ids: mx.array) -> mx.array:
        out, a = None, 0
        for p in self.parts:
            n = p.shape[1]
            cols = mx.take(p, mx.clip(ids - a, 0, n - 1), axis=1)  # [hidden, T]
            out = cols if out is None else mx.where((ids >= a) & (ids < a + n), cols, out)
            a += n
        return out.T.astype(self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return TransposedLinear.__call__(self, x)


def upcast_fits(model: nn.Module) -> bool:
    """Whether float32 copies of the 2-D weights fit in UPCAST_RAM_FRACTION of system RAM."""
    n = sum(v.size for _, v in tree_flatten(model.parameters()) if v.ndim == 2)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 4 * n <= UPCAST_RAM_FRACTION * ram


def use_cpu_layout(model: nn.Module, tied: bool, upcast: bool | None = None) -> None:
    """Swap every dense nn.Linear (and a tied nn.Embedding) for its transposed, split form, in
    place; `upcast` (None: when it fits) stores half-precision weights in float32."""
    if upcast is None:
        upcast = upcast_fits(model)
    store = mx.float32 if upcast else None
    parts = num_parts()
    log.info(
        "mlx on the CPU: weights stored [in, out]%s, in %d column parts on %d streams",
        " in float32 (bit-identical to MLX's half-precision CPU gemm)" if upcast else "",
        parts,
        parts,
    )
    for path, m in list(model.named_modules()):
        if isinstance(m, nn.Linear):
            set_module(model, path, TransposedLinear(m.weight, store, parts))
        elif isinstance(m, nn.Embedding) and tied:
            set_module(model, path, TransposedEmbedding(m.weight, store, parts))
        else:
            continue
        mx.eval(model.parameters())  # one matrix at a time: the HF copy is freed as we go


def set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    *parents, last = path.split(".")
    obj = root
    for p in parents:
        obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
    setattr(obj, last, new)
