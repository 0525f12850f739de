"""The transformers peer for `kipp bench`: the same checkpoint, device and shapes, through
Qwen3ForCausalLM with its own KV cache. torch and transformers are imported inside `measure`."""

from __future__ import annotations

import inspect
import time

import numpy as np

from kipp_core.bench import MAX_ORDINARY_ID

DTYPES = {None: "bfloat16", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def measure(
    model_path: str,
    *,
    batch_sizes: list[int],
    prompt_len: int,
    gen_len: int,
    dtype: str | None = None,
    seed: int = 0,
    device: str = "cuda",
) -> dict:
    """Prefill tok/s, decode tok/s (greedy, after the first token) and TTFT per batch size."""
    import torch
    import transformers

    if dtype not in DTYPES:
        raise ValueError(f"the transformers peer runs bfloat16, float16 or float32, got {dtype!r}")
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"
    model = transformers.Qwen3ForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, DTYPES[dtype])
    ).to(device)
    model.eval()
    rng = np.random.default_rng(seed)
    rows = []
    for b in batch_sizes:

        def prompt(b=b):
            return torch.tensor(
                rng.integers(0, MAX_ORDINARY_ID, size=(b, prompt_len)), device=device
            )

        for _ in range(2):  # the first run warms up kernels and allocator; the second counts
            pre_s, dec_s = _run(model, prompt(), gen_len, device)
        # Prefill as kipp bench times it: the median of three runs on new prompts.
        pre_s = float(np.median([pre_s] + [_run(model, prompt(), 1, device)[0] for _ in range(2)]))
        rows.append(
            {
                "batch_size": b,
                "prompt_len": prompt_len,
                "gen_len": gen_len,
                "prefill_tok_s": b * prompt_len / pre_s,
                "decode_tok_s": b * (gen_len - 1) / dec_s if gen_len > 1 else None,
                "ttft_s": pre_s,
            }
        )
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "name": "transformers",
        "version": transformers.__version__,
        "dtype": DTYPES[dtype],
        "device": device,
        "rows": rows,
    }


def _run(model, ids, gen_len: int, device: str) -> tuple[float, float]:
    """(prefill seconds to the first token, seconds for the remaining gen_len - 1 tokens)."""
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    # transformers 5 renamed past_key_values to cache
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)  # as an engine: no full logits
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t1 = time.perf_counter()
        for _ in range(gen_len - 1):
            out = model(tok, use_cache=True, **{key: getattr(out, key)})
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1
