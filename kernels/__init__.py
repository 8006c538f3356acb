"""Attention kernels: the pure-jax.numpy reference (all backends), the Pallas TPU ragged paged
attention kernel, and the registry that picks one (`backends.py`)."""
