"""Tool-call benchmark: what the tool-call grammars cost per token, and how often a model's
calls would be invalid without them.

    python -m sgl_tpu.bench.tool_calls [--model-path PATH] [--samples 64] [--walks 16]
        [--output FILE]

(a) mask cost (offline, no server): for each parser format, the grammar of `tool_choice`
    "required" and "auto" over two functions (nested object, enum, integer bounds, array) is
    compiled, then random walks through its masks (random allowed token each step) time
    `fill_bitmask` + `accept_token` per token: mean / p50 / p95 ms, and compile ms.
(b) validity (a server with the model, started here): prompts that ask for a flight booking or
    the weather, rendered exactly as the chat route renders them (tools block injected for a
    template that ignores tools), then
      unconstrained: the prompt plus the opener `<tool_call>\\n` (the model has opened a call;
                     what `auto` would parse without the lazy grammar), temperature 1, through
                     `/generate` with no grammar; each output classified (valid / malformed
                     markup or JSON / unknown function / arguments violate the schema / cut off)
      constrained:   `/v1/chat/completions` with tool_choice "required" (the grammar), same
                     prompts and seeds
      auto:          `/v1/chat/completions` with tool_choice "auto": how often the model opens
                     a call at all, and whether those calls are valid
Prints one JSON object (also written to --output).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from typing import Any

import jsonschema
import numpy as np

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.serving import Server

FLIGHT = {"name": "book_flight", "description": "Book a flight", "parameters": {
    "type": "object", "properties": {
        "origin": {"type": "string", "minLength": 3, "maxLength": 20},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "cabin": {"enum": ["economy", "business", "first"]},
        "dates": {"type": "object", "properties": {
            "depart": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
            "flexible": {"type": "boolean"}}, "required": ["depart", "flexible"]},
        "meals": {"type": "array", "items": {"enum": ["veg", "halal", "kosher"]},
                  "maxItems": 2}},
    "required": ["origin", "passengers", "cabin", "dates"]}}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}
FUNCTIONS = [FLIGHT, WEATHER]
PROMPTS = ["Book me a business flight from Oslo on 2026-05-03 for two people.",
           "What is the weather in Paris right now?",
           "I need economy seats for 3 from Madrid, leaving 2026-11-20, dates flexible.",
           "Is it cold in Toronto today? Answer in fahrenheit."]


def mask_cost(model_path: str | None, walks: int) -> dict[str, Any]:
    from sgl_tpu.constrained import allowed_token_ids, create_backend
    from sgl_tpu.constrained.tool_grammar import tool_call_grammar
    from sgl_tpu.function_call import PARSERS, get_parser
    from sgl_tpu.loader import load_tokenizer

    tok = load_tokenizer(model_path)
    backend = create_backend("llguidance", tok, tok.vocab_size)
    row = np.zeros((tok.vocab_size + 31) // 32, np.int32)
    out = {}
    for name in sorted(set(PARSERS) - {"qwen", "qwen25"}):
        parser = get_parser(name)
        for mode in ("required", "auto"):
            lark = tool_call_grammar(parser, FUNCTIONS, mode=mode, parallel=True)
            t0 = time.perf_counter()
            compiled = backend.compile("ebnf", lark)
            compile_ms = (time.perf_counter() - t0) * 1e3
            rng, times = random.Random(0), []
            prefix = tok.encode("Let me check. " + parser.trigger, add_special_tokens=False) \
                if mode == "auto" else []
            for _ in range(walks):
                m = compiled.new_matcher()
                for t in prefix:
                    m.accept_token(t)
                for _ in range(64):
                    if m.is_terminated():
                        break
                    t0 = time.perf_counter()
                    m.fill_bitmask(row)
                    fill_s = time.perf_counter() - t0
                    t = int(rng.choice(allowed_token_ids(row)))
                    if t in tok.eos_token_ids:
                        break
                    t0 = time.perf_counter()
                    m.accept_token(t)
                    times.append(fill_s + time.perf_counter() - t0)
            ms = sorted(x * 1e3 for x in times)
            out[f"{name}/{mode}"] = {
                "compile_ms": round(compile_ms, 1), "tokens": len(ms),
                "mask_ms_mean": round(statistics.fmean(ms), 3),
                "mask_ms_p50": round(ms[len(ms) // 2], 3),
                "mask_ms_p95": round(ms[int(len(ms) * 0.95)], 3)}
    return out


def classify(text: str, parser: Any) -> str:
    from sgl_tpu.function_call import parse_tool_calls

    content, calls = parse_tool_calls(parser, text, FUNCTIONS)
    if not calls:
        if "</tool_call>" not in text:
            return "cut_off_or_unclosed"
        try:
            obj = json.loads(text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0])
        except (json.JSONDecodeError, IndexError):
            return "malformed_json_or_markup"
        if isinstance(obj, dict) and obj.get("name") not in {f["name"] for f in FUNCTIONS}:
            return "unknown_function"
        return "malformed_json_or_markup"
    schemas = {f["name"]: f["parameters"] for f in FUNCTIONS}
    for call in calls:
        try:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        except jsonschema.ValidationError:
            return "schema_violation"
    return "valid"


def validity(model_path: str | None, samples: int) -> dict[str, Any]:
    import openai
    import requests

    from sgl_tpu.function_call import get_parser
    from sgl_tpu.loader import load_tokenizer
    from sgl_tpu.server.openai_tools import fallback_messages

    parser = get_parser("hermes")
    tok = load_tokenizer(model_path)
    flags = ["--skip-warmup", "--max-total-tokens", "8192", "--chunked-prefill-size", "512"]
    if model_path:
        flags += ["--model-path", model_path]
    server = Server(flags, tempfile.mktemp(suffix=".log"))
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=600)
        model = client.models.list().data[0].id
        tools = [{"type": "function", "function": f} for f in FUNCTIONS]
        per_prompt = max(samples // len(PROMPTS), 1)
        unconstrained: dict[str, int] = {}
        constrained: dict[str, int] = {}
        auto = {"responses": 0, "with_calls": 0, "valid_calls": 0}
        for i, prompt in enumerate(PROMPTS):
            messages = fallback_messages([{"role": "user", "content": prompt}], parser,
                                         FUNCTIONS, offer=True)
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            opened = text + parser.opener
            body = {"text": [opened] * per_prompt, "sampling_params": [
                {"temperature": 1.0, "max_new_tokens": 160, "seed": 1000 * i + k,
                 "stop": ["<|im_end|>"]} for k in range(per_prompt)]}
            outs = requests.post(server.url + "/generate", json=body, timeout=600).json()
            for o in outs:
                kind = classify(parser.opener + o["text"], parser)
                unconstrained[kind] = unconstrained.get(kind, 0) + 1
            msgs = [{"role": "user", "content": prompt}]
            for choice, tally in (("required", None), ("auto", auto)):
                resp = client.chat.completions.create(
                    model=model, messages=msgs, tools=tools, tool_choice=choice,
                    temperature=1.0, seed=1000 * i, n=per_prompt, max_tokens=160)
                for c in resp.choices:
                    calls = c.message.tool_calls or []
                    ok = bool(calls)
                    for call in calls:
                        try:
                            jsonschema.validate(json.loads(call.function.arguments),
                                                {f["name"]: f["parameters"]
                                                 for f in FUNCTIONS}[call.function.name])
                        except (jsonschema.ValidationError, KeyError):
                            ok = False
                    if tally is None:
                        key = "valid" if ok else ("no_call" if not calls else "invalid")
                        constrained[key] = constrained.get(key, 0) + 1
                    else:
                        tally["responses"] += 1
                        tally["with_calls"] += bool(calls)
                        tally["valid_calls"] += ok
        n_unc = sum(unconstrained.values())
        return {"model": model, "samples_per_arm": n_unc,
                "unconstrained_opened_call": unconstrained,
                "unconstrained_invalid_share": round(1 - unconstrained.get("valid", 0) / n_unc,
                                                     3),
                "constrained_required": constrained, "auto": auto}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--walks", type=int, default=16)
    p.add_argument("--skip-server", action="store_true", help="only the mask cost")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    results: dict[str, Any] = {"mask_cost": mask_cost(args.model_path, args.walks)}
    if not args.skip_server:
        results["validity"] = validity(args.model_path, args.samples)
    emit(results, args.output)


if __name__ == "__main__":
    main()
