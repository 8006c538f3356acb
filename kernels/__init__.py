"""Kernel sources: the pure-jax.numpy paged attention reference (the JAX backend's oracle and its
`ref` on any platform), its batch-invariant variant, the Pallas TPU ragged paged attention
kernel, and in csrc/ the C++ of the torch backend's compiled CPU kernels. The backends reach them
from their homes; nothing here imports a home (tests/test_layering.py)."""
