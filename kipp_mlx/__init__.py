"""The MLX backend (Apple-first): the Qwen3 model in MLX behind kipp_core's backend contract.

Entry point: kipp_mlx.backend.MlxBackend (LLM(..., backend="mlx")). Metal on Apple silicon, MLX's
CPU or CUDA build elsewhere; custom kernels (kipp_mlx.kernels) run where a GPU does.
"""

import os as _os

# MLX's CUDA build runs float32 matmuls in TF32 unless told otherwise (read once, at the first
# matmul); a float32 model here computes in float32, as the oracle gates expect.
_os.environ.setdefault("MLX_ENABLE_TF32", "0")
