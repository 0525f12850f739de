"""Fast paths and their fallbacks: every fallback to a reference path is logged once, recorded (the
benchmark refuses to record numbers after one), and fatal under `KIPP_<BACKEND>_REQUIRE_KERNELS=1`.
`KIPP_<BACKEND>_DISABLE_KERNELS` switches kernels off: `1`/`all`, or a comma list of names."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("kipp")

_lock = threading.Lock()
_fallbacks: dict[tuple[str, str], str] = {}


class KernelUnavailableError(RuntimeError):
    """A required fast path fell back (KIPP_*_REQUIRE_KERNELS=1)."""


def _env(backend: str, what: str) -> str:
    return os.environ.get(f"KIPP_{backend.upper()}_{what}", "").strip()


def require_kernels(backend: str) -> bool:
    return _env(backend, "REQUIRE_KERNELS").lower() in ("1", "true", "yes")


def kernel_disabled(backend: str, name: str) -> bool:
    """True when the user switched this kernel off (for bisecting); not counted as a fallback."""
    v = _env(backend, "DISABLE_KERNELS").lower()
    if v in ("1", "true", "yes", "all"):
        return True
    return name.lower() in {x.strip() for x in v.split(",") if x.strip()}


def report_fallback(backend: str, name: str, reason: str) -> None:
    """A fast path is unavailable and its reference runs instead: say so once; fatal if required."""
    if require_kernels(backend):
        raise KernelUnavailableError(
            f"{backend} kernel {name} is unavailable ({reason}) and "
            f"KIPP_{backend.upper()}_REQUIRE_KERNELS is set"
        )
    with _lock:
        if (backend, name) in _fallbacks:
            return
        _fallbacks[(backend, name)] = reason
    log.warning("%s kernel %s falls back to its reference: %s", backend, name, reason)


def fallbacks() -> dict[tuple[str, str], str]:
    """Every (backend, kernel) that fell back in this process, with the reason."""
    with _lock:
        return dict(_fallbacks)


def clear_fallbacks() -> None:
    with _lock:
        _fallbacks.clear()
