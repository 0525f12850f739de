"""`kipp bench serve`'s load generator: streaming requests against any OpenAI-compatible server,
from client processes of their own, with vLLM benchmark_serving's metrics."""

from kipp_core.loadgen.bench import run_workload
from kipp_core.loadgen.metrics import summarize
from kipp_core.loadgen.runner import LoadResult, run_load
from kipp_core.loadgen.spec import LoadSpec

__all__ = ["LoadResult", "LoadSpec", "run_load", "run_workload", "summarize"]
