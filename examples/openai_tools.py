"""A tool-calling loop against a running sgl-tpu server with the official `openai` client:
the model calls `get_weather` (forced by tool_choice, so the call is valid by construction),
the tool runs here, its result goes back, and the model answers.

    python -m sgl_tpu.launch_server &            # or: make serve
    python examples/openai_tools.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import json

import openai

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}]


def get_weather(city: str, unit: str) -> dict:
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "sky": "sunny"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:30000")
    client = openai.OpenAI(base_url=p.parse_args().url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    resp = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False,
                                          temperature=0, max_tokens=80)
    message = resp.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        result = get_weather(**json.loads(call.function.arguments))
        print(f"call: {call.function.name}({call.function.arguments}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})

    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=60)
    print("answer:", final.choices[0].message.content)


if __name__ == "__main__":
    main()
