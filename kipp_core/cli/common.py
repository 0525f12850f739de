"""Shared CLI pieces: the argument parser that exits 2 with one line, the value types every
command's options are checked with (one message style: "kipp CMD: error: argument --FLAG: must
be ..., got VALUE"), the model options and the checks across them."""

from __future__ import annotations

import argparse
import logging
import sys

from kipp_core.kv_memory import parse_kv_memory

log = logging.getLogger("kipp")


TINY_NOTE = "random weights, so its text is gibberish; the path it runs is the real one"


class UsageError(Exception):
    """A bad argument or input: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage plus the error; we want one line
        raise UsageError(f"{self.prog}: error: {message}")


def bad(prog: str, flag: str, rule: str) -> UsageError:
    """The error for a value the types cannot see is wrong (it depends on another option)."""
    return UsageError(f"{prog}: error: argument {flag}: {rule}")


def number(kind, lo=None, hi=None, open_lo=False):
    def check(text: str):
        try:
            v = kind(text)
        except ValueError:
            name = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {name}, got {text!r}") from None
        if (
            v != v
            or (lo is not None and (v <= lo if open_lo else v < lo))
            or (hi is not None and v > hi)
        ):
            rule = f"> {lo}" if open_lo else f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return v

    return check


positive_int = number(int, 1)
non_negative_int = number(int, 0)
positive_float = number(float, 0, open_lo=True)
non_negative_float = number(float, 0)
port = number(int, 0, 65535)


def add_thinking_budget(group, default_of: str) -> None:
    """--thinking-budget N: the engine closes a thought after N tokens (thinking_budget.py)."""
    group.add_argument(
        "--thinking-budget",
        type=non_negative_int,
        default=None,
        metavar="N",
        help=f"close the thinking after N tokens and answer ({default_of}; default: no budget)",
    )


def kv_memory(text: str):
    """A size with its unit (kept as text) or a fraction of free memory in (0, 1] (a float)."""
    try:
        kind, v = parse_kv_memory(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a size like '8GiB' or '512MiB', or a fraction of free memory in (0, 1] "
            f"like '0.3', got {text!r}"
        ) from None
    return v if kind == "fraction" else text


def add_model_args(p: argparse.ArgumentParser, backend_default: str = "auto") -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        "-m",
        default="kipp-tiny",
        help="a local directory, a registry name (kipp models), a Hugging Face repo id, "
        "or kipp-tiny (default; " + TINY_NOTE + ")",
    )
    g.add_argument(
        "--backend",
        "-b",
        default=backend_default,
        choices=["auto", "oracle", "cuda", "mlx"],
        help="auto = mlx on Apple silicon, cuda with a GPU, else the numpy oracle",
    )
    g.add_argument(
        "--dtype",
        default=None,
        help="bfloat16 | float16 | float32 (float64 on the oracle); default: the "
        "backend's (bfloat16 on GPUs, float32 on the oracle)",
    )
    g.add_argument(
        "--quant",
        default=None,
        choices=["q8_0", "affine4", "affine8"],
        help="quantize weights at load",
    )
    g.add_argument("--kv-quant", default=None, choices=["q8_0"], help="quantized KV cache")
    g.add_argument(
        "--kv-cache-memory",
        type=kv_memory,
        default=None,
        help="KV cache budget: '8GiB', '512MiB' or a fraction of free memory ('0.3'); default "
        "(cuda): kipp serve room for --max-num-seqs x 2,048 tokens within 90%% of free memory, "
        "else 30%% of free memory up to 16 GiB",
    )
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="context limit (tokens); past the native context of a checkpoint with a YaRN "
        "recipe (Qwen3 4B-32B: up to 131072) it turns static YaRN on",
    )
    g.add_argument(
        "--rope-scaling",
        default=None,
        metavar="JSON",
        help="replace the config's rope_scaling (as vLLM's --rope-scaling), e.g. "
        '\'{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}\'',
    )
    g.add_argument("--max-num-seqs", type=positive_int, default=256, help="most sequences a step")
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=8192,
        help="token budget of one step (chunked prefill)",
    )
    g.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / mx.compile")
    g.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="wait for each step before scheduling the next (async is on where the backend has it)",
    )
    g.add_argument(
        "--tensor-parallel",
        "-tp",
        type=positive_int,
        default=1,
        help="GPUs to split the model over (cuda backend)",
    )
    g.add_argument(
        "--speculative",
        default=None,
        choices=["ngram", "draft"],
        help="speculative decoding: prompt lookup or a draft model",
    )
    g.add_argument("--speculative-model", default=None, help="the draft model")
    g.add_argument("--num-speculative-tokens", type=positive_int, default=4)
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def check_model_args(args, prog: str) -> None:
    """The model options that depend on each other or on the backend; `--backend auto` becomes
    the backend it picks (and says which)."""
    if args.backend == "auto":
        from kipp_core.backend import default_backend

        args.backend, args.auto_backend = default_backend(), True
    if args.tensor_parallel > 1 and args.backend != "cuda":
        raise bad(prog, "--tensor-parallel", f"needs --backend cuda, got {args.backend}")
    if args.speculative_model and args.speculative == "ngram":
        raise bad(prog, "--speculative-model", "is for --speculative draft, not ngram")


def load_llm(args, **overrides):
    """The LLM the model options describe; `overrides` adds or replaces LLM keyword arguments."""
    from kipp_core.llm import LLM

    llm = LLM(args.model, **llm_kwargs(args, **overrides))
    announce(args, llm.registry_entry)
    return llm


def announce(args, entry) -> None:
    """Say which backend `--backend auto` picked, and that kipp-tiny's weights are random."""
    if getattr(args, "auto_backend", False):
        log.info("backend auto: %s", args.backend)
    if entry is not None and entry.name == "kipp-tiny":
        log.info("kipp-tiny has %s (--model picks another checkpoint)", TINY_NOTE)


def llm_kwargs(args, **overrides) -> dict:
    """LLM's keyword arguments for the model options (plain data: they cross to an engine
    process as they are)."""
    kw = dict(
        backend=args.backend,
        dtype=args.dtype,
        quant=args.quant,
        kv_quant=args.kv_quant,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_cache,
        enforce_eager=args.enforce_eager,
        async_scheduling=not args.no_async_scheduling,
        tensor_parallel=args.tensor_parallel,
        speculative=args.speculative,
        speculative_model=args.speculative_model,
        num_speculative_tokens=args.num_speculative_tokens,
        rope_scaling=args.rope_scaling,
    )
    kw.update(overrides)
    return kw


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="kipp: %(message)s",
    )
    for noisy in ("httpx", "huggingface_hub", "filelock", "urllib3", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
