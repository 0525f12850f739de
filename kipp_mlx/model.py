"""The Qwen3 dense model in MLX (QWEN3.md section 3), in the shape of mlx-lm's models/qwen3.py.

Parameter names are Hugging Face's, so loading a checkpoint is an identity mapping. The model owns
no state between steps: the paged KV cache and the step's attention metadata are arguments. A step
is one flat batch: the new tokens of every scheduled sequence packed into `[T]`.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kipp_core.config import ModelConfig
from kipp_core.rope import attention_factor, inv_freq
from kipp_mlx.attention import AttentionMetadata, attend
from kipp_mlx.kv_cache import PagedKVCache


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def swiglu_eager(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.rope_theta = cfg.rope_theta
        # YaRN: kipp_core.rope's blended frequencies, as the periods mx.fast.rope takes, and its
        # attention factor on the input (the same product as scaling cos and sin)
        self._rope_freqs, self._rope_scale = None, attention_factor(cfg.rope_scaling)
        if cfg.yarn:
            periods = 1.0 / inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            self._rope_freqs = mx.array(periods.astype(np.float32))
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.q_size, bias=False)
        self.k_proj = nn.Linear(h, cfg.kv_size, bias=False)
        self.v_proj = nn.Linear(h, cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        # One head_dim weight shared by all heads, applied per head before RoPE.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        # x: [T, H, D] -> [T, H, 1, D] so each token is its own batch entry with its own offset.
        T, H, D = x.shape
        if self._rope_scale != 1.0:
            x = x * self._rope_scale
        y = mx.fast.rope(
            x[:, :, None, :],
            D,
            traditional=False,
            base=None if self._rope_freqs is not None else self.rope_theta,
            scale=1.0,
            offset=positions,
            freqs=self._rope_freqs,
        )
        return y.reshape(T, H, D)

    def __call__(self, x: mx.array, meta: AttentionMetadata, kv: PagedKVCache) -> mx.array:
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        q = self.rope(q, meta.positions)
        k = self.rope(k, meta.positions)
        kv.write(self.layer_idx, k, v, meta.slot_mapping)  # the cache holds post-norm, post-RoPE K
        o = attend(q, kv, self.layer_idx, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act=swiglu):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._act = act

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self._act(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, act=swiglu):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, meta: AttentionMetadata, kv: PagedKVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), meta, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, act=swiglu):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i, act) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, input_ids: mx.array, meta: AttentionMetadata, kv: PagedKVCache):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, meta, kv)
        return self.norm(h)


class Model(nn.Module):
    """Qwen3ForCausalLM. `__call__` gives final-normed hidden states [T, hidden]; `logits` turns
    the rows that need them into logits, so a prefill never pays for a full-vocab head per token."""

    def __init__(self, cfg: ModelConfig, compile_act: bool = True):
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg, swiglu if compile_act else swiglu_eager)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, input_ids: mx.array, meta: AttentionMetadata, kv: PagedKVCache):
        return self.model(input_ids, meta, kv)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            out = self.model.embed_tokens.as_linear(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(mx.float32)

    def sanitize(self, weights: dict) -> dict:
        """Tied checkpoints may store a duplicate lm_head; the embedding is used instead."""
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
