"""A multi-turn chat in SGLang's frontend language: `sgl.system/user/assistant` rendered with
the model's own chat template (ChatML for the default model), against a running sgl-tpu server.

    python -m sgl_tpu.launch_server &            # or: make serve
    python examples/dsl_multi_turn_chat.py [--url http://127.0.0.1:30000] [--stream]

The frontend picks the template from `/get_model_info` (pass `--chat-template NAME` to override,
as `sgl.RuntimeEndpoint(url, chat_template_name=NAME)` does). Every turn resends the whole
conversation; the radix cache serves all earlier turns (`cached_tokens` grows turn by turn).
`--stream` prints the last answer as it is generated, through `text_iter`.
"""

from __future__ import annotations

import argparse

from _frontend import sgl  # examples/_frontend.py

TURNS = (
    "Hi! I am planning a weekend trip to Lisbon. What should I see first?",
    "Which neighbourhood is best for an evening walk?",
    "Give me one tip for getting around the city.",
)


@sgl.function
def chat(s, turns: tuple[str, ...]):
    s += sgl.system("You are a friendly travel assistant. Keep answers to two sentences.")
    for i, question in enumerate(turns):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=64))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--chat-template", default=None, help="override the frontend's choice")
    p.add_argument("--stream", action="store_true")
    args = p.parse_args()
    backend = sgl.RuntimeEndpoint(args.url, chat_template_name=args.chat_template)
    sgl.set_default_backend(backend)
    print(f"chat template: {backend.chat_template.name}\n")

    st = chat.run(turns=TURNS, temperature=0.3, frequency_penalty=0.5, stream=args.stream)
    last = f"answer_{len(TURNS) - 1}"
    for i, question in enumerate(TURNS):
        print(f"user: {question}")
        if args.stream and i == len(TURNS) - 1:
            print("assistant: ", end="", flush=True)
            for chunk in st.text_iter(last):
                print(chunk, end="", flush=True)
            print()
        else:
            print(f"assistant: {st[f'answer_{i}'].strip()}")
        meta = st.get_meta_info(f"answer_{i}")
        print(f"    (cached {meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens)\n")
    if st.error() is not None:
        raise SystemExit(f"program failed: {st.error()}")


if __name__ == "__main__":
    main()
