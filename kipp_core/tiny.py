"""Checkpoints the project makes itself: `kipp-tiny` (the embedded default) and random weights in
any shape, in full Hugging Face layout, so they load through exactly the code a download does."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kipp_core.checkpoint import expected_shapes
from kipp_core.config import ModelConfig
from kipp_core.registry import TINY, RegistryEntry
from kipp_core.safetensors_file import f32_to_bf16, save_file
from kipp_core.vocab import ADDED_TOKENS, build_tokenizer_json, chat_template, tokenizer_config

NUM_TOKENS = ADDED_TOKENS[-1][0] + 1  # 151669

TINY_SEED = 0
TINY_VERSION = 2  # bump when the recipe changes, so caches are rebuilt
_SHARD_BYTES = 2 << 30


def kipp_home() -> Path:
    return Path(os.environ.get("KIPP_HOME", Path.home() / ".cache" / "kipp"))


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Weights that keep activations O(1) through the layers and logits spread (no argmax ties)."""
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name == "model.embed_tokens.weight" or name == "lm_head.weight":
        w = (0.3 * rng.standard_normal(shape)).astype(np.float32)
        w[NUM_TOKENS:] = 0.0  # padding rows past the tokenizer: logit 0, as good as never sampled
        return w
    fan_in = shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def generation_config(entry: RegistryEntry | None, cfg: ModelConfig) -> dict:
    if entry is not None and entry.is_base:
        return {
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "max_new_tokens": 2048,
            "do_sample": False,
        }
    s = entry.sampling if entry else None
    return {
        "bos_token_id": cfg.bos_token_id,
        "do_sample": True,
        "eos_token_id": list(entry.stop_token_ids) if entry else list(cfg.eos_token_ids),
        "pad_token_id": 151643,
        "temperature": s.temperature if s else 0.6,
        "top_k": s.top_k if s else 20,
        "top_p": s.top_p if s else 0.95,
    }


def write_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    entry: RegistryEntry | None = None,
    store_tied_lm_head: bool = False,
    shard_bytes: int = _SHARD_BYTES,
    make: Callable[[np.random.Generator, str, tuple[int, ...]], np.ndarray] = random_tensor,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-weight checkpoint: config, generation config, tokenizer, safetensors."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    st_dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[dtype]
    shapes = expected_shapes(cfg)
    if cfg.tie_word_embeddings and store_tied_lm_head:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    rng = np.random.default_rng(seed)
    shards: list[dict] = [{}]
    size = 0
    total = sum(int(np.prod(s)) for s in shapes.values())
    done = 0
    for name, shape in shapes.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            w = shards_get(shards, "model.embed_tokens.weight")
        else:
            w = make(rng, name, shape)
            if st_dtype == "BF16" and w.dtype != np.uint16:  # uint16: already bf16 bits
                w = f32_to_bf16(w)
            elif st_dtype == "F16":
                w = w.astype(np.float16)
        nbytes = w.nbytes
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = (st_dtype, w)
        size += nbytes
        done += int(np.prod(shape))
        if progress:
            progress(done, total)
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", {"format": "pt"})
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / fname, {"format": "pt"})
            weight_map.update({name: fname for name in shard})
        index = {
            "metadata": {"total_size": sum(a.nbytes for s in shards for _, a in s.values())},
            "weight_map": weight_map,
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    d = cfg.to_dict()
    d["torch_dtype"] = dtype
    d["transformers_version"] = "4.51.0"
    d["attention_dropout"] = 0.0
    d["initializer_range"] = 0.02
    d["use_cache"] = True
    if entry is not None:
        d["_name_or_path"] = entry.repo_id
    (out / "config.json").write_text(json.dumps(d, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config(entry, cfg), indent=2))
    write_tokenizer(
        out, base=bool(entry and entry.is_base), template=entry.chat_template if entry else "qwen3"
    )
    return out


def shards_get(shards: list[dict], name: str) -> np.ndarray:
    for s in shards:
        if name in s:
            return s[name][1]
    raise KeyError(name)


def write_tokenizer(out: Path, base: bool = False, template: str = "qwen3") -> None:
    cache = kipp_home() / "tokenizer" / f"v{TINY_VERSION}"
    cached = cache / "tokenizer.json"
    if not cached.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".tokenizer.{os.getpid()}.json"
        tmp.write_text(json.dumps(build_tokenizer_json(), ensure_ascii=False))
        os.replace(tmp, cached)
    shutil.copyfile(cached, out / "tokenizer.json")
    cfg = tokenizer_config(chat_template(template), base=base)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def tiny_path() -> Path:
    """The kipp-tiny checkpoint directory, created from its seed on first use."""
    path = kipp_home() / f"kipp-tiny-v{TINY_VERSION}"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kipp-tiny-", dir=path.parent))
    try:
        write_checkpoint(tmp, TINY.config, seed=TINY_SEED, entry=TINY)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def random_checkpoint(
    shape: str, out=None, dtype: str = "bfloat16", seed: int = 0, progress=None, force: bool = False
) -> Path:
    """A checkpoint of the registry shape `shape` with random weights, written to `out` (default:
    a cache folder under KIPP_HOME, reused when present). Uses torch when installed: it fills big
    tensors several times faster than numpy, and speed does not depend on the values."""
    from kipp_core.registry import lookup

    entry = lookup(shape)
    if entry is None:
        raise ValueError(f"unknown shape {shape!r}: see `kipp models`")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    cached = out is None
    out = Path(out) if out else kipp_home() / "random" / f"{entry.name}-{dtype}-seed{seed}"
    if (out / "config.json").exists():
        if cached:
            return out
        if not force:
            raise ValueError(f"{out} already holds a checkpoint; pass --force to overwrite it")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    make = (
        _torch_maker(seed, dtype == "bfloat16")
        if importlib.util.find_spec("torch")
        else random_tensor
    )
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_checkpoint(
            tmp, entry.config, seed=seed, dtype=dtype, entry=entry, make=make, progress=progress
        )
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _torch_maker(seed: int, bf16_bits: bool = False):
    """kipp_core.tiny.random_tensor's distributions, drawn by torch (on the GPU when there is one,
    returning bf16 bits directly: an 8B checkpoint is then written in seconds, not minutes)."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)

    def make(_rng, name: str, shape: tuple[int, ...]) -> np.ndarray:
        w = torch.randn(shape, generator=gen, dtype=torch.float32, device=dev)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * w
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            w.mul_(0.3)[NUM_TOKENS:] = 0.0
        else:
            w.mul_(shape[-1] ** -0.5)
        if dev == "cuda" and bf16_bits:  # uint16 bf16 bits: written as they are
            return w.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
        return w.cpu().numpy()

    return make
