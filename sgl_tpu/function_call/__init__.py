"""Tool calling: parsers from model text to OpenAI tool calls, one per format, in a registry
named as SGLang names them (`--tool-call-parser`).

    get_parser("hermes")                 -> a ToolCallParser (stateless, shared)
    detect_parser(chat_template)         -> (name, why): the format the template writes
    parse_tool_calls(parser, text, fns)  -> (text outside calls, [ToolCall])   non-streaming
    ToolCallStream(parser, fns)          -> .feed(chunk) / .finish() events     streaming
"""

from __future__ import annotations

from sgl_tpu.function_call.base import (
    CallDelta,
    Text,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    parse_tool_calls,
)
from sgl_tpu.function_call.json_formats import (
    HermesParser,
    Llama3Parser,
    MistralParser,
    Qwen25Parser,
)
from sgl_tpu.function_call.markup_formats import PythonicParser, Qwen3CoderParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": Qwen25Parser,
    "qwen": Qwen25Parser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}
TOOL_CALL_PARSERS = tuple(PARSERS)
DEFAULT_PARSER = "hermes"

# (marker in the chat template, parser): the first that matches picks the format.
_TEMPLATE_MARKERS = (
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "qwen25"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),
    ("<|python_tag|>", "llama3"),
)


def get_parser(name: str) -> ToolCallParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choices: "
                         f"{', '.join(PARSERS)}") from None


def detect_parser(chat_template: str | None) -> tuple[str, str]:
    """The parser for a model whose flag was not given, and why (for the start-up log).

    The template's own tool markup decides; a template without any (SmolLM2's) gets the
    hermes format, described to the model by the injected system-prompt block.
    """
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name, f"the chat template writes {marker!r}"
    return DEFAULT_PARSER, "the chat template has no tool-call markup; hermes-style " \
                           "<tool_call> blocks, described in the system prompt"


__all__ = ["CallDelta", "DEFAULT_PARSER", "PARSERS", "TOOL_CALL_PARSERS", "Text", "ToolCall",
           "ToolCallParser", "ToolCallStream", "detect_parser", "get_parser",
           "parse_tool_calls"]
