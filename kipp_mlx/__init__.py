"""The MLX backend (Apple-first): the Qwen3 model in MLX behind kipp_core's backend contract.

Entry point: kipp_mlx.backend.MlxBackend (LLM(..., backend="mlx")). Metal on Apple silicon, MLX's
CPU build elsewhere; custom kernels (kipp_mlx.kernels) run where a GPU does.
"""
