"""The Responses API's request model and its translation into a chat-completions request.

The Responses API is served on top of the chat path (`openai_chat.py`), whose contract is the
OpenAI chat wire format. This module maps the request side:

    input items ──items_to_messages──► chat messages (user/system/assistant+tool_calls/tool)
    tools, tool_choice, text.format, max_output_tokens ──► their chat-completions forms

and back (`output_items`): a `chat.completion` message becomes the response's output items
(a `reasoning` item when the chat path's reasoning parser split one out, a `message` with
`output_text` and, with `include: ["message.output_text.logprobs"]`, its tokens' log-probs,
one `function_call` per tool call).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from sgl_tpu.server.tokenizer_manager import RequestError


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: dict[str, Any] | None = None


# `include` values OpenAI accepts; only the log-probs change what this server returns (it runs
# no built-in tools and keeps no encrypted reasoning).
OUTPUT_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`; fields a local server has no use for (service_tier, ...) are
    accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    store: bool = True
    stream: bool = False
    background: bool = False  # run on after the answer (responses_background.py)
    metadata: dict[str, str] | None = None
    include: list[Literal[INCLUDABLE]] | None = None  # type: ignore[valid-type]
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None  # `user` and `safety_identifier`: logged at debug level only
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # names the session (default: the conversation)
    priority: StrictInt | None = None  # as on the chat route (SGLang's field)
    # SGLang-style extensions (extra_body)
    seed: int | None = None
    top_k: int | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ()) or bool(self.top_logprobs)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- request: items -> chat messages -----------------------------------------------------
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = ("user", "system", "developer", "assistant")


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise RequestError(f"{where}.content[{k}]: content part type {kind!r} is not "
                               f"supported (text only: {', '.join(_TEXT_PARTS)})")
        texts.append(part.get("text") if kind != "refusal" else part.get("refusal"))
        if not isinstance(texts[-1], str):
            raise RequestError(f"{where}.content[{k}] has no text")
    return "".join(texts)


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{name} must be a string")
    return value


def items_to_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input (a string or items) -> chat messages.

    Consecutive `function_call` items (and the assistant text right before them) become one
    assistant message with `tool_calls`, as a chat client would have sent it.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise RequestError(f"{where}.role must be one of {', '.join(_ROLES)}")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where),
                                 "arguments": _field(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": output})
        elif kind == "reasoning":
            continue  # earlier reasoning is not fed back (chat templates drop it too)
        else:
            raise RequestError(f"{where}: input item type {kind!r} is not supported "
                               f"(message, function_call, function_call_output, reasoning)")
    return messages


# ---- request: tools, tool_choice, text.format -------------------------------------------
def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) -> chat tools (`{"type", "function": {...}}`); a tool
    already in the chat form is taken as it is."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise RequestError(f"tools[{i}]: tool type {tool.get('type')!r} is not supported "
                               f"(function tools only)")
        spec = tool["function"] if isinstance(tool.get("function"), dict) else tool  # chat form
        fn = {"name": _field(spec, "name", f"tools[{i}]")}
        for key in ("description", "parameters", "strict"):
            if spec.get(key) is not None:
                fn[key] = spec[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"tool_choice {choice!r} is not supported (\"none\", \"auto\", "
                       f"\"required\" or {{\"type\": \"function\", \"name\": ...}})")


def chat_response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format.schema must be a JSON object")
        return {"type": "json_schema",
                "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"],
                                "strict": fmt.get("strict")}}
    raise RequestError(f"text.format.type {fmt.get('type')!r} is not supported "
                       f"(text, json_object, json_schema)")


# ---- response: chat message -> output items ----------------------------------------------
def message_item(text: str, status: str = "completed", item_id: str | None = None
                 ) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def thinking_kwargs(reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat template kwargs for `reasoning`: effort "none" turns the template's thinking off;
    the other efforts leave the model's default (the effort is not enforced)."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise RequestError(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, "
                           f"got {effort!r}")
    return {"enable_thinking": False} if effort == "none" else None


def token_span(entries: list[dict[str, Any]], text: str) -> tuple[int, int] | None:
    """(first, last + 1): the log-prob entries whose tokens wrote `text`, found by its first
    place in their joined bytes (a character split over tokens decodes to U+FFFD token by
    token), or their joined token text where an entry has no bytes; None where `text` is
    empty or not there."""
    if all(e.get("bytes") for e in entries):
        pieces: list[Any] = [bytes(e["bytes"]) for e in entries]
        target: Any = text.encode()
        start = b"".join(pieces).find(target)
    else:
        pieces, target = [e["token"] for e in entries], text
        start = "".join(pieces).find(target)
    if not text or start < 0:
        return None
    end, at, wrote = start + len(target), 0, []
    for i, piece in enumerate(pieces):
        if at < end and at + len(piece) > start:
            wrote.append(i)
        at += len(piece)
    return wrote[0], wrote[-1] + 1


def text_logprobs(entries: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The chat path's per-token log-probs (every generated token: reasoning, text, call
    markup, stop) cut to the tokens that wrote `text` (token_span); all of them where their
    bytes do not contain `text`."""
    if not text:
        return []
    span = token_span(entries, text)
    return entries if span is None else entries[span[0] : span[1]]


def output_items(message: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
                 ) -> list[dict[str, Any]]:
    """A chat.completion `message` -> the response's output items; `logprobs` (the chat
    choice's `logprobs.content`) go to the output text when given."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        item = message_item(message.get("content") or "")
        if logprobs is not None:
            item["content"][0]["logprobs"] = text_logprobs(logprobs, message.get("content") or "")
        items.append(item)
    for call in calls:
        fn = call["function"]
        items.append(function_call_item(call["id"], fn["name"], fn["arguments"]))
    return items


def usage(chat_usage: dict[str, Any] | None, reasoning_tokens: int = 0
          ) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}
