"""What each `--quantization` (or `--kv-cache-dtype`) mode trades: greedy agreement with a
float32 reference and perplexity on a fixed text, on the torch backend.

    python tools/quant_quality.py [--model-path M] [--modes none:bfloat16,gguf:bfloat16,
        int8:bfloat16,int4:bfloat16] [--reference none:float32] [--max-new-tokens 64]
        [--perplexity-steps extend|decode|extend,decode]

Each mode is `quantization:dtype[:kv_cache_dtype[:attention_backend]]` (e.g.
`auto:float32:bfloat16`, the default model's float32 serving with a bfloat16 KV cache;
`auto:float32:bfloat16:torch-cpu-fused-f32`, the same with float32 attention products).
Greedy agreement: for each reference prompt, the number of generated tokens identical to the
reference's before the first difference (the full length when none differs). Perplexity: exp of
the mean negative log-likelihood of `TEXT` (bench/faithfulness.py's), fed one token per step so
that every projection runs where decode runs it (for the quantized modes: the int kernel;
prefill-sized steps use the dense copy, see backends/torch/quant_linear.py). The steps are
extend steps of one row (`perplexity`; their attention is the extend kernel's) and, with
`--perplexity-steps decode` or `extend,decode`, decode steps (`decode_perplexity`: decode's
attention kernels, e.g. an int8 KV cache's 16-bit P @ V). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from sgl_tpu.bench import faithfulness
from sgl_tpu.bench.report import emit, model_label

PROMPTS = (
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three things an agent should check before calling a weather API:",
    '{"name": "get_weather", "arguments": {"city": "',
    "Explain in two sentences why the sky is blue.",
)

# the perplexity text, shared with bench.faithfulness (written for these benches)
TEXT = faithfulness.TEXT
PERPLEXITY_STEPS = ("extend", "decode", "extend,decode")


def _mode(spec: str) -> tuple[str, str, str, str]:
    quant, _, rest = spec.partition(":")
    dtype, _, rest = rest.partition(":")
    kv, _, attention = rest.partition(":")
    return quant, dtype or "bfloat16", kv or "auto", attention or "auto"


def _greedy(engine, max_new_tokens: int) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    return [engine.generate(p, params)["output_ids"] for p in PROMPTS]


def _perplexity(engine, steps: str) -> tuple[float, int]:
    """Exp of the mean NLL of TEXT's tokens, each scored by the step that feeds the token before
    it (bench/faithfulness.py's `token_steps`: "extend" or "decode" steps of one row)."""
    ids = np.asarray(engine.tokenizer.encode(TEXT), np.int32)
    nll = -sum(float(result.logprobs[0])
               for result in faithfulness.token_steps(engine, ids, steps))
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
    specs = [args.reference, *[m for m in args.modes.split(",") if m]]
    results: dict = {"model_path": model_label(args.model_path), "reference": args.reference,
                     "max_new_tokens": args.max_new_tokens, "prompts": list(PROMPTS),
                     "perplexity_steps": args.perplexity_steps, "threads": args.threads,
                     "modes": {}}
    ref_tokens = None
    for spec in specs:
        quant, dtype, kv, attention = _mode(spec)
        t0 = time.perf_counter()
        engine = faithfulness.make_engine(args.model_path, quant, dtype, args.threads, kv,
                                          attention)
        tokens = _greedy(engine, args.max_new_tokens)
        perplexity = {}
        for steps in args.perplexity_steps.split(","):
            ppl, n = _perplexity(engine, steps)
            key = "perplexity" if steps == "extend" else f"{steps}_perplexity"
            perplexity[key] = round(ppl, 4)
        if ref_tokens is None:
            ref_tokens = tokens
        agree = _agreement(ref_tokens, tokens)
        compute = engine.scheduler.runner.compute_info()
        results["modes"][spec] = {
            "quantization": _effective(engine.scheduler.runner), "dtype": dtype,
            "kv_cache_dtype": engine.scheduler.runner.config.kv_dtype,
            "attention": {k: compute[k] for k in ("attention", "attention_products")
                          if k in compute},
            **perplexity, "perplexity_tokens": n,
            "greedy_agree_tokens": agree, "greedy_identical_prompts": sum(
                a == args.max_new_tokens for a in agree),
            "seconds": round(time.perf_counter() - t0, 1)}
        print(spec, results["modes"][spec], flush=True)
        del engine
    return results


def main(argv: list[str] | None = None) -> None:
    p = faithfulness.parser(__doc__.splitlines()[0])
    p.add_argument("--modes", default="none:bfloat16,gguf:bfloat16,int8:bfloat16,int4:bfloat16")
    p.add_argument("--reference", default="none:float32")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--perplexity-steps", default="extend", choices=PERPLEXITY_STEPS,
                   help="the steps that score the text: extend and/or decode steps of one row")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
