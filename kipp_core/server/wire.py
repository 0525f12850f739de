"""The engine process's messages as plain tuples for pickling: a step's outputs are hundreds of
small dataclasses, and pickle spends most of its time on their per-object state dicts (a
plain stream step is a TokenDelta tuple already: kipp_core/request.py). Fields go
in their dataclass order (attrgetter, at C speed), so a field added to outputs.py travels without
a change here; what is not an output (acks, stats) is pickled as it is."""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter

from kipp_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kipp_core.server.engine_worker import EngineMessage


def _getter(cls) -> attrgetter:
    return attrgetter(*[f.name for f in fields(cls)])


_REQUEST, _COMPLETION, _METRICS = (
    _getter(RequestOutput),
    _getter(CompletionOutput),
    _getter(RequestMetrics),
)
_NAMES = [f.name for f in fields(RequestOutput)]
_OUTPUTS, _METRICS_AT = _NAMES.index("outputs"), _NAMES.index("metrics")


def pack(msg: EngineMessage) -> tuple:
    outs = []
    for o in msg.outputs:
        t = list(_REQUEST(o))
        t[_OUTPUTS] = [_COMPLETION(c) for c in o.outputs]
        t[_METRICS_AT] = _METRICS(o.metrics)
        outs.append(t)
    return outs, msg.acks, msg.stats, msg.error, msg.deltas


def unpack(packed: tuple) -> EngineMessage:
    outs, acks, stats, error, deltas = packed
    for t in outs:
        t[_OUTPUTS] = [CompletionOutput(*c) for c in t[_OUTPUTS]]
        t[_METRICS_AT] = RequestMetrics(*t[_METRICS_AT])
    return EngineMessage([RequestOutput(*t) for t in outs], acks, stats, error, deltas)
