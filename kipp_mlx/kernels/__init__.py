"""Custom MLX kernels, each beside its ops reference, chosen at load by the ladder (ladder.py)."""
