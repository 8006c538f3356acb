"""Tools and reasoning on the chat path: request checks, how tools reach the prompt, which
grammar constrains the output, and how the output splits into reasoning / content / calls.

    plan_chat(tm, req) -> ChatPlan
        tools checked (400 naming the problem), tool_choice resolved
        messages: the template renders `tools` when it can; otherwise a system-prompt block in
        the parser's format is injected, assistant `tool_calls` are written in that format and
        `role: "tool"` results become user turns `<tool_response>\\n...\\n</tool_response>`
        plan_grammar: required / named -> only calls (tool_grammar, "required"); auto -> free text,
        a call once opened is constrained (lazy trigger); after `</think>` when reasoning
The output side (message / stream deltas) is `chat_output.py`.

A parser is resolved once per server (`--tool-call-parser`, else from the chat template; see
`sgl_tpu.function_call.detect_parser`) and logged at start-up by `log_tool_setup`.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import jsonschema

from sgl_tpu.constrained.tool_grammar import json_after_reasoning, tool_call_grammar
from sgl_tpu.function_call import (
    ToolCallParser,
    detect_parser,
    get_parser,
)
from sgl_tpu.reasoning_parser import (
    ReasoningParser,
    get_reasoning_parser,
)
from sgl_tpu.server.openai_protocol import ChatCompletionRequest
from sgl_tpu.server.tokenizer_manager import RequestError, TokenizerManager

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_SENTINEL = "zq_sentinel_fn_91"


@lru_cache(maxsize=8)
def _resolve_parser(flag: str | None, chat_template: str | None) -> tuple[str, str]:
    if flag is not None:
        return flag, "--tool-call-parser"
    return detect_parser(chat_template)


def tool_parser(tm: TokenizerManager) -> ToolCallParser:
    name, _ = _resolve_parser(tm.args.tool_call_parser, tm.tokenizer.chat_template)
    return get_parser(name)


def log_tool_setup(tm: TokenizerManager) -> None:
    name, why = _resolve_parser(tm.args.tool_call_parser, tm.tokenizer.chat_template)
    logger.info("tool-call parser: %s (%s)", name, why)
    if tm.args.reasoning_parser:
        logger.info("reasoning parser: %s", tm.args.reasoning_parser)


@lru_cache(maxsize=8)
def _template_features(tokenizer: Any) -> tuple[bool, bool]:
    """(renders `tools`, renders assistant `tool_calls`), found by rendering a sentinel."""
    def renders(**kw: Any) -> bool:
        try:
            return _SENTINEL in tokenizer.apply_chat_template(add_generation_prompt=True, **kw)
        except ValueError:
            return False

    tool = {"type": "function", "function": {"name": _SENTINEL, "description": _SENTINEL,
                                             "parameters": {"type": "object",
                                                            "properties": {}}}}
    call = {"id": "call_0", "type": "function",
            "function": {"name": _SENTINEL, "arguments": {}}}
    user = {"role": "user", "content": "hi"}
    return (renders(messages=[user], tools=[tool]),
            renders(messages=[user, {"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]))


@dataclass
class ChatPlan:
    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None   # what the template's `tools` gets
    functions: list[dict[str, Any]] = field(default_factory=list)  # parse calls of these
    parser: ToolCallParser | None = None           # None: no tool parsing
    reasoning: ReasoningParser | None = None       # None: no reasoning split
    in_reasoning: bool = False                     # set once the prompt is rendered
    grammar_args: dict[str, Any] | None = None     # what plan_grammar builds
    grammar: str | None = None                     # Lark text (the `ebnf` kind)
    thinking: bool = False                         # a reasoning parser, thinking not off
    reasoning_name: str | None = None


def _bad(msg: str) -> RequestError:
    return RequestError(msg, 400)


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The offered function dicts; 400 for a malformed tool or an invalid parameters schema."""
    functions, seen = [], set()
    for i, tool in enumerate(tools or []):
        if tool.get("type", "function") != "function" or not isinstance(tool.get("function"),
                                                                         dict):
            raise _bad(f"tools[{i}]: only {{\"type\": \"function\", \"function\": {{...}}}} "
                       "tools are supported")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' or "
                       f"'.', got {name!r}")
        if name in seen:
            raise _bad(f"tools[{i}].function.name: duplicate function name {name!r}")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise _bad(f"tools[{i}].function.parameters must be a JSON schema object")
            try:
                jsonschema.validators.validator_for(params).check_schema(params)
            except jsonschema.SchemaError as e:
                raise _bad(f"tools[{i}].function.parameters is not a valid JSON schema: "
                           f"{e.message}") from None
            if (bad := _unresolved_ref(params, params)) is not None:
                raise _bad(f"tools[{i}].function.parameters: $ref {bad!r} does not resolve "
                           "(only local references such as '#/$defs/Name' are supported)")
        functions.append(fn)
    return functions


def _unresolved_ref(node: Any, root: dict[str, Any]) -> str | None:
    """The first `$ref` in `node` that is not a JSON pointer into `root`, if any."""
    if isinstance(node, list):
        return next((r for x in node if (r := _unresolved_ref(x, root)) is not None), None)
    if not isinstance(node, dict):
        return None
    ref = node.get("$ref")
    if ref is not None:
        target: Any = root
        if not isinstance(ref, str) or not ref.startswith("#"):
            return str(ref)
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return ref
            target = target[part]
    return next((r for k, v in node.items() if k != "$ref"
                 and (r := _unresolved_ref(v, root)) is not None), None)


def _tool_choice(req: ChatCompletionRequest, functions: list[dict[str, Any]]
                 ) -> tuple[str, str | None]:
    """("none" | "auto" | "required", named function or None)."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                       f"got {choice!r}")
        if choice == "required" and not functions:
            raise _bad("tool_choice 'required' needs at least one tool in `tools`")
        return choice, None
    name = None
    if isinstance(choice, dict):  # {"type": "function", "function": {"name"}} or {"name"}
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    if not isinstance(name, str):
        raise _bad('tool_choice must be {"type": "function", "function": {"name": ...}}')
    if name not in {f["name"] for f in functions}:
        raise _bad(f"tool_choice names function {name!r}, which is not among `tools`")
    return "required", name


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _check_messages(messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise _bad(f"messages[{i}]: a tool message needs a string tool_call_id")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise _bad(f"messages[{i}].tool_calls must be a list on an assistant message")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"messages[{i}].tool_calls[{j}] needs function.name")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args or "{}")
                except json.JSONDecodeError:
                    raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                               "valid JSON") from None
            if not isinstance(args, dict):
                raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON "
                           "object")
            fn["arguments"] = args  # templates index into the arguments (as SGLang passes them)


def fallback_messages(messages: list[dict[str, Any]], parser: ToolCallParser,
                       functions: list[dict[str, Any]], offer: bool) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: calls written in the parser's
    format, tool results as user turns, and (when `offer`) the tools block in the system
    prompt."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            text = _content_text(m.get("content"))
            m["content"] = (text + "\n" if text else "") + parser.render_calls(calls)
            del m["tool_calls"]
        elif m["role"] == "tool":
            m = {"role": "user", "content": "<tool_response>\n"
                 f"{_content_text(m.get('content'))}\n</tool_response>"}
        out.append(m)
    if offer:
        block = parser.tools_prompt(functions)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": _content_text(out[0].get("content")) + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def plan_chat(tm: TokenizerManager, req: ChatCompletionRequest) -> ChatPlan:
    """Checks and decisions for one request (RequestError on bad input)."""
    messages = []
    for m in req.messages:
        msg = copy.deepcopy(m.model_dump(exclude_none=True))
        msg["role"] = "system" if m.role == "developer" else m.role
        msg.setdefault("content", "")
        messages.append(msg)
    _check_messages(messages)
    functions = check_tools(req.tools)
    mode, named = _tool_choice(req, functions)
    parser = tool_parser(tm)
    renders_tools, renders_calls = _template_features(tm.tokenizer)
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    offer = mode != "none" and bool(functions)
    if (offer and not renders_tools) or (has_history and not renders_calls):
        messages = fallback_messages(messages, parser, functions, offer and not renders_tools)
    plan = ChatPlan(messages=messages,
                    template_tools=req.tools if offer and renders_tools else None,
                    reasoning_name=tm.args.reasoning_parser)
    if offer:
        plan.functions, plan.parser = functions, parser
    kwargs = req.chat_template_kwargs or {}
    if tm.args.reasoning_parser and req.separate_reasoning:
        plan.reasoning = get_reasoning_parser(tm.args.reasoning_parser)
    plan.thinking = tm.args.reasoning_parser is not None \
        and kwargs.get("enable_thinking") is not False
    user_grammar = req.response_format is not None and req.response_format.type != "text" \
        or any(x is not None for x in (req.regex, req.ebnf, req.json_schema))
    llguidance = tm.args.grammar_backend == "llguidance"
    if mode == "required":
        if user_grammar:
            raise _bad("tool_choice 'required' or a named function cannot be combined with "
                       "response_format, regex, ebnf or json_schema")
        if not llguidance:
            raise _bad("tool_choice 'required' or a named function needs the llguidance "
                       "grammar backend")
        fns = [f for f in functions if f["name"] == named] if named else functions
        plan.grammar_args = {"kind": "tools", "functions": fns, "mode": "required",
                             "parallel": named is None and req.parallel_tool_calls}
    elif mode == "auto" and offer and not user_grammar and llguidance:
        plan.grammar_args = {"kind": "tools", "functions": functions, "mode": "auto",
                             "parallel": req.parallel_tool_calls}
    elif plan.thinking and llguidance and req.response_format is not None \
            and req.response_format.type != "text":
        fmt = req.response_format
        schema = {"type": "object"} if fmt.type == "json_object" \
            else (fmt.json_schema or {}).get("schema")
        if isinstance(schema, dict):
            plan.grammar_args = {"kind": "json", "schema": schema}
    return plan


def plan_grammar(plan: ChatPlan, parser: ToolCallParser, prompt_text: str) -> str | None:
    """The Lark grammar for the request, once its prompt is rendered (None: unconstrained).

    With a reasoning parser and thinking on, the constraint starts after the reasoning block:
    "inside" when the prompt opened it (or the parser forces it), else "optional".
    """
    args = plan.grammar_args
    if args is None:
        return None
    reasoning = None
    if plan.thinking:
        rp = get_reasoning_parser(plan.reasoning_name)
        reasoning = "inside" if rp.starts_in_reasoning(prompt_text) else "optional"
    if args["kind"] == "json":
        return json_after_reasoning(args["schema"], reasoning)
    return tool_call_grammar(parser, args["functions"], mode=args["mode"],
                             parallel=args["parallel"], reasoning=reasoning)
