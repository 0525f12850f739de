"""The paged KV cache: one pool per layer, addressed by the engine's block tables.

Slot `block_id * block_size + offset` holds one token. Pools start small and grow (doubling, up to
`num_blocks`) when a block table names a block beyond them, so memory is committed as the engine
uses it. `write` scatters into the pool, which MLX does in place only when nothing else holds it;
while the previous step runs, its kernels hold it, so each step copies it. On a GPU the
q/k-norm kernel writes a dense pool itself, in place, where the ladder chose it
(kipp_mlx.kernels.qk_norm_rope.qk_norm_rope_write, `set_pool`).
A dense layer's K and V share one pool, [slots, 2, num_kv_heads, head_dim], so a step writes a
layer's new tokens with one scatter and the decode kernel reads a token's K and V rows from one
array.
"""

from __future__ import annotations

import mlx.core as mx

from kipp_mlx.quant import QK8_0, dequantize_q8_0, quantize_q8_0

_MIN_BLOCKS = 16


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype,
        kv_quant: str | None = None,
    ):
        if kv_quant not in (None, "q8_0"):
            raise ValueError(f"kv_quant must be None or 'q8_0', got {kv_quant!r}")
        if kv_quant and head_dim % QK8_0:
            raise ValueError(f"kv_quant 'q8_0' needs head_dim divisible by 32, got {head_dim}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.kv_quant = dtype, kv_quant
        self.capacity = 0  # blocks allocated
        # dense: kv[layer]: [slots, 2, num_kv_heads, head_dim] in dtype (K, then V)
        # q8_0: k[layer] = (qs int8 [slots, Hkv, D], d fp16 [slots, Hkv, D / 32]), same for v
        self.kv: list = [None] * num_layers
        self.k: list = [None] * num_layers
        self.v: list = [None] * num_layers
        self.reserve(min(_MIN_BLOCKS, num_blocks) - 1)

    @classmethod
    def for_config(cls, cfg, num_blocks: int, block_size: int, dtype, kv_quant=None):
        return cls(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
            kv_quant,
        )

    @staticmethod
    def bytes_per_token(cfg, itemsize: int, kv_quant: str | None = None) -> int:
        """K and V of one token over all layers (q8_0: 32 int8 and one fp16 per block)."""
        d = cfg.head_dim
        per_head = d + d // QK8_0 * 2 if kv_quant else d * itemsize
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * per_head

    def _groups(self) -> tuple[list, ...]:
        return (self.k, self.v) if self.kv_quant else (self.kv,)

    def _empty(self, num_slots: int):
        shape = (num_slots, self.num_kv_heads, self.head_dim)
        if self.kv_quant:
            d_shape = (num_slots, self.num_kv_heads, self.head_dim // QK8_0)
            return mx.zeros(shape, mx.int8), mx.zeros(d_shape, mx.float16)
        return mx.zeros((num_slots, 2, self.num_kv_heads, self.head_dim), self.dtype)

    def reserve(self, max_block_id: int) -> None:
        """Make sure block `max_block_id` exists."""
        if max_block_id >= self.num_blocks:
            raise ValueError(f"block id {max_block_id} is outside the pool of {self.num_blocks}")
        if max_block_id < self.capacity:
            return
        new = min(self.num_blocks, max(max_block_id + 1, 2 * self.capacity, _MIN_BLOCKS))
        extra = (new - self.capacity) * self.block_size
        for pools in self._groups():
            for i, p in enumerate(pools):
                e = self._empty(extra)
                if p is None:
                    pools[i] = e
                elif self.kv_quant:
                    pools[i] = tuple(mx.concatenate([a, b]) for a, b in zip(p, e))
                else:
                    pools[i] = mx.concatenate([p, e])
        self.capacity = new
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        out = []
        for pools in self._groups():
            for p in pools:
                out.extend(p if isinstance(p, tuple) else [p])
        return out

    def write(self, layer: int, kv: mx.array, slot_mapping: mx.array) -> None:
        """kv: [T, 2, num_kv_heads, head_dim] (K, V) for the slots in slot_mapping [T]."""
        if not self.kv_quant:
            p = self.kv[layer]
            p[slot_mapping] = kv if kv.dtype == self.dtype else kv.astype(self.dtype)
            self.kv[layer] = p
            return
        for pools, x in ((self.k, kv[:, 0]), (self.v, kv[:, 1])):
            qs, d = quantize_q8_0(x)
            pq, pd = pools[layer]
            pq[slot_mapping] = qs
            pd[slot_mapping] = d
            pools[layer] = (pq, pd)

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """K, V of `slots` (any shape S) as [*S, num_kv_heads, head_dim] in the compute dtype."""
        if self.kv_quant:
            (kq, kd), (vq, vd) = self.k[layer], self.v[layer]
            return (
                dequantize_q8_0(kq[slots], kd[slots], self.dtype),
                dequantize_q8_0(vq[slots], vd[slots], self.dtype),
            )
        kv = self.kv[layer][slots]
        return kv[..., 0, :, :], kv[..., 1, :, :]

    def copy_block(self, src: int, dst: int) -> None:
        """Block src's K/V into block dst, in every layer (a prompt-end hit's tail)."""
        a, b = src * self.block_size, dst * self.block_size
        n = self.block_size
        for pools in self._groups():
            for i, p in enumerate(pools):
                parts = p if self.kv_quant else (p,)
                for x in parts:
                    x[b : b + n] = x[a : a + n]
                pools[i] = tuple(parts) if self.kv_quant else parts[0]

    def pool(self, layer: int) -> mx.array:
        """The dense layer's pool [slots, 2, num_kv_heads, head_dim]."""
        assert not self.kv_quant
        return self.kv[layer]

    def set_pool(self, layer: int, pool: mx.array) -> None:
        """The dense layer's pool after a write outside `write` (qk_norm_rope_write)."""
        assert not self.kv_quant and pool.shape == self.kv[layer].shape
        self.kv[layer] = pool
