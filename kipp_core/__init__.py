"""Kipp: an inference engine for the Qwen3 dense family.

from kipp_core import LLM, SamplingParams
"""

__version__ = "0.2.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy, so `import kipp_core` stays cheap for the CLI's --help and for the server's workers.
    if name == "LLM":
        from kipp_core.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kipp_core.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kipp_core' has no attribute {name!r}")
