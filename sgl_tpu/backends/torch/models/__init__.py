"""Model modules of the torch backend (sgl_tpu/models/registry.py names them)."""
