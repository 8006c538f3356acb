"""Talk to a running sgl-tpu server with the official `openai` client.

    python -m sgl_tpu.launch_server &            # or: make serve
    python examples/openai_client.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:30000")
    client = openai.OpenAI(base_url=p.parse_args().url + "/v1", api_key="unused")
    model = client.models.list().data[0].id

    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello in French."}],
        temperature=0, max_tokens=24)
    print("chat:", resp.choices[0].message.content, "| usage:", resp.usage)

    print("stream: ", end="", flush=True)
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "List three animals."}],
            temperature=0, max_tokens=32, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    two = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a name for a cat."}],
        temperature=1.0, max_tokens=12, n=2, seed=7)
    print("n=2:", [c.message.content for c in two.choices])


if __name__ == "__main__":
    main()
