"""Host-to-device uploads that do not wait for the device.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and waits for the stream,
so every small upload in a step would wait for the step before it to finish. Going through pinned
memory with `non_blocking=True` queues the copy instead (PyTorch's pinned allocator keeps the host
buffer until the copy has run), which is what lets the engine queue step N+1 while step N runs.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """`a` as a tensor on `device`; on a CUDA device the copy is queued, not waited for."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
