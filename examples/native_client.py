"""Talk to a running sgl-tpu server through SGLang's native `/generate` API with `requests`.

    python -m sgl_tpu.launch_server &            # or: make serve
    python examples/native_client.py [--url http://127.0.0.1:30000]

Shows a plain generation, a batch that shares a long system prompt (the second request reports
`cached_tokens` from the radix cache), and streaming with cumulative text.
"""

from __future__ import annotations

import argparse
import json

import requests

SYSTEM = ("<|im_start|>system\nYou are a helpful assistant with tools: search(query), "
          "calculator(expression), weather(city). Answer briefly.<|im_end|>\n")


def chat_prompt(question: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:30000")
    url = p.parse_args().url

    r = requests.post(f"{url}/generate", json={
        "text": chat_prompt("What is the capital of France?"),
        "sampling_params": {"temperature": 0, "max_new_tokens": 32}}).json()
    print("answer:", r["text"], "| meta:", r["meta_info"])

    batch = requests.post(f"{url}/generate", json={
        "text": [chat_prompt(q) for q in ("Name a fruit.", "Name a color.")],
        "sampling_params": {"temperature": 0, "max_new_tokens": 16}}).json()
    for item in batch:
        print("batch:", item["text"], "| cached_tokens:", item["meta_info"]["cached_tokens"])

    print("stream: ", end="", flush=True)
    shown = 0
    with requests.post(f"{url}/generate", stream=True, json={
            "text": chat_prompt("Count from 1 to 5."), "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32}}) as resp:
        for line in resp.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            text = json.loads(line[5:])["text"]  # cumulative
            print(text[shown:], end="", flush=True)
            shown = len(text)
    print()


if __name__ == "__main__":
    main()
