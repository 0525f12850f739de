"""The KV cache budget (`--kv-cache-memory`, BackendOptions.kv_cache_memory), read the same way
by the CLI and every backend: a size with its unit, or a fraction of free memory."""

from __future__ import annotations

import re

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(ib|b)?\s*")


def parse_kv_memory(value) -> tuple[str, float]:
    """("bytes", n) from a size ("8GiB", "512MiB" and "2G" binary, "1.5GB" decimal, "4096B") or
    an int byte count; ("fraction", f) from a fraction of free memory in (0, 1] (a float, or a
    plain number as text). ValueError otherwise: a plain number above 1 needs a unit."""
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory must be a size or a fraction, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
        return "bytes", float(value)
    if isinstance(value, float) or _is_number(value):
        f = float(value)
        if not 0 < f <= 1:
            raise ValueError(
                f"kv_cache_memory: a plain number is a fraction of free memory in (0, 1], got "
                f"{value!r} (a size needs its unit, e.g. '{value}GiB')"
            )
        return "fraction", f
    m = _SIZE.fullmatch(str(value).lower()) if isinstance(value, str) else None
    if not m or not (m.group(2) or m.group(3)):
        raise ValueError(
            f"kv_cache_memory must be a size like '8GiB' or '512MiB', or a fraction of free "
            f"memory like '0.3', got {value!r}"
        )
    num, prefix, suffix = m.groups()
    base = 1000 if suffix == "b" and prefix else 1024
    n = float(num) * base ** ("_kmgt".find(prefix) if prefix else 0)
    if n < 1:
        raise ValueError(f"kv_cache_memory must be at least one byte, got {value!r}")
    return "bytes", n


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return isinstance(value, str)
