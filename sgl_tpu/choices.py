"""The `ServerArgs` fields whose values name a registry entry, their choices as the registries
list them (the CLI offers exactly these), and one check run before a model loads.

    schedule_policy    scheduler/policy.py     POLICIES
    radix_eviction_policy  mem_cache/eviction.py  EVICTION_POLICIES
    backend            executor/registry.py    EXECUTOR_BACKENDS (+ auto)
    attention_backend  executor/attention_registry.py  ATTENTION_BACKENDS (+ auto; per executor)
    grammar_backend    constrained/__init__.py GRAMMAR_BACKENDS (+ none)
    tool_call_parser   function_call/          TOOL_CALL_PARSERS (None: from the template)
    reasoning_parser   reasoning_parser.py     REASONING_PARSERS (None: off)
    quantization       quantization/           QUANTIZATION_METHODS (+ auto)
    speculative_algorithm  scheduler/speculative.py  DRAFTERS (+ auto, none; None: off)
    pooling            scheduler/pooling.py    POOLING_METHODS
    chat_template      loader/chat_templates.py BUILTIN_TEMPLATES, or a Jinja file (None: the
                                                model's own; not a CLI choice list)
"""

from __future__ import annotations

from sgl_tpu.config import ServerArgs


def registry_choices() -> dict[str, tuple[str, ...]]:
    from sgl_tpu.constrained import GRAMMAR_BACKENDS
    from sgl_tpu.executor.attention_registry import ATTENTION_BACKENDS
    from sgl_tpu.executor.registry import BACKEND_CHOICES
    from sgl_tpu.function_call import TOOL_CALL_PARSERS
    from sgl_tpu.mem_cache.eviction import EVICTION_POLICIES
    from sgl_tpu.quantization import QUANTIZATION_CHOICES
    from sgl_tpu.reasoning_parser import REASONING_PARSERS
    from sgl_tpu.scheduler.policy import POLICIES
    from sgl_tpu.scheduler.pooling import POOLING_METHODS
    from sgl_tpu.scheduler.speculative import DRAFTERS

    return {
        "schedule_policy": tuple(POLICIES),
        "radix_eviction_policy": tuple(EVICTION_POLICIES),
        "backend": BACKEND_CHOICES,
        "attention_backend": ("auto", *ATTENTION_BACKENDS),
        "grammar_backend": (*GRAMMAR_BACKENDS, "none"),
        "tool_call_parser": tuple(TOOL_CALL_PARSERS),
        "reasoning_parser": tuple(REASONING_PARSERS),
        "quantization": QUANTIZATION_CHOICES,
        "speculative_algorithm": ("auto", "none", *DRAFTERS),
        "pooling": tuple(POOLING_METHODS),
    }


def check_chat_template_choice(args: ServerArgs) -> None:
    """ValueError unless `args.chat_template` is None, a built-in name or an existing file (the
    CLI runs it when parsing, where a bad value is a usage error)."""
    if args.chat_template is not None:
        from sgl_tpu.loader.chat_templates import check_chat_template

        check_chat_template(args.chat_template)


# None is allowed: see the table above
_OPTIONAL = ("tool_call_parser", "reasoning_parser", "speculative_algorithm")


def check_registry_names(args: ServerArgs) -> None:
    """ValueError naming the field when a registry-backed value is unknown (a chat template
    neither built in nor an existing file), or an attention backend that the chosen executor
    cannot run."""
    for field, allowed in registry_choices().items():
        value = getattr(args, field)
        if value is None and field in _OPTIONAL:
            continue
        if value not in allowed:
            raise ValueError(f"{field} must be one of {allowed}, got {value!r}")
    check_chat_template_choice(args)
    from sgl_tpu.executor.attention_registry import resolve_attention_backend
    from sgl_tpu.executor.registry import resolve_backend

    if args.attention_backend != "auto":
        resolve_attention_backend(args.attention_backend, resolve_backend(args.backend))
