"""The Qwen3 dense model in MLX (QWEN3.md section 3), in the shape of mlx-lm's models/qwen3.py.

q, k and v are one projection (`qkv_proj`) and gate and up another (`gate_up_proj`), split at
load from the checkpoint's separate matrices (kipp_mlx.loader). The model owns no state between
steps: the paged KV cache and the step's attention metadata are arguments. A step is one flat
batch: the new tokens of every scheduled sequence packed into `[T]`. The custom kernels (or their
references) come in a `Kernels`, chosen once at load by kipp_mlx.kernels.ladder.

A layer takes the residual stream and the previous layer's MLP output and adds them in its first
norm (add_rms_norm), so a layer is ten launches in decode: add + norm, qkv, q/k norm + RoPE + the
K/V layout, the KV scatter, attention (and its split merge), o_proj, add + norm, gate_up, SwiGLU,
down.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from kipp_core.config import ModelConfig
from kipp_mlx.attention import AttentionMetadata, attend
from kipp_mlx.kernels.add_rms_norm import add_rms_norm_ref
from kipp_mlx.kernels.qk_norm_rope import qk_norm_rope_ref, rope_table
from kipp_mlx.kernels.swiglu import swiglu_ref
from kipp_mlx.kv_cache import PagedKVCache


@dataclass
class Kernels:
    """The functions a step calls: a custom kernel where the ladder accepted it, else its
    reference. `decode_attention` None: the batched gather reference; `qk_norm_rope_write`
    None: qk_norm_rope, then the cache's scatter."""

    qk_norm_rope: object = qk_norm_rope_ref
    qk_norm_rope_write: object | None = None  # and K / V into a dense pool, in place
    add_rms_norm: object = add_rms_norm_ref
    decode_attention: object | None = None
    swiglu: object = swiglu_ref


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        h = cfg.hidden_size
        self.qkv_proj = nn.Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        # One head_dim weight shared by all heads, applied per head before RoPE.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)

    def __call__(self, x, meta: AttentionMetadata, kv: PagedKVCache, step: StepInputs):
        T, layer = x.shape[0], self.layer_idx
        args = (
            self.qkv_proj(x),
            self.q_norm.weight,
            self.k_norm.weight,
            meta.positions,
            step.cos_sin,
            self.eps,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        # post-norm, post-RoPE K into the cache: written by the kernel itself into a dense pool
        # (the pool it returns depends on the launch, so its readers follow it), else by the
        # cache's scatter
        write = step.kernels.qk_norm_rope_write
        if write is None or kv.kv_quant or (meta.num_decode and meta.decode_attention is None):
            q, kv_new = step.kernels.qk_norm_rope(*args)
            kv.write(layer, kv_new, meta.slot_mapping)
        else:
            q, kv_new, pool = write(*args, kv.pool(layer), meta.slot_mapping)
            kv.set_pool(layer, pool)
        o = attend(q, kv_new, kv, layer, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def __call__(self, x: mx.array, step: StepInputs) -> mx.array:
        return self.down_proj(step.kernels.swiglu(self.gate_up_proj(x)))


@dataclass
class StepInputs:
    kernels: Kernels
    cos_sin: mx.array  # [positions, head_dim] float32 (rope_table)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps

    def __call__(self, h, delta, meta, kv, step: StepInputs):
        """h: the residual stream; delta: the previous layer's MLP output (None for the first).
        Returns this layer's (h, MLP output)."""
        k = step.kernels
        if delta is None:
            x = mx.fast.rms_norm(h, self.input_layernorm.weight, self.eps)
        else:
            h, x = k.add_rms_norm(h, delta, self.input_layernorm.weight, self.eps)
        a = self.self_attn(x, meta, kv, step)
        h, x = k.add_rms_norm(h, a, self.post_attention_layernorm.weight, self.eps)
        return h, self.mlp(x, step)


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps

    def __call__(self, input_ids: mx.array, meta, kv, step: StepInputs):
        h, delta = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, delta = layer(h, delta, meta, kv, step)
        return step.kernels.add_rms_norm(h, delta, self.norm.weight, self.eps)[1]


class Model(nn.Module):
    """Qwen3ForCausalLM. `__call__` gives final-normed hidden states [T, hidden]; `logits` turns
    the rows that need them into logits, so a prefill never pays for a full-vocab head per token."""

    def __init__(self, cfg: ModelConfig, max_positions: int = 0):
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        n = max_positions or cfg.max_position_embeddings
        self._step = StepInputs(
            Kernels(), rope_table(n, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        )

    @property
    def kernels(self) -> Kernels:
        return self._step.kernels

    def set_kernels(self, kernels: Kernels) -> None:
        self._step.kernels = kernels

    def __call__(self, input_ids: mx.array, meta: AttentionMetadata, kv: PagedKVCache):
        return self.model(input_ids, meta, kv, self._step)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(mx.float32)
