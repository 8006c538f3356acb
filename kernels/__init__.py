"""Attention kernels: the registry that picks one per executor backend (`backends.py`), the
pure-jax.numpy reference (the JAX test oracle), the Pallas TPU ragged paged attention kernel,
and the torch paged attention."""
