"""Tensor parallelism: the head-split rule (backend-neutral), the JAX mesh and its shardings."""
