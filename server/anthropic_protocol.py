"""Anthropic's Messages API: its request models and the translation to and from the chat path.

The Messages API is served on top of the chat path (`openai_chat.py`), whose contract is the
OpenAI chat wire format. This module maps the request side:

    system (string or text blocks)        ──► a system message
    messages: text / tool_use / tool_result blocks
        assistant text + tool_use blocks  ──► one assistant message with `tool_calls`
        user tool_result blocks           ──► `role: "tool"` messages (in block order)
        thinking / redacted_thinking      ──► dropped (chat templates drop earlier reasoning)
    tools (input_schema), tool_choice, thinking, stop_sequences ──► their chat forms
    metadata.user_id                      ──► program_id (when a short string)

and back (`message_content`, `stop_reason`, `usage`): a chat message becomes `thinking`, `text`
and `tool_use` content blocks.

`cache_control` breakpoints (at most four) become one retention pin: the radix cache keeps
every prefix without being asked, but a pin keeps it through memory pressure. A pin covers a
request's whole path in the tree (its prompt, then its trajectory), not a prefix ending at a
block, so the request's `retention_seconds` is the longest TTL among its breakpoints
("5m" = 300 s, "1h" = 3600 s), at most the server's `--max-retention-s`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from sgl_tpu.server.openai_protocol import ChatCompletionRequest
from sgl_tpu.server.tokenizer_manager import RequestError
from sgl_tpu.validation import check_session_id

MAX_CACHE_BREAKPOINTS = 4  # as Anthropic
CACHE_TTL_SECONDS = {"5m": 300, "1h": 3600}  # Anthropic's TTLs; "5m" when none is given


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: what shapes the prompt."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`; fields a local server has no use for (service_tier, container,
    mcp_servers, ...) are accepted and ignored."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    priority: StrictInt | None = None  # as on the chat route (SGLang's field)

    @property
    def user_id(self) -> Any:
        return self.metadata.get("user_id") if isinstance(self.metadata, dict) else None

    @property
    def program_id(self) -> str | None:
        """`metadata.user_id` names the program (agent), unless it is not a short string."""
        return self.user_id if check_session_id(self.user_id) is None else None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """The chat path's `call_...` id in Anthropic's `toolu_...` form."""
    return "toolu_" + call_id.removeprefix("call_")


# ---- request -> chat request -------------------------------------------------------------
class _Breakpoints:
    """Counts `cache_control` breakpoints, refusing a malformed one or a fifth, and keeps the
    longest TTL among them (seconds; 0 without breakpoints)."""

    def __init__(self) -> None:
        self.count = 0
        self.ttl_s = 0

    def check(self, holder: dict[str, Any], where: str) -> None:
        cc = holder.get("cache_control")
        if cc is None:
            return
        if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
            raise RequestError(f'{where}.cache_control must be {{"type": "ephemeral"}}')
        ttl = "5m" if cc.get("ttl") is None else cc["ttl"]
        if not isinstance(ttl, str) or ttl not in CACHE_TTL_SECONDS:
            raise RequestError(f"{where}.cache_control.ttl must be one of "
                               f"{', '.join(CACHE_TTL_SECONDS)}")
        self.ttl_s = max(self.ttl_s, CACHE_TTL_SECONDS[ttl])
        self.count += 1
        if self.count > MAX_CACHE_BREAKPOINTS:
            raise RequestError(f"{where}: at most {MAX_CACHE_BREAKPOINTS} blocks may carry "
                               "cache_control")


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key} must be a string")
    return value


def _text_blocks(blocks: list[Any], where: str, marks: _Breakpoints) -> str:
    """Text blocks (a system prompt, a tool result's content) as one string."""
    texts = []
    for k, block in enumerate(blocks):
        at = f"{where}[{k}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise RequestError(f"{at}: content block type {kind!r} is not supported here "
                               "(text only)")
        marks.check(block, at)
        texts.append(_string(block, "text", at))
    return "\n".join(texts)


def _tool_result(block: dict[str, Any], where: str, marks: _Breakpoints) -> dict[str, Any]:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = _text_blocks(content, f"{where}.content", marks)
    else:
        raise RequestError(f"{where}.content must be a string or a list of text blocks")
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
            "content": text}


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.input must be a JSON object")
    return {"id": _string(block, "id", where), "type": "function",
            "function": {"name": _string(block, "name", where),
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _flush_user_text(out: list[dict[str, Any]], texts: list[str]) -> None:
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
        texts.clear()


def _messages(req: CountTokensRequest, marks: _Breakpoints) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for k, block in enumerate(m.content):
            at = f"{where}.content[{k}]"
            kind = block.get("type")
            marks.check(block, at)
            if kind == "text":
                texts.append(_string(block, "text", at))
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(_tool_call(block, at))
            elif kind == "tool_result" and m.role == "user":
                _flush_user_text(out, texts)
                out.append(_tool_result(block, at, marks))
            else:
                raise RequestError(f"{at}: content block type {kind!r} is not supported in a "
                                   f"{m.role} message (user: text, tool_result; assistant: "
                                   "text, tool_use, thinking)")
        if m.role == "user":
            _flush_user_text(out, texts)
        else:
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    if req.messages[-1].role == "assistant":
        raise RequestError("messages: the last message must be a user message (continuing a "
                           "prefilled assistant turn is not supported)")
    return out


def _tools(tools: list[dict[str, Any]] | None, marks: _Breakpoints
           ) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where} must be an object")
        if tool.get("type") not in (None, "custom"):
            raise RequestError(f"{where}: tool type {tool.get('type')!r} is not supported "
                               "(client tools with an input_schema only)")
        marks.check(tool, where)
        if not isinstance(tool.get("input_schema"), dict):
            raise RequestError(f"{where}.input_schema must be a JSON schema object")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None, has_tools: bool
                 ) -> tuple[str | dict[str, Any] | None, bool]:
    """(the chat tool_choice, parallel tool calls allowed)."""
    if choice is None:
        return None, True
    kind = choice.get("type")
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind in ("any", "tool") and not has_tools:
        raise RequestError(f"tool_choice {kind!r} needs at least one tool in `tools`")
    if kind == "auto":
        return "auto", parallel
    if kind == "none":
        return "none", parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise RequestError('tool_choice {"type": "tool"} needs the tool\'s `name`')
        return {"type": "function", "function": {"name": choice["name"]}}, False
    raise RequestError(f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}")


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat template kwargs for the `thinking` setting (budget_tokens is accepted, not
    enforced: the reasoning parser splits what the model writes)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise RequestError("thinking.budget_tokens must be a positive integer")
        return None
    if kind in ("adaptive", "between_tools"):
        return None
    raise RequestError("thinking.type must be 'enabled', 'adaptive', 'between_tools' or "
                       f"'disabled', got {kind!r}")


def chat_request(req: CountTokensRequest, session_id: Any = None,
                 max_retention_s: float = 0.0) -> ChatCompletionRequest:
    """The chat-completions request that serves `req` (RequestError on bad input; errors in
    the chat request's own checks name the chat fields). Its `retention_seconds` is the
    longest breakpoint TTL, at most `max_retention_s`."""
    marks = _Breakpoints()
    if req.cache_control is not None:  # a breakpoint on the whole request
        top = _Breakpoints()
        top.check({"cache_control": req.cache_control}, "body")
        marks.ttl_s = top.ttl_s
    system: list[dict[str, Any]] = []
    if req.system is not None:
        text = req.system if isinstance(req.system, str) \
            else _text_blocks(req.system, "system", marks)
        system = [{"role": "system", "content": text}]
    tools = _tools(req.tools, marks)
    tool_choice, parallel = _tool_choice(req.tool_choice, bool(tools))
    body: dict[str, Any] = {
        "model": req.model, "messages": system + _messages(req, marks), "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": parallel,
        "chat_template_kwargs": _thinking(req.thinking), "session_id": session_id,
    }
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    stream=req.stream, priority=req.priority, program_id=req.program_id,
                    retention_seconds=min(marks.ttl_s, max_retention_s) or None,
                    stream_options={"continuous_usage_stats": True} if req.stream else None)
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise RequestError("invalid request: " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None


# ---- chat response -> message ------------------------------------------------------------
def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (the chat path's JSON text) as the `tool_use` block's `input`."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message_content(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat.completion `message` -> content blocks (thinking, text, tool_use); an empty
    answer is one empty text block, so `content[0]` always exists."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"],
                       "input": tool_input(fn["arguments"])})
    return blocks or [{"type": "text", "text": ""}]


def stop_reason(finish_reason: str | None, matched: Any, stop_sequences: list[str] | None
                ) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) from the chat path's finish reason and matched stop."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return ("end_turn" if finish_reason is not None else None), None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the prefix cache
    (`cache_read_input_tokens`); the radix cache writes without being asked, so no tokens are
    billed as `cache_creation_input_tokens`."""
    chat_usage = chat_usage or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached,
            "output_tokens": chat_usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message(msg_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
            sequence: str | None, usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_}
