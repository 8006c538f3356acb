"""Attention kernels: the pure-jax.numpy reference (all backends) and, later, Pallas TPU kernels."""
