"""Host time of the block manager's admission of a repeated prompt (`allocate_prefix`): the
prompt-end lookup and the reference counts of its full blocks, without a backend; with
--new-last-token, the prefix-cache walk over the full blocks instead.

python tools/profile/bench_prefix_match.py [--prompt-len 6890] [--runs 200] [--new-last-token]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kipp_core.block_manager import BlockManager
from kipp_core.sampling import SamplingParams
from kipp_core.sequence import Sequence


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt-len", type=int, default=6890)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument(
        "--new-last-token",
        action="store_true",
        help="each run changes the last token: a prefix hit that walks the full blocks",
    )
    args = p.parse_args()
    bm = BlockManager(4096, 32, num_hidden_slots=64)
    prompt = np.random.default_rng(0).integers(0, 150000, args.prompt_len).tolist()
    times = []
    for i in range(args.runs + 1):
        ids = prompt[:-1] + [150000 + i] if args.new_last_token and i else list(prompt)
        seq = Sequence(i, str(i), ids, SamplingParams(), 0)
        t0 = time.perf_counter()
        bm.allocate_prefix(seq)
        times.append(time.perf_counter() - t0)
        assert bm.allocate(seq, seq.num_tokens)
        if seq.cached_end is None:  # the first run computes the prompt and saves its end
            assert i == 0 or args.new_last_token, "the repeated prompt missed the prompt-end cache"
            bm.reserve_end(seq, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens
            bm.publish(seq)
            bm.publish_end(seq)
        bm.free(seq)
    kind = "a new last token" if args.new_last_token else "the same prompt"
    print(
        f"allocate_prefix, {args.prompt_len}-token prompt, {kind}: median "
        f"{statistics.median(times[1:]) * 1e6:.1f} us over {args.runs} runs"
    )


if __name__ == "__main__":
    main()
