"""Build the torch model from a checkpoint: HF names at load, fused qkv/gate_up at run time, TP
slices, and weight-only quantization (at load, or as stored by `kipp quantize`)."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from kipp_core.checkpoint import Checkpoint, layer_prefix
from kipp_core.quant import check_scheme
from kipp_cuda.layers import make_linear
from kipp_cuda.model import Qwen3Layer, Qwen3Model
from kipp_cuda.quant import quantize

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def to_torch(raw) -> torch.Tensor:
    """A checkpoint tensor as a CPU torch tensor (no copy for memory-mapped data)."""
    with warnings.catch_warnings():  # read-only memmaps: we only ever copy out of them
        warnings.simplefilter("ignore")
        data = raw.data
        if raw.dtype == "BF16":
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        if raw.dtype == "U32":
            return torch.from_numpy(data.view(np.int32))
        return torch.from_numpy(data)


class WeightLoader:
    def __init__(
        self,
        ckpt: Checkpoint,
        device: torch.device,
        dtype: torch.dtype,
        quant: str | None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        self.ckpt, self.device, self.dtype = ckpt, device, dtype
        self.stored = (ckpt.quantization or {}).get("scheme")
        if self.stored and quant and quant != self.stored:
            raise ValueError(f"checkpoint is quantized as {self.stored}; --quant {quant} differs")
        self.scheme = self.stored or quant
        if self.scheme:
            check_scheme(self.scheme)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        cfg = ckpt.config
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(cfg, name) % tp_size:
                raise ValueError(
                    f"{name} ({getattr(cfg, name)}) is not divisible by tensor_parallel {tp_size}"
                )
        self.nbytes = 0

    def tensor(self, name: str) -> torch.Tensor:
        t = to_torch(self.ckpt.raw(name)).to(self.device)
        return t.to(self.dtype) if t.is_floating_point() else t

    def rows(self, name: str, parts: int = 1) -> tuple[int, int]:
        n = self.ckpt.raw(name).shape[0] // parts
        per = -(-n // self.tp_size)
        return self.tp_rank * per, min(n, (self.tp_rank + 1) * per)

    def linear_parts(self, names: list[str], split: str, pad_rows_to: int | None = None):
        """Load and fuse linears along rows. split: "rows" (column-parallel), "cols"
        (row-parallel) or "none"."""
        if self.stored:
            return self._stored_parts(names, split, pad_rows_to)
        ws = []
        for n in names:
            w = to_torch(self.ckpt.raw(n))
            ws.append(self._slice(w, split))
        w = torch.cat(ws, dim=0) if len(ws) > 1 else ws[0]
        w = self._pad(w.to(self.device), pad_rows_to).to(self.dtype)
        if self.scheme is None:
            self.nbytes += w.nbytes
            return {"weight": w}
        parts = quantize(w, self.scheme)
        self.nbytes += sum(p.nbytes for p in parts.values())
        return parts

    def _stored_parts(self, names, split, pad_rows_to):
        out = {}
        for key in ("weight", "scales", "biases"):
            if key == "biases" and self.scheme == "q8_0":
                continue
            ts = []
            for n in names:
                base = n[: -len(".weight")]
                raw = self.ckpt.raw(f"{base}.{key}")
                t = to_torch(raw)
                # row-parallel splits the input dim: packed words and groups split alike
                ts.append(self._slice(t, split))
            t = torch.cat(ts, dim=0) if len(ts) > 1 else ts[0]
            t = self._pad(t.to(self.device), pad_rows_to)
            if key != "weight" and self.scheme != "q8_0":  # affine scales/biases: model dtype
                t = t.to(self.dtype)
            out[key] = t
        self.nbytes += sum(p.nbytes for p in out.values())
        return out

    def _slice(self, w: torch.Tensor, split: str) -> torch.Tensor:
        if self.tp_size == 1 or split == "none":
            return w
        dim = 0 if split == "rows" else 1
        n = w.shape[dim] // self.tp_size
        return w.narrow(dim, self.tp_rank * n, n)

    def _pad(self, w: torch.Tensor, rows: int | None) -> torch.Tensor:
        if rows is None or w.shape[0] == rows:
            return w
        pad = torch.zeros((rows - w.shape[0], *w.shape[1:]), dtype=w.dtype, device=w.device)
        return torch.cat([w, pad])

    def vocab_parts(self, name: str) -> dict[str, torch.Tensor]:
        """Embedding/head rows of this rank, padded to an equal share of the vocabulary."""
        cfg = self.ckpt.config
        per = -(-cfg.vocab_size // self.tp_size)
        if self.tp_size == 1:
            return self.linear_parts([name], "none")
        lo = self.tp_rank * per
        hi = min(cfg.vocab_size, lo + per)
        parts = self.linear_parts([name], "none")
        return {k: self._pad(v[lo:hi], per) for k, v in parts.items()}


def build_model(
    ckpt: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    quant: str | None,
    tp_rank: int = 0,
    tp_size: int = 1,
    progress=None,
) -> tuple[Qwen3Model, int]:
    """The model on `device` and its weight bytes."""
    cfg = ckpt.config
    ld = WeightLoader(ckpt, device, dtype, quant, tp_rank, tp_size)
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = layer_prefix(i)
        lin = {
            "qkv_proj": ld.linear_parts([p + f"self_attn.{x}_proj.weight" for x in "qkv"], "rows"),
            "o_proj": ld.linear_parts([p + "self_attn.o_proj.weight"], "cols"),
            "gate_up_proj": ld.linear_parts(
                [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "rows"
            ),
            "down_proj": ld.linear_parts([p + "mlp.down_proj.weight"], "cols"),
        }
        modules = {k: make_linear(v, ld.scheme) for k, v in lin.items()}
        norms = {
            n.split(".")[-1]: ld.tensor(p + n + ".weight")
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "self_attn.q_norm",
                "self_attn.k_norm",
            )
        }
        layers.append(Qwen3Layer(cfg, tp_size, modules, norms))
        if progress:
            progress(i + 1, cfg.num_hidden_layers)
    embed_tokens = make_linear(ld.vocab_parts("model.embed_tokens.weight"), ld.scheme)
    if cfg.tie_word_embeddings:
        lm_head: nn.Module = embed_tokens
    else:
        lm_head = make_linear(ld.vocab_parts("lm_head.weight"), ld.scheme)
    norm = ld.tensor("model.norm.weight")
    model = Qwen3Model(cfg, layers, embed_tokens, norm, lm_head, dtype, tp_rank, tp_size)
    return model.eval(), ld.nbytes
