"""One request never hurts another: 300 random extreme-but-valid sampling bodies (and a request
whose step raises) beside 8 greedy streams, on the oracle and on the CUDA backend's CPU path;
a client that never reads is aborted after the write timeout with its KV freed and the server's
memory bounded; a stream's deltas merge while its client falls behind."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import aiohttp
import pytest

from kipp_core.llm import LLM
from kipp_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kipp_core.server.async_engine import RequestStream
from kipp_core.server.context import ServerConfig
from kipp_core.server.server import APIServer, ServerThread
from tests.conftest import status_mb
from tests.server.conftest import engine_of, start_server, unread_stream, wait_idle

FAIL_TOKEN = 151_000  # a prompt holding it makes FaultyAsync raise (see below)
STREAMS = [
    {"prompt": f"stream {i}", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    for i in range(8)
]


def extreme_body(rng: random.Random) -> dict:
    """Sampling values at the float32 edges SamplingParams accepts (see sampling_params.py)."""
    tiny, huge = [5e-324, 7e-46, 1e-45, 1e-38, 1e-6], [1e30, 1e38, 3.4e38]
    body = {"prompt": "probe", "max_tokens": rng.choice([1, 2]), "seed": rng.randrange(100)}
    body["temperature"] = rng.choice([0.0, 1e-300, 1e-5, 0.7, *huge])
    maybe = {
        "top_p": [*tiny, 0.5, 1.0],
        "repetition_penalty": [1.2e-38, 1e-30, 1.0, *huge],
        "min_p": [0.0, 1e-45, 1.0],
        "top_k": [-1, 0, 1, 10**9],
        "presence_penalty": [-2.0, 2.0],
        "frequency_penalty": [-2.0, 2.0],
        "logit_bias": [{str(rng.randrange(151643)): rng.choice([-100, 100])}],
        "logprobs": [0, 5],
    }
    for name, values in maybe.items():
        if rng.random() < 0.5:
            body[name] = rng.choice(values)
    if rng.random() < 0.3:
        body["min_tokens"] = body["max_tokens"]
    return body


async def _stream(session, url: str, body: dict) -> tuple[bool, str, str | None]:
    """(ended with [DONE], text, an error event's message)."""
    text, done, error = "", False, None
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                ev = json.loads(line[6:])
                error = ev.get("error", {}).get("message", error)
                text += "".join(c["text"] for c in ev.get("choices", []))
    return done, text, error


async def _probe(url: str, n_bodies: int, faults: list[dict]) -> tuple[list, list, dict]:
    async with aiohttp.ClientSession() as s:
        alone = [await _stream(s, url, b) for b in STREAMS]
        rng = random.Random(0)
        statuses: dict[int, int] = {}
        sem = asyncio.Semaphore(6)

        async def one(body):
            async with sem, s.post(url + "/v1/completions", json=body) as r:
                statuses[r.status] = statuses.get(r.status, 0) + 1
                await r.read()

        bodies = [extreme_body(rng) for _ in range(n_bodies)]
        for i, f in enumerate(faults):  # early, while the streams run
            bodies.insert(4 + 20 * i, f)
        got = await asyncio.gather(
            *(_stream(s, url, b) for b in STREAMS), *(one(b) for b in bodies)
        )
    return alone, got[: len(STREAMS)], statuses


def _check(alone, beside, statuses, n_faults: int):
    for (done, text, error), (_, want, _) in zip(beside, alone):
        assert done and error is None and text == want
    assert statuses.get(500, 0) == n_faults  # the faulty requests only
    assert sum(v for k, v in statuses.items() if k != 200 and k != 500) == 0, statuses


def test_extreme_bodies_beside_greedy_streams_oracle(server):
    """`[[fail]]` makes the scripted backend raise in every step it is in."""
    faults = [{"prompt": "[[fail]]", "max_tokens": 4}] * 2
    alone, beside, statuses = asyncio.run(_probe(server.url, 300, faults))
    _check(alone, beside, statuses, len(faults))
    wait_idle(server)


class FaultyAsync:
    """The CUDA backend, raising from execute_async while a FAIL_TOKEN prompt samples."""

    def __init__(self, inner):
        self.inner = inner
        self.config, self.block_size, self.num_blocks = (
            inner.config,
            inner.block_size,
            inner.num_blocks,
        )
        self.num_hidden_slots = getattr(inner, "num_hidden_slots", 0)

    def execute_async(self, batch):
        for s in batch.seqs:
            if s.sampler is not None and FAIL_TOKEN in s.sampler.prompt_token_ids:
                raise RuntimeError("injected fault")
        return self.inner.execute_async(batch)

    def execute(self, batch):
        return self.execute_async(batch).result()


@pytest.mark.slow
def test_extreme_bodies_beside_greedy_streams_cuda_on_cpu(tiny_path):
    llm = LLM(str(tiny_path), backend="cuda", dtype="float32")
    assert llm.engine._async  # the async scheduling path, PENDING tokens included
    llm.engine.backend = FaultyAsync(llm.engine.backend)
    st = ServerThread(APIServer(ServerConfig(port=0), llm=llm, model_name="kipp-tiny")).start()
    try:
        faults = [{"prompt": [11, FAIL_TOKEN, 12], "max_tokens": 4}] * 2
        alone, beside, statuses = asyncio.run(_probe(st.url, 300, faults))
        _check(alone, beside, statuses, len(faults))
        wait_idle(st)
    finally:
        st.stop()


def test_a_client_that_never_reads_is_aborted_and_memory_stays_bounded(tiny_path):
    """n=16, max_tokens 2,000, and a socket nobody reads. The server's send buffer is made
    small (accepted sockets inherit SO_SNDBUF from the listener) so that writes stall within a
    few steps, as they do on any connection once the kernel's buffers are full."""
    st = start_server(tiny_path, ServerConfig(port=0, write_timeout=1.0))
    try:
        for site in st.server._runner.sites:
            for sock in site._server.sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        engine = engine_of(st)
        idle = status_mb("VmRSS")
        body = {"prompt": "never read", "n": 16, "max_tokens": 2000, "ignore_eos": True}
        s = unread_stream(st.server.port, {**body, "temperature": 0, "stream": True})
        deadline = time.monotonic() + 60
        peak, started = idle, False
        while not (started and not engine.has_unfinished_requests()):
            assert time.monotonic() < deadline, "the stalled stream was never aborted"
            started |= engine.has_unfinished_requests()
            peak = max(peak, status_mb("VmRSS"))
            time.sleep(0.05)
        assert peak - idle < 300
        wait_idle(st)  # every block free
        s.close()
    finally:
        st.stop()


def _delta(rid: str, text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, text, ids, None, "length" if finished else None, None, text, ids, [])
    return RequestOutput(rid, [], [c], finished, RequestMetrics(0.0))


def test_deltas_merge_while_the_client_is_behind():
    """100 deltas that nobody reads are one pending output, their concatenation."""

    async def run():
        stream = RequestStream(None, ["a"])
        for i in range(100):
            stream.put(_delta("a", f"{i},", [i], finished=i == 99))
        assert len(stream._pending) == 1
        out = await stream.__anext__()
        assert out.outputs[0].text == "".join(f"{i}," for i in range(100))
        assert out.outputs[0].token_ids == list(range(100)) and out.finished
        assert stream.finished

    asyncio.run(run())
