"""What each `--quantization` (or `--kv-cache-dtype`) mode trades: greedy agreement with a
float32 reference and perplexity on a fixed text, on the torch backend.

    python tools/quant_quality.py [--model-path M] [--modes none:bfloat16,gguf:bfloat16,
        int8:bfloat16,int4:bfloat16] [--reference none:float32] [--max-new-tokens 64]

Each mode is `quantization:dtype[:kv_cache_dtype[:attention_backend]]` (e.g.
`auto:float32:bfloat16`, the default model's float32 serving with a bfloat16 KV cache;
`auto:float32:bfloat16:torch-cpu-fused-f32`, the same with float32 attention products).
Greedy agreement: for each reference prompt, the number of generated tokens identical to the
reference's before the first difference (the full length when none differs). Perplexity: exp of
the mean negative log-likelihood of `TEXT` (bench/faithfulness.py's), fed one token per step so
that every projection runs where decode runs it (for the quantized modes: the int kernel;
prefill-sized steps use the dense copy, see backends/torch/quant_linear.py). Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from sgl_tpu.bench import faithfulness
from sgl_tpu.bench.report import emit

PROMPTS = (
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three things an agent should check before calling a weather API:",
    '{"name": "get_weather", "arguments": {"city": "',
    "Explain in two sentences why the sky is blue.",
)

# the perplexity text, shared with bench.faithfulness (written for these benches)
TEXT = faithfulness.TEXT


def _mode(spec: str) -> tuple[str, str, str, str]:
    quant, _, rest = spec.partition(":")
    dtype, _, rest = rest.partition(":")
    kv, _, attention = rest.partition(":")
    return quant, dtype or "bfloat16", kv or "auto", attention or "auto"


def _engine(model_path: str | None, quant: str, dtype: str, kv_cache_dtype: str = "auto",
            attention_backend: str = "auto"):
    from sgl_tpu import Engine

    return Engine(model_path, backend="torch", quantization=quant, dtype=dtype,
                  kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend,
                  skip_warmup=True, max_total_tokens=4096, max_running_requests=4,
                  grammar_backend="none")


def _greedy(engine, max_new_tokens: int) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    return [engine.generate(p, params)["output_ids"] for p in PROMPTS]


def _perplexity(engine) -> tuple[float, int]:
    """Token-by-token NLL of TEXT through the runner (one row per step)."""
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    runner = engine.scheduler.runner
    ids = np.asarray(engine.tokenizer.encode(TEXT), np.int32)
    page_size = engine.server_args.page_size
    pages = np.arange(1, 1 + -(-len(ids) // page_size), dtype=np.int32)
    greedy = SamplingParams(temperature=0.0)
    nll = 0.0
    for pos in range(len(ids) - 1):
        step = SeqStep(token_ids=ids[pos : pos + 1], prefix_len=pos, pages=pages,
                       sampling=greedy, seed=0, num_output_tokens=0)
        result = runner.forward(ForwardMode.EXTEND, [step])
        chosen, _, _ = runner.token_logprobs(result.hidden, ids[pos + 1 : pos + 2])
        nll -= float(chosen[0])
    return math.exp(nll / (len(ids) - 1)), len(ids) - 1


def _effective(runner) -> str:
    """The method the torch runner applied ("auto" resolves there)."""
    report = getattr(runner, "quantization", None)
    return report.method if report is not None else runner.config.quantization.replace(
        "auto", "none")


def _agreement(ref: list[list[int]], out: list[list[int]]) -> list[int]:
    agree = []
    for a, b in zip(ref, out, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        agree.append(n)
    return agree


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    specs = [args.reference, *[m for m in args.modes.split(",") if m]]
    results: dict = {"model_path": args.model_path, "reference": args.reference,
                     "max_new_tokens": args.max_new_tokens, "prompts": list(PROMPTS),
                     "modes": {}}
    ref_tokens = None
    for spec in specs:
        quant, dtype, kv, attention = _mode(spec)
        t0 = time.perf_counter()
        engine = _engine(args.model_path, quant, dtype, kv, attention)
        tokens = _greedy(engine, args.max_new_tokens)
        ppl, n = _perplexity(engine)
        if ref_tokens is None:
            ref_tokens = tokens
        agree = _agreement(ref_tokens, tokens)
        compute = engine.scheduler.runner.compute_info()
        results["modes"][spec] = {
            "quantization": _effective(engine.scheduler.runner), "dtype": dtype,
            "kv_cache_dtype": engine.scheduler.runner.config.kv_dtype,
            "attention": {k: compute[k] for k in ("attention", "attention_products")
                          if k in compute},
            "perplexity": round(ppl, 4), "perplexity_tokens": n,
            "greedy_agree_tokens": agree, "greedy_identical_prompts": sum(
                a == args.max_new_tokens for a in agree),
            "seconds": round(time.perf_counter() - t0, 1)}
        print(spec, results["modes"][spec], flush=True)
        del engine
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--modes", default="none:bfloat16,gguf:bfloat16,int8:bfloat16,int4:bfloat16")
    p.add_argument("--reference", default="none:float32")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
