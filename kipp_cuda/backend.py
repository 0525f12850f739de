"""The CUDA backend: PyTorch + Triton behind the engine's backend contract. Runs on CPU too (every
kernel has a torch reference), slowly, which is how CI runs it."""

from __future__ import annotations

import logging
import time

import torch

from kipp_core.backend import BackendOptions, ModelInput, SeqOutput
from kipp_core.checkpoint import Checkpoint
from kipp_cuda import kv_cache
from kipp_cuda.runner import ModelRunner
from kipp_cuda.weights import TORCH_DTYPES, build_model

log = logging.getLogger("kipp")
GiB = 2**30


def pick_device(options: BackendOptions) -> torch.device:
    if options.device:
        return torch.device(options.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(options: BackendOptions, device: torch.device) -> torch.dtype:
    name = options.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if name not in TORCH_DTYPES:
        raise ValueError(
            f"dtype must be one of {', '.join(TORCH_DTYPES)} on the cuda backend, got {name!r}"
        )
    return TORCH_DTYPES[name]


def CudaBackend(checkpoint: Checkpoint, options: BackendOptions | None = None):  # noqa: N802
    """The backend for `backend="cuda"`: one device, or tensor parallel over several."""
    opts = options or BackendOptions()
    if not isinstance(opts.tensor_parallel, int) or opts.tensor_parallel < 1:
        raise ValueError(
            f"tensor_parallel must be a positive integer, got {opts.tensor_parallel!r}"
        )
    if opts.tensor_parallel > 1:
        from kipp_cuda.tp_backend import TPBackend

        return TPBackend(checkpoint, opts)
    return ShardBackend(checkpoint, opts, pick_device(opts))


class ShardBackend:
    """The model (or this rank's shard of it) on one device, with its KV cache and runner."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        opts: BackendOptions,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        t0 = time.perf_counter()
        self.config = cfg = checkpoint.config
        self.device = device
        # on a CPU the torch references cost the sum of a step's sequences, as the oracle's do:
        # the scheduler then shares each step between requests (kipp_core.scheduler._share)
        self.serial_seqs = device.type != "cuda"
        self.dtype = dtype = pick_dtype(opts, device)
        self.block_size = opts.block_size
        self._check_weights_fit(checkpoint, dtype, opts.quant, tp_size)
        self.model, weight_bytes = build_model(
            checkpoint, device, dtype, opts.quant, tp_rank, tp_size
        )
        max_len = min(
            opts.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        per_block = kv_cache.bytes_per_block(cfg, self.block_size, dtype, opts.kv_quant, tp_size)
        if opts.num_blocks:
            self.num_blocks, why = opts.num_blocks, "num_kv_blocks"
        else:
            kv = kv_cache.num_blocks_for(
                opts.kv_cache_memory,
                cfg,
                self.block_size,
                dtype,
                opts.kv_quant,
                device,
                tp_size,
                opts.kv_sizing,
                opts.max_num_seqs,
                max_len,
                min_tokens=max_len,
            )
            self.num_blocks, why = kv.num_blocks, kv.why
        if tp_size > 1:  # every rank must hold the same block pool
            n = torch.tensor([self.num_blocks], device=device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
            self.num_blocks = int(n.item())
        budget = self.num_blocks * per_block
        capacity = self.num_blocks * self.block_size
        self.kv_bytes_per_token = per_block * tp_size / self.block_size  # all ranks together
        if capacity < max_len:
            per_tok = per_block / self.block_size
            raise ValueError(
                f"KV budget of {budget / GiB:.2f} GiB holds {capacity} tokens, less than one "
                f"full-context request of {max_len} tokens (needs {max_len * per_tok / GiB:.2f} "
                f"GiB); raise --kv-cache-memory or lower --max-model-len"
            )
        self.kv_caches = kv_cache.allocate(
            cfg, self.num_blocks, self.block_size, dtype, opts.kv_quant, device, tp_size
        )
        use_graphs = device.type == "cuda" and not opts.enforce_eager
        self.runner = ModelRunner(
            self.model,
            self.kv_caches,
            self.block_size,
            device,
            min(opts.max_num_seqs, 512),
            max_len,
            use_graphs,
        )
        if tp_size == 1:  # (under tensor parallelism the ranks would each need the hit)
            self.num_hidden_slots = self.runner.num_hidden_slots
        log.info(
            "cuda backend on %s (%s%s): weights %.2f GiB, KV budget %.2f GiB = %d blocks of "
            "%d (%s), max %d concurrent tokens (%s); ready in %.1f s%s",
            device,
            str(dtype).replace("torch.", ""),
            f", {opts.quant}" if opts.quant else "",
            weight_bytes / GiB,
            budget / GiB,
            self.num_blocks,
            self.block_size,
            opts.kv_quant or "unquantized",
            capacity,
            why,
            time.perf_counter() - t0,
            f", {len(self.runner.graphs)} CUDA graphs" if use_graphs else "",
        )

    def _check_weights_fit(
        self, ckpt: Checkpoint, dtype: torch.dtype, quant: str | None, tp_size: int
    ):
        if self.device.type != "cuda":
            return
        n = ckpt.config.num_params() / tp_size
        per = {
            None: torch.tensor([], dtype=dtype).element_size(),
            "q8_0": 1.0625,
            "affine8": 1.125,
            "affine4": 0.625,
        }.get(quant or (ckpt.quantization or {}).get("scheme"), 2)
        need = n * per
        free = torch.cuda.mem_get_info(self.device)[0]
        if need > free:
            raise ValueError(
                f"weights need {need / GiB:.2f} GiB but {self.device} has {free / GiB:.2f} GiB free"
            )

    def execute(self, batch: ModelInput) -> list[SeqOutput]:
        return self.runner.execute(batch)

    def execute_async(self, batch: ModelInput):
        return self.runner.execute_async(batch)
