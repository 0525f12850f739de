"""POST /v1/completions: a prompt (text, token ids, or a batch of either) in, text out; `echo`
with prompt logprobs and `max_tokens: 0` score a prompt, as evaluation harnesses need."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiohttp import web

from kipp_core.sampling import SamplingParams
from kipp_core.server.access_log import ACCESS, STREAM
from kipp_core.server.async_engine import EngineRequest, RequestStream
from kipp_core.server.body import read_json
from kipp_core.server.context import STATE, ServingContext
from kipp_core.server.errors import bad_request
from kipp_core.server.logprobs import completion_logprobs
from kipp_core.server.protocol import (
    COMMON_FIELDS,
    MAX_CHOICES,
    Fields,
    build_params,
    check_context,
    check_model,
    sampling_fields,
    stream_flags,
)
from kipp_core.server.streaming import ChunkFrame, dumps, stream_response
from kipp_core.server.usage import timings, usage

FIELDS = (*COMMON_FIELDS, "prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix")
DEFAULT_MAX_TOKENS = 16  # OpenAI's


@dataclass
class CompletionRequest:
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: SamplingParams
    score_only: bool  # max_tokens 0: only the prompt is computed
    echo: bool
    logprobs: int | None
    stream: bool
    include_usage: bool


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompts(raw, ctx: ServingContext) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt: a string, a list of ids, or a list of either."""
    if isinstance(raw, str):
        raw = [raw]
    elif isinstance(raw, list) and raw and all(_is_id(x) for x in raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad_request(
            "prompt must be a string, a token id array, or a non-empty array of them", "prompt"
        )
    ids, texts = [], []
    for p in raw:
        if isinstance(p, str):
            ids.append(ctx.encode(p))
            texts.append(p)
        elif isinstance(p, list) and all(_is_id(t) for t in p):
            for t in p:
                if not 0 <= t < ctx.vocab_size:
                    raise bad_request(
                        f"prompt token id {t} is outside [0, {ctx.vocab_size})", "prompt"
                    )
            ids.append(list(p))
            texts.append(ctx.tokenizer.decode(p))
        else:
            raise bad_request(
                "prompt must be a string, a token id array, or an array of them", "prompt"
            )
        if not ids[-1]:
            raise bad_request("prompt is empty: at least one token is needed", "prompt")
    return ids, texts


def parse_request(body: dict, ctx: ServingContext) -> CompletionRequest:
    f = Fields(body, FIELDS)
    check_model(f, (ctx.model_name,))
    stream, include_usage = stream_flags(f)
    f.string("user")
    if f.has("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    if f.raw("prompt") is None:
        raise bad_request("prompt is required", "prompt")
    max_tokens = f.integer("max_tokens", DEFAULT_MAX_TOKENS, lo=0)
    logprobs = f.integer("logprobs", lo=0, hi=20)
    echo = f.boolean("echo", False)
    kw = sampling_fields(f, ctx.vocab_size)
    best_of = f.integer("best_of")
    if best_of is not None and best_of != kw.get("n", 1):
        raise bad_request("best_of is not supported unless it equals n", "best_of")
    prompts, texts = _prompts(body["prompt"], ctx)
    if len(prompts) * kw.get("n", 1) > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
    for ids in prompts:
        check_context(
            len(ids), max_tokens, ctx.max_model_len, "prompt", min_tokens=kw.get("min_tokens", 0)
        )
    score_only = max_tokens == 0
    kw["max_tokens"] = 1 if score_only else max_tokens
    kw["logprobs"] = logprobs
    if echo and logprobs is not None:
        kw["prompt_logprobs"] = logprobs
    params = build_params(ctx.defaults, kw, {"prompt_logprobs": "logprobs"})
    return CompletionRequest(
        prompts, texts, params, score_only, echo, logprobs, stream, include_usage
    )


class _Response:
    """Builds the response body, or the chunks, of one completion request."""

    def __init__(self, req: CompletionRequest, ctx: ServingContext, request_ids: list[str]):
        self.req, self.ctx = req, ctx
        self.id = request_ids[0].rsplit("-", 1)[0]
        self.index_of = {rid: i for i, rid in enumerate(request_ids)}
        self.created = int(time.time())
        self.echoed: set[int] = set()
        self.done: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.plain = ChunkFrame(self._head(), "text", req.include_usage)

    def _head(self, obj: str = "text_completion") -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.model_name}

    def _echo(self, i: int, out) -> tuple[str, list]:
        req = self.req
        entries = []
        if req.logprobs is not None:
            entries = list(zip(req.prompts[i], out.prompt_logprobs or []))
        return req.prompt_texts[i], entries

    def body(self, finals: list) -> dict:
        req, tok = self.req, self.ctx.tokenizer
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                text, entries = self._echo(i, out) if req.echo else ("", [])
                lp = None
                if req.logprobs is not None:
                    entries += list(zip(c.token_ids, c.logprobs or []))
                    lp = completion_logprobs(tok, entries, req.logprobs)[0]
                choices.append(
                    {
                        "index": i * req.params.n + c.index,
                        "text": text + c.text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return {
            **self._head(),
            "choices": choices,
            "usage": usage(finals),
            "timings": timings(finals),
        }

    def chunks(self, out, stream: RequestStream) -> list:
        req = self.req
        i = self.index_of[out.request_id]
        events = []
        for c in out.outputs:
            idx = i * req.params.n + c.index
            if idx in self.done:
                continue
            text, entries = c.text_delta, list(zip(c.token_ids_delta, c.logprobs_delta))
            if req.echo and idx not in self.echoed:
                self.echoed.add(idx)
                head, head_entries = self._echo(i, out)
                text, entries = head + text, head_entries + entries
            finish = c.finish_reason if c.finished else None
            if not text and not entries and finish is None:
                continue
            lp = None
            if req.logprobs is not None:
                lp, self.offsets[idx] = completion_logprobs(
                    self.ctx.tokenizer, entries, req.logprobs, self.offsets.get(idx, 0)
                )
            elif finish is None and not stream.finished:  # most of a stream's chunks
                events.append(self.plain.frame(idx, text))
                continue
            choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish}
            if finish is not None:
                self.done.add(idx)
                choice["stop_reason"] = c.stop_reason
            events.append({**self._head(), "choices": [choice]})
            if req.include_usage:
                events[-1]["usage"] = None
        if stream.finished:
            finals = [stream.finals[rid] for rid in self.index_of]
            if req.include_usage:
                events.append({**self._head(), "choices": [], "usage": usage(finals)})
            events[-1]["timings"] = timings(finals)
        return events


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    ctx = state.ready()
    body = await read_json(request)
    # Off the event loop: tokenizing a long prompt takes a while (offload.py)
    req = await asyncio.get_running_loop().run_in_executor(None, parse_request, body, ctx)
    rid = ctx.new_id("cmpl")
    request[ACCESS] = rid
    items = [
        EngineRequest(f"{rid}-{i}", ids, req.params, text, req.score_only)
        for i, (ids, text) in enumerate(zip(req.prompts, req.prompt_texts))
    ]
    response = _Response(req, ctx, [r.request_id for r in items])
    stream = request[STREAM] = await ctx.submit(items, arrival, state.config.retry_after_s)
    try:
        if not req.stream:
            finals = await stream.collect()
            return web.Response(body=dumps(response.body(finals)), content_type="application/json")
        return await stream_response(request, stream, [], response.chunks)
    finally:
        stream.close()
