"""sgl-tpu: an LLM inference server for agentic workloads, on JAX."""
