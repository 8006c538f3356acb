"""The Responses API's request model and its translation into a chat-completions request.

The Responses API is served on top of the chat path (`openai_chat.py`), whose contract is the
OpenAI chat wire format. This module maps the request side:

    input items ──items_to_messages──► chat messages (user/system/assistant+tool_calls/tool)
    tools, tool_choice, text.format, max_output_tokens ──► their chat-completions forms

and back (`output_items`): a `chat.completion` message becomes the response's output items
(a `message` with `output_text`, one `function_call` per tool call, a `reasoning` item when the
chat path split one out).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sgl_tpu.server.tokenizer_manager import RequestError


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`; fields a local server has no use for (include, reasoning,
    truncation, prompt_cache_key, ...) are accepted and ignored."""

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
    metadata: dict[str, str] | None = None
    user: str | None = None
    # SGLang-style extensions (extra_body)
    seed: int | None = None
    top_k: int | None = None
    ignore_eos: bool | None = None


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


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat.completion `message` -> the response's output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or ""))
    for call in calls:
        fn = call["function"]
        items.append(function_call_item(call["id"], fn["name"], fn["arguments"]))
    return items


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The response's output as the chat message the next turn's prompt replays."""
    text = "".join(part["text"] for it in items if it["type"] == "message"
                   for part in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}
