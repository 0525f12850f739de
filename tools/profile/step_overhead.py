"""What the copies around a batch-1 decode graph cost, with the host far ahead of the GPU (one
synchronize a loop): the graph alone, with the staged-input upload, with the tokens' copy back,
and with both moved into kernels that read and write pinned host memory directly (zero-copy,
mapped through UVA), inside or outside the graph; and the engine's own step for comparison.

python tools/profile/step_overhead.py --shape qwen3-8b --quant q8_0 --kv-cache-memory 16GiB
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl

from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from kipp_core.tiny import random_checkpoint


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)


def copy_words(src: torch.Tensor, dst: torch.Tensor, n: int) -> None:
    """dst[:n] = src[:n] (int64 words) in one kernel; either side may be pinned host memory."""
    _copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024)


def loop_ms(fn, iters: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quant", default=None)
    p.add_argument("--kv-cache-memory", default="16GiB")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    llm = LLM(
        str(random_checkpoint(args.shape)),
        backend="cuda",
        quant=args.quant,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=8,
    )
    eng, runner = llm.engine, llm.backend.runner
    sp = SamplingParams(temperature=0, max_tokens=30_000, ignore_eos=True)
    eng.add_request("r", [1000 + j % 5000 for j in range(args.context)], sp)
    for _ in range(8):
        eng.step()
    rows = {}
    rows["engine step"] = loop_ms(eng.step, args.iters)
    g = runner.graphs["decode", 1]
    inp = runner.inputs
    end = inp.bt_at + inp.row_bytes  # what upload(1) sends
    words = -(-end // 8)
    h_words, g_words = inp.h_stage.view(torch.int64), inp.g_stage.view(torch.int64)
    h_tok = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    last = runner.g_last
    ev = torch.cuda.Event()

    def up():
        inp.upload(1)

    def down():
        h_tok[:1].copy_(last[:1], non_blocking=True)
        ev.record()

    rows["graph replay"] = loop_ms(g.replay, args.iters)
    rows["upload + replay"] = loop_ms(lambda: (up(), g.replay()), args.iters)
    rows["replay + copy back"] = loop_ms(lambda: (g.replay(), down()), args.iters)
    rows["upload + replay + copy back"] = loop_ms(lambda: (up(), g.replay(), down()), args.iters)
    try:
        copy_words(h_words, g_words, words)  # does Triton take a pinned host pointer?
        torch.cuda.synchronize()
        ok = torch.equal(g_words[:words].cpu(), h_words[:words])
        rows[f"(zero-copy stage-in works: {ok})"] = 0.0

        def kin():
            copy_words(h_words, g_words, words)

        def kout():
            copy_words(last, h_tok, 1)
            ev.record()

        rows["kernel in + replay + copy back"] = loop_ms(lambda: (kin(), g.replay(), down()), 200)
        rows["kernel in + replay + kernel out"] = loop_ms(lambda: (kin(), g.replay(), kout()), 200)
        run = runner._graph_fn("decode", 1)

        def staged():
            copy_words(h_words, g_words, words)
            out = run()
            copy_words(last, h_tok, 1)
            return out

        g2, _ = runner._capture(staged, g.pool())
        rows["graph with kernels in and out"] = loop_ms(lambda: (g2.replay(), ev.record()), 200)
    except Exception as e:  # noqa: BLE001 (a measurement: say what failed)
        rows[f"(zero-copy failed: {type(e).__name__}: {str(e)[:200]})"] = 0.0
    rows["engine step (again)"] = loop_ms(eng.step, args.iters)
    print(f"{args.shape} {args.quant or 'bf16'} batch 1, context ~{args.context}:")
    for k, v in rows.items():
        print(f"  {v:8.4f} ms  {k}")


if __name__ == "__main__":
    main()
