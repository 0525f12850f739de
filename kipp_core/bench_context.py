"""Long-context rows of `kipp bench` (--context-lens): at each context length, batch-1 prefill of
a prompt that long (median of the repeats) and batch-1 decode at that context, the RoPE in use
(YaRN or not) stated beside them. A prompt never runs past max_model_len: the prefill prompt
leaves room for its one output token and the decode prompt for its gen_len tokens, so at the
longest context the decode covers its last gen_len positions."""

from __future__ import annotations

from kipp_core.bench import measure_decode, median_prefill


def context_rows(llm, lengths: list[int], gen_len: int, rng, repeats: int, warmup: bool, log):
    """One row a length: prefill tok/s of its prompt, decode tok/s at its context."""
    limit = llm.engine.max_model_len
    too_long = [n for n in lengths if n > limit]
    if too_long:
        raise ValueError(
            f"--context-lens {too_long[0]} is past max_model_len {limit}: raise --max-model-len "
            "(with YaRN where the checkpoint needs it)"
        )
    rows = []
    for n in lengths:
        p_prefill, p_decode = min(n, limit - 1), min(n, limit - gen_len)
        for _ in range(2 if warmup else 1):  # the last run counts
            pre = median_prefill(llm, p_prefill, 1, rng, repeats)
            dec = measure_decode(llm, 1, p_decode, gen_len, rng)
        rows.append(
            {
                "batch_size": 1,
                "context_len": n,
                "prompt_len": p_prefill,
                "decode_prompt_len": p_decode,
                "gen_len": gen_len,
                **pre,
                **dec,
            }
        )
        log(
            f"context {n}: prefill {pre['prefill_tok_s']:.1f} tok/s, decode "
            f"{dec['decode_tok_s']:.1f} tok/s, ttft {pre['ttft_s'] * 1000:.1f} ms"
        )
    return rows


def rope_line(config) -> str:
    """The RoPE a run used, for the results' header."""
    rs, ctx = config.rope_scaling, f"a {config.max_position_embeddings:,}-token context"
    if rs is None:
        return f"RoPE: default (theta {config.rope_theta:g}), {ctx}"
    return (
        f"RoPE: static YaRN (theta {config.rope_theta:g}), factor {rs['factor']:g} over "
        f"{rs['original_max_position_embeddings']:,} positions, {ctx}"
    )
