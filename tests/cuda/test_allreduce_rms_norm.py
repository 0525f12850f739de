"""The fused TP = 2 all-reduce + residual + RMSNorm kernel: its protocol in one process (the
peer's side played by the test, CPU interpreter or one GPU), and on two GPUs against NCCL +
rms_norm bit for bit, eagerly and in a CUDA graph (skipped with fewer GPUs)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from kipp_cuda.kernels.allreduce_rms_norm import allreduce_rms_norm, allreduce_rms_norm_ref
from kipp_cuda.kernels.rms_norm import _rms_norm_op
from tests.cuda.kernel_testing import DEV, HAS_CUDA, close, randn, run, skip_unless_runnable

skip_unless_runnable()


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + i, mask=i < n)
    s = a.to(tl.float32) + tl.load(b_ptr + i, mask=i < n).to(tl.float32)
    tl.store(out_ptr + i, s.to(a.dtype), mask=i < n)


def _add(a, b):
    out = torch.empty_like(a)
    _add_kernel[(1,)](a, b, out, a.numel(), BLOCK=triton.next_power_of_2(a.numel()))
    return out


def _buffers(rows, H, dtype):
    z = dict(device=DEV, dtype=torch.int32)
    return (
        torch.zeros(rows, H, device=DEV, dtype=dtype),
        torch.zeros(rows, **z),
        torch.zeros(rows, H, device=DEV, dtype=dtype),
        torch.zeros(rows, **z),
        torch.zeros(rows, **z),
    )


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_allreduce_rms_norm_one_side(dtype, residual):
    # This rank's side of two calls. The test plays the peer: it puts the peer's rows and its
    # flags (epoch 1, then 2) in this rank's receive buffer before each call. Each call must push
    # x into the peer's rows, raise the peer's flags and this rank's epochs to the call's epoch
    # (rows past T untouched), and return rms_norm of the model-dtype sum (+ residual), equal to
    # the rms_norm kernel on that sum (what NCCL's all-reduce then rms_norm give).
    T, H, rows, eps = 4, 96, 8, 1e-6
    send, send_flags, recv, recv_flags, epochs = _buffers(rows, H, dtype)
    w = randn(H, dtype=dtype, seed=1)
    for call in (1, 2):
        x = randn(T, H, dtype=dtype, seed=10 * call)
        peer_x = randn(T, H, dtype=dtype, seed=10 * call + 1)
        res = randn(T, H, dtype=dtype, seed=10 * call + 2) if residual else None
        recv[:T] = peer_x
        recv_flags[:T] = call
        out, new_res = run(
            allreduce_rms_norm, x, w, eps, res, send, send_flags, recv, recv_flags, epochs
        )
        assert torch.equal(send[:T], x) and not send[T:].any()
        assert (send_flags[:T] == call).all() and not send_flags[T:].any()
        assert (epochs[:T] == call).all() and not epochs[T:].any()
        want_out, want_res = allreduce_rms_norm_ref(x, peer_x, w, eps, res)
        close(out, want_out, dtype)
        close(new_res, want_res, dtype)  # (the interpreter rounds to bf16 toward zero)
        s = run(_add, x, peer_x)  # the sum as the kernel rounds it
        plain = _rms_norm_op(s, w, eps, res) if residual else (_rms_norm_op(s, w, eps), s)
        assert torch.equal(out, plain[0]) and torch.equal(new_res, plain[1])


def test_allreduce_rms_norm_rejects_rows_it_cannot_hold():
    send, send_flags, recv, recv_flags, epochs = _buffers(2, 64, torch.float32)
    x = randn(3, 64)
    with pytest.raises(ValueError, match="receive rows"):
        allreduce_rms_norm(x, randn(64), 1e-6, None, send, send_flags, recv, recv_flags, epochs)


# -- two GPUs -----------------------------------------------------------------------------------


def _rank(rank, port, errors):
    import torch.distributed as dist

    from kipp_cuda.tp_backend import _init
    from kipp_cuda.tp_reduce import TPReduce

    try:
        device = _init(rank, 2, port, "cuda")
        H, sites = 4096, 3
        tp = TPReduce(rank, 2, sites, H, torch.bfloat16, device)
        assert tp.mode == "peer", tp.mode
        w = torch.randn(H, device=device).to(torch.bfloat16)
        g = torch.Generator(device=device).manual_seed(100 + rank)  # each rank its own partial
        xs = torch.randn(sites, 4, H, device=device, generator=g).to(torch.bfloat16)
        res = torch.randn(
            4, H, device=device, generator=torch.Generator(device=device).manual_seed(7)
        ).to(torch.bfloat16)  # the same on both ranks

        def forward(T):
            tp.begin()
            h, r = tp.reduce_norm(xs[0, :T].clone(), None, w, 1e-6)
            outs = [h, r]
            for site in (1, 2):
                h, r = tp.reduce_norm(xs[site, :T].clone(), res[:T] if site == 1 else r, w, 1e-6)
                outs += [h, r]
            return outs

        def nccl(T):
            tp.mode = "nccl"
            try:
                return forward(T)
            finally:
                tp.mode = "peer"

        for T in (1, 4, 1):
            got, want = forward(T), nccl(T)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"eager T={T}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = forward(1)
        for _ in range(20):
            xs.copy_(torch.randn(xs.shape, device=device, generator=g))
            graph.replay()
            want = nccl(1)
            assert all(torch.equal(a, b) for a, b in zip(outs, want)), "graph replay"
        torch.cuda.synchronize()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu2_peer_allreduce_equals_nccl_then_rms_norm():
    import torch.multiprocessing as mp

    from kipp_cuda.tp_backend import SAFE_ENV, _free_port

    os.environ.update(SAFE_ENV)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert errors.empty(), errors.get()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
