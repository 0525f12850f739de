"""The Qwen3 model in PyTorch: fused qkv_proj and gate_up_proj, Triton kernels through
kipp_cuda.kernels, paged KV through the attention metadata. Tokens are flattened: [T, hidden].

Tensor parallelism (tp_size > 1): qkv_proj/gate_up_proj are column-parallel (local heads),
o_proj/down_proj row-parallel, embedding and head split by vocabulary. A row-parallel output is
all-reduced together with the residual add and RMSNorm after it (tp_reduce.TPReduce.reduce_norm),
so a layer takes and returns its hidden state as this rank's partial, before that all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kipp_core.config import ModelConfig
from kipp_cuda.attention import AttentionMetadata, LayerKV, attention, store_qkv
from kipp_cuda.kernels.embedding import take_last_ids
from kipp_cuda.kernels.head_argmax import finish_argmax, new_argmax_keys
from kipp_cuda.kernels.qk_norm_rope import rope_cos_sin_cache
from kipp_cuda.layers import embed, swiglu_mlp
from kipp_cuda.tp_reduce import TPReduce


class Qwen3Layer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp_size: int,
        modules: dict[str, nn.Module],
        norms: dict[str, torch.Tensor],
    ):
        super().__init__()
        self.num_heads = cfg.num_attention_heads // tp_size
        self.num_kv_heads = cfg.num_key_value_heads // tp_size
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.qkv_proj = modules["qkv_proj"]
        self.o_proj = modules["o_proj"]
        self.gate_up_proj = modules["gate_up_proj"]
        self.down_proj = modules["down_proj"]
        for name, w in norms.items():  # input_layernorm, post_attention_layernorm, q_norm, k_norm
            self.register_buffer(name, w)

    def forward(self, positions, hidden, residual, kv: LayerKV, meta: AttentionMetadata, cos_sin):
        # hidden: this rank's partial of the layer input (the embedding or the previous layer's
        # down_proj output), all-reduced here with the residual add and the input norm
        h, residual = self.tp.reduce_norm(hidden, residual, self.input_layernorm, self.eps)
        T = h.shape[0]
        q = store_qkv(self.qkv_proj(h), self, kv, meta, positions, cos_sin)
        a = attention(q, kv, meta, self.head_dim**-0.5)
        h, residual = self.tp.reduce_norm(
            self.o_proj(a.reshape(T, -1)), residual, self.post_attention_layernorm, self.eps
        )
        return swiglu_mlp(self.gate_up_proj, self.down_proj, h), residual


class Qwen3Model(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[Qwen3Layer],
        embed_tokens: nn.Module,
        norm: torch.Tensor,
        lm_head: nn.Module,
        dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.layers = nn.ModuleList(layers)
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.register_buffer("norm", norm)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.vocab_per_rank = -(-cfg.vocab_size // tp_size)
        dev = norm.device
        self.register_buffer(
            "cos_sin",
            rope_cos_sin_cache(
                cfg.max_position_embeddings, cfg.head_dim, cfg.rope_theta, dev, cfg.rope_scaling
            ),
        )
        # every layer's two norms and the final one: 2 L + 1 call sites a forward
        # the head GEMV's running argmax key (compute_logits); not state: persistent=False
        self.register_buffer("head_keys", new_argmax_keys(1, dev), persistent=False)
        self.tp = TPReduce(tp_rank, tp_size, 2 * len(layers) + 1, cfg.hidden_size, dtype, dev)
        for layer in self.layers:
            layer.tp = self.tp

    def embed(self, input_ids: torch.Tensor, take_last=None) -> torch.Tensor:
        """This rank's partial of the embedding (the first layer all-reduces it); take_last as
        layers.embed's."""
        if self.tp_size == 1:
            return embed(self.embed_tokens, input_ids, self.dtype, take_last)
        input_ids = take_last_ids(input_ids, take_last)
        # Vocabulary-parallel: each rank holds rows [lo, lo + n); others contribute zeros.
        lo = self.tp_rank * self.vocab_per_rank
        local = input_ids - lo
        inside = (local >= 0) & (local < self.vocab_per_rank)
        x = embed(self.embed_tokens, torch.where(inside, local, 0), self.dtype)
        return x * inside[:, None].to(x.dtype)

    def forward(
        self,
        input_ids,
        positions,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
        take_last=None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden]. take_last=(flags, last): token t is last[t]
        where flags[t] != 0, else input_ids[t]."""
        self.tp.begin()
        hidden = self.embed(input_ids, take_last)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv, meta, self.cos_sin)
        h, _ = self.tp.reduce_norm(hidden, residual, self.norm, self.config.rms_norm_eps)
        return h

    def compute_logits(self, hidden: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [R, vocab] of the given hidden rows; with top (int64, >= R long), their
        argmax is written into top[:R] too. One row on one rank takes the head GEMV's epilogue:
        fp32 logits and the argmax without the cast, memset and reduce launches after it
        (kernels/head_argmax.py)."""
        R = hidden.shape[0]
        if top is not None and R == 1 and self.tp_size == 1:
            if self.lm_head.out_features == self.config.vocab_size:
                logits = self.lm_head(hidden, head_keys=self.head_keys)
                finish_argmax(self.head_keys, top[:1])
                return logits
        logits = self._logits(hidden)
        if top is not None:
            torch.argmax(logits, dim=-1, out=top[:R])
        return logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.config.vocab_size]
