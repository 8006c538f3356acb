"""Model forward functions of the JAX backend (sgl_tpu/models/registry.py names them)."""
