"""`kipp models`: the checkpoint registry."""

from __future__ import annotations

from kipp_core.cli.common import Parser


def main(argv: list[str]) -> int:
    p = Parser(
        prog="kipp models",
        description="List the checkpoints Kipp knows.",
        epilog="example:\n  kipp models",
    )
    p.parse_args(argv)
    from kipp_core.registry import REGISTRY

    print(
        f"{'name':<22} {'repo id':<27} {'layers':>6} {'hidden':>6} {'heads':>7} "
        f"{'context':>8} {'yarn':>7} {'tied':>5}"
    )
    for e in REGISTRY.values():
        c = e.config
        yarn = str(e.max_context_length) if e.yarn else "-"  # --max-model-len up to this
        print(
            f"{e.name:<22} {e.repo_id:<27} {c.num_hidden_layers:>6} {c.hidden_size:>6} "
            f"{c.num_attention_heads:>3}/{c.num_key_value_heads:<3} {e.context_length:>8} "
            f"{yarn:>7} {'yes' if c.tie_word_embeddings else 'no':>5}"
        )
    return 0
