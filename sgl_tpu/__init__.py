"""sgl-tpu: an LLM inference server for agentic workloads, on JAX."""


def __getattr__(name: str):
    # Lazy: importing sgl_tpu must not import JAX or load a model.
    if name == "Engine":
        from sgl_tpu.engine import Engine

        return Engine
    raise AttributeError(name)
