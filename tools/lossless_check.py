"""Whether speculative drafts change greedy output, on the default path of the host that runs
it (in process, the server's scheduler and runner; `ONEDNN_MAX_CPU_ISA` and
`SGL_TPU_CPU_KERNELS` in the environment select a lower ISA's path).

    python tools/lossless_check.py [--model-path M] [--prompts 50] [--repeats 4]
        [--max-new-tokens 48] [--output FILE]
    python tools/lossless_check.py --base-url http://127.0.0.1:30000 [--repeats 4]

Two checks, one JSON object (with `--base-url`, only the first, over HTTP against a running
server with the `openai` client: each of `HTTP_CHATS` sent `--repeats` times):

    repeats   one greedy chat sent `--repeats` times one after the other to an engine with
              speculation as the server runs it (`auto`: the draft gate decides) and to one
              without (`none`): the number of distinct answers of each (1 = reproducible)
    drafts    `--prompts` greedy chats (the questions below over a shared system prompt, or
              alone) decoded with drafts forced (every n-gram match drafted) and without, one
              engine: how many outputs differ, the draft tokens verified and kept
"""

from __future__ import annotations

import argparse
import itertools

from sgl_tpu.bench.report import emit

SYSTEM = ("You are a travel agent's assistant. Tools: search_flights(origin, destination, "
          "date), book_hotel(city, nights), get_weather(city). Answer briefly. " * 12)
TOPICS = ("the moon", "a red bicycle", "Paris", "prime numbers", "a rainy day", "coffee",
          "the ocean", "a robot", "winter", "a library")
FORMS = ("Tell a short story about {}.", "Count from one to five, then name {}.",
         "Repeat three times: I like {}.", "List five facts about {}.",
         "Write a Python function named after {}.")
CHAT = "Count from one to five."
HTTP_CHATS = ((CHAT, 24), ("Tell a story.", 32))  # (message, max_tokens)


def prompts(tokenizer, n: int) -> list[str]:
    """n chat prompts: every question form over every topic, alternately with the shared
    system prompt (whose decode steps read a shared prefix) and without."""
    questions = [f.format(t) for t, f in itertools.product(TOPICS, FORMS)]
    out = []
    for i, q in enumerate(itertools.islice(itertools.cycle(questions), n)):
        system = [{"role": "system", "content": SYSTEM}] if i % 2 else []
        out.append(tokenizer.apply_chat_template(system + [{"role": "user", "content": q}]))
    return out


def repeats(model_path: str | None, algorithm: str, n: int, max_new: int) -> int:
    from sgl_tpu import Engine

    eng = Engine(model_path, speculative_algorithm=algorithm)
    try:
        text = eng.tokenizer.apply_chat_template([{"role": "user", "content": CHAT}])
        params = {"temperature": 0, "max_new_tokens": max_new}
        return len({tuple(eng.generate(text, params)["output_ids"]) for _ in range(n)})
    finally:
        eng.shutdown()


def drafts(model_path: str | None, n: int, max_new: int) -> dict:
    from sgl_tpu import Engine

    eng = Engine(model_path, speculative_algorithm="SUFFIX")
    try:
        sched = eng.scheduler
        spec = sched.speculator
        spec.row_cost = spec.row_cost_slope = 0.0
        spec.step_costs = spec.gate = None
        texts = prompts(eng.tokenizer, n)
        params = {"temperature": 0, "max_new_tokens": max_new}

        def run(on: bool) -> list[list[int]]:
            sched.speculator = spec if on else None
            outs = []
            for text in texts:
                eng.flush_cache()
                outs.append(eng.generate(text, params)["output_ids"])
            return outs

        plain = run(False)
        drafted, kept = sched.stats.spec_draft_tokens, sched.stats.spec_accepted_tokens
        spec_outs = run(True)
        return {"prompts": n, "differ": sum(a != b for a, b in zip(plain, spec_outs,
                                                                     strict=True)),
                "draft_tokens": sched.stats.spec_draft_tokens - drafted,
                "kept_tokens": sched.stats.spec_accepted_tokens - kept,
                "tokens": sum(map(len, plain))}
    finally:
        eng.shutdown()


def http_repeats(base_url: str, n: int) -> dict[str, int]:
    import openai

    client = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused")
    out = {}
    for text, max_tokens in HTTP_CHATS:
        answers = {client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens, temperature=0).choices[0].message.content for _ in range(n)}
        out[text] = len(answers)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the shipped model")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("--base-url", default=None, help="a running server: the HTTP repeats only")
    args = p.parse_args()
    if args.base_url:
        emit({"distinct_answers_http": http_repeats(args.base_url, args.repeats)}, args.output)
        return
    from sgl_tpu.backends.torch.kernels import quant_gemm_cpu

    result = {"simd": quant_gemm_cpu.simd(), "vnni": quant_gemm_cpu.vnni(),
              "tile_dot": quant_gemm_cpu.tile_dot(),
              "distinct_answers": {alg: repeats(args.model_path, alg, args.repeats,
                                                args.max_new_tokens)
                                   for alg in ("auto", "none")},
              "drafts": drafts(args.model_path, args.prompts, args.max_new_tokens)}
    emit(result, args.output)


if __name__ == "__main__":
    main()
