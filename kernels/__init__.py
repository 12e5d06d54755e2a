"""Fused log-prob + entropy kernels, installed as `rljax.kernels`."""
