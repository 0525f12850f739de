"""Write a quantized copy of a float checkpoint in the on-disk format of kipp_core.quant.

Quantized weights: q8_0 as int8 weight + fp16 scales; affine as uint32 weight + scales and biases
in the source dtype (bf16 kept as its uint16 bits). Every other tensor is copied as stored. The
output is written to a temporary folder beside `out` and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kipp_core.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint
from kipp_core.quant import check_scheme, dequantize_tensor, is_quantized_name, quantize_tensor
from kipp_core.safetensors_file import bf16_to_f32, f32_to_bf16, save_file

SHARD_BYTES = 2 << 30
_CHUNK_ELEMS = 1 << 24  # rows are quantized independently, so big tensors go in row chunks
# Files besides the weights that a checkpoint directory carries (tokenizer, generation config).
_COPY_SUFFIXES = (".json", ".txt", ".jinja", ".model", ".tiktoken")


@dataclass
class QuantizeReport:
    src_bytes: int  # tensor bytes before
    dst_bytes: int  # tensor bytes after
    rel_rms_error: float  # ||w - dequant(quant(w))|| / ||w|| over every quantized weight
    num_quantized: int
    num_copied: int
    out: Path


def quantize_checkpoint(
    src: Checkpoint,
    out: str | os.PathLike,
    scheme: str,
    group_size: int = 32,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> QuantizeReport:
    """Quantize `src` into the directory `out`; ValueError if `out` exists and not `force`."""
    bits, default_group = check_scheme(scheme)
    if group_size != default_group:
        raise ValueError(
            f"group size {group_size} is not supported for {scheme}: the loaders read "
            f"{default_group} only"
        )
    if src.quantization:
        raise ValueError(f"{src.path} is already quantized ({src.quantization.get('scheme')})")
    out = Path(out)
    if out.resolve() == src.path.resolve():
        raise ValueError("--out must differ from the source checkpoint")
    if out.exists() and not force:
        raise ValueError(f"{out} exists; pass --force to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()  # not mkdtemp: the result should get the usual permissions
    try:
        report = _write(src, tmp, scheme, bits, group_size, progress)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.out = out
    return report


def _write(src, tmp: Path, scheme, bits, group_size, progress) -> QuantizeReport:
    cfg = src.config
    # Tied checkpoints read the head from the embedding; a stored copy would only add size.
    names = [n for n in src.names() if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    total = sum(src.raw(n).data.nbytes for n in names)
    shards: list[list[str]] = [[]]
    pending: dict[str, tuple[str, np.ndarray]] = {}
    size = done = src_bytes = dst_bytes = num_q = 0
    err2 = ref2 = 0.0
    weight_map: dict[str, str] = {}

    def flush():
        nonlocal pending, size
        if pending:
            fname = f"model-{len(shards):05d}.safetensors"
            save_file(pending, tmp / fname, {"format": "pt"})
            weight_map.update({k: fname for k in pending})
            shards.append([])
            pending, size = {}, 0

    for name in names:
        raw = src.raw(name)
        src_bytes += raw.data.nbytes
        if is_quantized_name(name) and raw.dtype in ("BF16", "F16", "F32", "F64"):
            parts, e2, r2 = _quantize(raw, scheme)
            err2, ref2, num_q = err2 + e2, ref2 + r2, num_q + 1
            base = name[: -len(".weight")]
            new = {f"{base}.{k}": v for k, v in parts.items()}
        else:
            new = {name: (raw.dtype, np.asarray(raw.data))}
        nbytes = sum(a.nbytes for _, a in new.values())
        if size and size + nbytes > SHARD_BYTES:
            flush()
        pending.update(new)
        size += nbytes
        dst_bytes += nbytes
        done += raw.data.nbytes
        if progress:
            progress(done, total)
    flush()
    _finish_files(src, tmp, weight_map, scheme, bits, group_size, dst_bytes)
    return QuantizeReport(
        src_bytes=src_bytes,
        dst_bytes=dst_bytes,
        rel_rms_error=float(np.sqrt(err2 / ref2)) if ref2 else 0.0,
        num_quantized=num_q,
        num_copied=len(names) - num_q,
        out=tmp,
    )


def _quantize(raw, scheme: str):
    """Stored parts {"weight", "scales"[, "biases"]} as (dtype, array), and the squared error
    and squared norm of the weight as reconstructed from exactly what is stored."""
    rows = raw.shape[0]
    step = max(1, _CHUNK_ELEMS // max(1, int(np.prod(raw.shape[1:]))))
    chunks: dict[str, list[np.ndarray]] = {}
    err2 = ref2 = 0.0
    for r in range(0, rows, step):
        w = _rows(raw, r, r + step)
        q = quantize_tensor(w, scheme)
        stored = {k: _as_stored(k, v, raw.dtype, scheme) for k, v in q.items()}
        back = {k: _from_stored(dt, a) for k, (dt, a) in stored.items()}
        d = dequantize_tensor(back, scheme).astype(np.float64) - w
        err2 += float(np.sum(d * d))
        ref2 += float(np.sum(w.astype(np.float64) ** 2))
        for k, (_, a) in stored.items():
            chunks.setdefault(k, []).append(a)
    dtypes = {k: dt for k, (dt, _) in stored.items()}
    return {k: (dtypes[k], np.concatenate(v)) for k, v in chunks.items()}, err2, ref2


def _rows(raw, a: int, b: int) -> np.ndarray:
    part = raw.data[a:b]
    if raw.dtype == "BF16":
        return bf16_to_f32(part)
    return part.astype(np.float32)


def _as_stored(part: str, a: np.ndarray, src_dtype: str, scheme: str) -> tuple[str, np.ndarray]:
    if part == "weight":
        return ("I8", a) if scheme == "q8_0" else ("U32", a)
    if scheme == "q8_0":
        return "F16", a.astype(np.float16)  # ggml's fp16 block scale
    # MLX keeps scales and biases in the weight's dtype.
    if src_dtype == "BF16":
        return "BF16", f32_to_bf16(a)
    if src_dtype == "F16":
        return "F16", a.astype(np.float16)
    return "F32", a.astype(np.float32)


def _from_stored(dtype: str, a: np.ndarray) -> np.ndarray:
    return bf16_to_f32(a) if dtype == "BF16" else a


def _finish_files(src, tmp: Path, weight_map, scheme, bits, group_size, total_size) -> None:
    files = sorted(set(weight_map.values()))
    if len(files) == 1:
        os.rename(tmp / files[0], tmp / SINGLE_FILE)
    else:
        n = len(files)
        names = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(files)}
        for old, new in names.items():
            os.rename(tmp / old, tmp / new)
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": {k: names[f] for k, f in weight_map.items()},
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
    for f in sorted(src.path.iterdir()):
        if f.is_file() and f.suffix in _COPY_SUFFIXES and f.name not in ("config.json", INDEX_FILE):
            shutil.copyfile(f, tmp / f.name)
    cfg = json.loads((src.path / "config.json").read_text(encoding="utf-8"))
    cfg.pop("quantization_config", None)
    cfg["quantization"] = {"scheme": scheme, "group_size": group_size, "bits": bits}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
