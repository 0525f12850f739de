"""What a load run sends and how: the target, the endpoint, the arrival process, the sampling
fields every request carries."""

from __future__ import annotations

import json
from dataclasses import dataclass

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class LoadSpec:
    """One run's settings. `concurrency` caps the requests in flight (None: no cap);
    `request_rate` sends them as a Poisson process of that many a second (None: all at once, so
    the cap alone sets the pace)."""

    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # the "model" field; None leaves it out
    endpoint: str = "completions"
    concurrency: int | None = None
    request_rate: float | None = None
    arrival_seed: int = 0
    temperature: float = 0.0  # greedy by default; above 0 request i carries "seed": i
    ignore_eos: bool = True  # with max_tokens: every output is exactly its requested length
    client_procs: int = 1
    request_timeout: float = 3600.0
    api_key: str | None = None
    progress: bool = True
    desc: str = "bench serve"

    @property
    def target(self) -> str:
        return self.url.rstrip("/") + ENDPOINTS[self.endpoint]

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"


def request_body(spec: LoadSpec, index: int, prompt: str | list[int], max_tokens: int) -> bytes:
    """The JSON body of request `index`: streaming with a usage chunk, exact output length."""
    body: dict = {} if spec.model is None else {"model": spec.model}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(
        max_tokens=max_tokens,
        temperature=spec.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.temperature > 0:
        body["seed"] = index
    return json.dumps(body, separators=(",", ":")).encode()
