"""Tensor parallelism over torch.distributed: one process per GPU (gloo on CPU). The scheduler runs
once, in the main process (rank 0); each step's batch is sent to the workers, every rank runs the
same forward (NCCL all-reduces inside the model), and rank 0 answers.

A worker that dies takes the backend down with a clear error instead of a hang, and every worker
exits when the main process goes away.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from kipp_core.backend import BackendOptions, ModelInput, SeqOutput
from kipp_core.checkpoint import Checkpoint

log = logging.getLogger("kipp")
# Never NVLink multicast: it can take a shared host's GPUs out of service.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, device_type: str) -> torch.device:
    os.environ.update(SAFE_ENV)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
        )
        return torch.device("cuda", rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return torch.device("cpu")


def _build(ckpt_path, entry, config, options: BackendOptions, rank: int, world: int, device):
    from kipp_cuda.backend import ShardBackend

    ckpt = Checkpoint(ckpt_path, entry)
    ckpt.config = config  # rank 0's: with --max-model-len / --rope-scaling applied
    return ShardBackend(ckpt, options, device, rank, world)


def _worker(rank, world, port, device_type, ckpt_path, entry, config, options, conn, parent_pid):
    try:
        device = _init(rank, world, port, device_type)
        shard = _build(ckpt_path, entry, config, options, rank, world, device)
        conn.send(("ready", shard.num_blocks))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent_pid:  # the main process is gone
                    break
                continue
            msg = conn.recv()
            if msg is None:
                break
            # Queued, never waited for: the NCCL collectives keep it in step with rank 0, and
            # its samples (the same as rank 0's) stay on the device for the next step.
            shard.execute_async(msg)
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as e:  # report, then die: the main process turns this into an error
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except Exception:
            pass
        raise
    finally:
        _release(locals().get("shard"))
        if dist.is_initialized():
            dist.destroy_process_group()


def _release(shard) -> None:
    """Drop a shard's CUDA graphs (they hold NCCL work) before its process group is destroyed."""
    runner = getattr(shard, "runner", None)
    if runner is not None:
        runner.graphs.clear()
        runner.graph_out.clear()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class TPBackend:
    def __init__(self, checkpoint: Checkpoint, options: BackendOptions):
        world = options.tensor_parallel
        self._closing = False
        device_type = (
            "cuda"
            if (options.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith(
                "cuda"
            )
            else "cpu"
        )
        if device_type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"tensor_parallel {world} needs {world} GPUs, {torch.cuda.device_count()} visible"
            )
        os.environ.update(SAFE_ENV)
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, world):
            a, b = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                daemon=True,
                name=f"kipp-tp{rank}",
                args=(
                    rank,
                    world,
                    port,
                    device_type,
                    checkpoint.path,
                    checkpoint.entry,
                    checkpoint.config,
                    options,
                    b,
                    os.getpid(),
                ),
            )
            p.start()
            self.procs.append(p)
            self.conns.append(a)
        device = _init(0, world, port, device_type)
        self.shard = _build(
            checkpoint.path, checkpoint.entry, checkpoint.config, options, 0, world, device
        )
        for conn, p in zip(self.conns, self.procs):
            msg = self._recv(conn, p, timeout=600)
            if msg[0] != "ready":
                self.close()
                raise RuntimeError(f"tensor-parallel worker {p.name} failed: {msg[1]}")
        self.config = self.shard.config
        self.block_size = self.shard.block_size
        self.num_blocks = self.shard.num_blocks
        self.kv_bytes_per_token = self.shard.kv_bytes_per_token
        threading.Thread(target=self._watchdog, name="kipp-tp-watchdog", daemon=True).start()
        log.info("tensor parallel over %d %s devices", world, device_type)

    def _watchdog(self) -> None:
        """A dead worker leaves rank 0 blocked in a collective forever: end the process instead."""
        while not self._closing:
            for p in list(self.procs):
                if not p.is_alive() and not self._closing:
                    log.critical(
                        "tensor-parallel worker %s died (exit code %s); shutting down",
                        p.name,
                        p.exitcode,
                    )
                    for q in self.procs:
                        if q.is_alive():
                            q.kill()
                    os._exit(70)
            time.sleep(0.2)

    def _recv(self, conn, proc, timeout: float):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if conn.poll(0.5):
                return conn.recv()
            if not proc.is_alive():
                self.close()
                raise RuntimeError(
                    f"tensor-parallel worker {proc.name} died (exit code {proc.exitcode})"
                )
        raise RuntimeError(f"tensor-parallel worker {proc.name} did not answer in {timeout} s")

    def execute(self, batch: ModelInput) -> list[SeqOutput]:
        return self.execute_async(batch).result()

    def execute_async(self, batch: ModelInput):
        for conn, p in zip(self.conns, self.procs):
            if not p.is_alive():
                self.close()
                raise RuntimeError(
                    f"tensor-parallel worker {p.name} died "
                    f"(exit code {p.exitcode}); the backend is shut down"
                )
            conn.send(batch)
        return self.shard.execute_async(batch)

    def close(self) -> None:
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(None)
            except Exception:
                pass
        # NCCL's teardown waits for every rank: rank 0 destroys while the workers do, bounded.
        _release(getattr(self, "shard", None))
        teardown = None
        if dist.is_initialized():
            teardown = threading.Thread(target=dist.destroy_process_group, daemon=True)
            teardown.start()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.procs, self.conns = [], []
        if teardown is not None:
            teardown.join(timeout=10)
            if teardown.is_alive():
                log.warning("tensor parallel: the process group did not tear down in 10 s")

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
