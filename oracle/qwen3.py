"""The numpy oracle: the plainest correct Qwen3 forward (QWEN3.md section 3), float32 or float64.

Every backend is gated against these functions. Layouts: activations `[L, hidden]`, per-head
tensors `[L, heads, head_dim]`, linear weights in HF order `[out, in]` (so `x @ w.T`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kipp_core.checkpoint import Checkpoint, layer_prefix
from kipp_core.config import ModelConfig
from kipp_core.rope import cos_sin


@dataclass
class LayerWeights:
    input_layernorm: np.ndarray
    q_proj: np.ndarray
    k_proj: np.ndarray
    v_proj: np.ndarray
    o_proj: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_attention_layernorm: np.ndarray
    gate_proj: np.ndarray
    up_proj: np.ndarray
    down_proj: np.ndarray


@dataclass
class Weights:
    config: ModelConfig
    embed_tokens: np.ndarray
    layers: list[LayerWeights]
    norm: np.ndarray
    lm_head: np.ndarray  # the embedding itself when tied

    @property
    def dtype(self):
        return self.embed_tokens.dtype


def load_weights(ckpt: Checkpoint, dtype=np.float32) -> Weights:
    cfg = ckpt.config
    if ckpt.quantization:
        from kipp_core.quant import dequantized_weights

        get = dequantized_weights(ckpt, dtype)
    else:

        def get(name):
            return ckpt.get(name, dtype)

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = layer_prefix(i)
        layers.append(
            LayerWeights(
                input_layernorm=get(p + "input_layernorm.weight"),
                q_proj=get(p + "self_attn.q_proj.weight"),
                k_proj=get(p + "self_attn.k_proj.weight"),
                v_proj=get(p + "self_attn.v_proj.weight"),
                o_proj=get(p + "self_attn.o_proj.weight"),
                q_norm=get(p + "self_attn.q_norm.weight"),
                k_norm=get(p + "self_attn.k_norm.weight"),
                post_attention_layernorm=get(p + "post_attention_layernorm.weight"),
                gate_proj=get(p + "mlp.gate_proj.weight"),
                up_proj=get(p + "mlp.up_proj.weight"),
                down_proj=get(p + "mlp.down_proj.weight"),
            )
        )
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else get(ckpt.lm_head_name())
    return Weights(cfg, embed, layers, get("model.norm.weight"), lm_head)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(var + eps))


def rope_cos_sin(
    positions: np.ndarray, head_dim: int, theta: float, dtype=np.float32, rope_scaling=None
):
    """cos, sin of shape [L, head_dim] in the half-split (NeoX) layout: freqs repeated twice;
    with YaRN (`rope_scaling`) its blended frequencies, and both times its attention factor."""
    return cos_sin(positions, head_dim, theta, rope_scaling, dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: [L, heads, head_dim]; rotate_half(x) = cat(-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
    """q: [L, Hq, D] at absolute positions q_pos; k, v: [T, Hkv, D] for positions 0..T-1.
    Causal: query at position p sees keys 0..p. Returns [L, Hq, D]."""
    L, Hq, D = q.shape
    T, Hkv, _ = k.shape
    groups = Hq // Hkv
    k = np.repeat(k, groups, axis=1)  # GQA: q head h reads kv head h // groups
    v = np.repeat(v, groups, axis=1)
    scores = np.einsum("lhd,thd->hlt", q, k) * (D**-0.5)
    mask = np.arange(T)[None, :] > np.asarray(q_pos)[:, None]  # [L, T]
    scores = np.where(mask[None], -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hlt,thd->lhd", p, v)


class KVCache:
    """Contiguous per-layer K/V (post-norm, post-RoPE K), as `transformers` keeps it."""

    def __init__(self, num_layers: int):
        self.k: list[np.ndarray | None] = [None] * num_layers
        self.v: list[np.ndarray | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[0]

    def update_and_fetch(self, layer: int, k: np.ndarray, v: np.ndarray):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])
        return self.k[layer], self.v[layer]


def decoder_layer(
    w: LayerWeights,
    cfg: ModelConfig,
    x: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    cache,
    layer: int,
) -> np.ndarray:
    L = x.shape[0]
    h = rms_norm(x, w.input_layernorm, cfg.rms_norm_eps)
    q = (h @ w.q_proj.T).reshape(L, cfg.num_attention_heads, cfg.head_dim)
    k = (h @ w.k_proj.T).reshape(L, cfg.num_key_value_heads, cfg.head_dim)
    v = (h @ w.v_proj.T).reshape(L, cfg.num_key_value_heads, cfg.head_dim)
    q = apply_rope(rms_norm(q, w.q_norm, cfg.rms_norm_eps), cos, sin)  # q/k norm per head, pre-RoPE
    k = apply_rope(rms_norm(k, w.k_norm, cfg.rms_norm_eps), cos, sin)
    k_all, v_all = cache.update_and_fetch(layer, k, v)
    a = attention(q, k_all, v_all, positions)
    x = x + a.reshape(L, -1) @ w.o_proj.T
    h = rms_norm(x, w.post_attention_layernorm, cfg.rms_norm_eps)
    gate = h @ w.gate_proj.T
    act = gate / (1.0 + np.exp(-gate)) * (h @ w.up_proj.T)  # SwiGLU: silu(gate) * up
    return x + act @ w.down_proj.T


def forward_hidden(w: Weights, token_ids, start_pos: int, cache) -> np.ndarray:
    """Final-normed hidden states [L, hidden] of `token_ids` at positions start_pos.."""
    cfg = w.config
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.arange(start_pos, start_pos + len(ids))
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, w.dtype.type, cfg.rope_scaling)
    x = w.embed_tokens[ids]
    for i, lw in enumerate(w.layers):
        x = decoder_layer(lw, cfg, x, positions, cos, sin, cache, i)
    return rms_norm(x, w.norm, cfg.rms_norm_eps)


def compute_logits(w: Weights, hidden: np.ndarray) -> np.ndarray:
    return hidden @ w.lm_head.T


def forward(w: Weights, token_ids, start_pos: int = 0, cache: KVCache | None = None) -> np.ndarray:
    """Logits [L, vocab] for `token_ids`, extending `cache` (a fresh one when None)."""
    if cache is None:
        cache = KVCache(w.config.num_hidden_layers)
    return compute_logits(w, forward_hidden(w, token_ids, start_pos, cache))
