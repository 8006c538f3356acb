"""Attention kernel micro-benchmark: the jax.numpy reference vs the Pallas ragged paged kernel.

    python -m sgl_tpu.bench.kernel [--dtype auto] [--decode-batches 1,8,32] [--context 1024]
                                   [--prefill 512,2048] [--kv-heads 3 --group 3 --head-dim 64]
                                   [--page-size 16 --kv-tile 256 --block-q 128] [--repeats 5]

Runs one DECODE step (a batch of sequences of `--context` tokens) and one EXTEND step (a fresh
prompt) per size, on whatever JAX backend is present, and prints JSON: seconds per call (best
of `--repeats` after a compile run), query tokens/s, achieved FLOP/s and bytes/s.

    flops = 4 * H * d * sum(keys each query attends)            (QK^T and PV, 2 per MAC)
    bytes = K and V of every attended key once + q + out       (the minimum traffic)

On a TPU the kernel is compiled by Mosaic and timed. Elsewhere it can only run in TPU interpret
mode (a CPU simulation, orders of magnitude slower): it runs once on the smallest size, for a
max-abs-diff check against the reference, and is reported with "timed": false.
Compare as ratios within one run: the machines are shared.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import numpy as np

from sgl_tpu.bench.report import emit
from sgl_tpu.bench.timing import best


def _case(args, mode, seqs, rng, dtype):
    """seqs: (prefix_len, new_len) -> (fn(impl, interpret) -> out, attended keys, kv tokens)."""
    import jax.numpy as jnp

    from sgl_tpu.executor.jax.forward_batch import ShapeBuckets, build_forward_batch
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.kernels import paged_attention_ref as ref
    from sgl_tpu.kernels import ragged_paged_attention as rpa
    from sgl_tpu.sampling_params import SamplingParams

    ps, kv_tile, kvh, d = args.page_size, args.kv_tile, args.kv_heads, args.head_dim
    pages_per_seq = -(-max(p + n for p, n in seqs) // kv_tile) * (kv_tile // ps)
    num_pages = 1 + len(seqs) * pages_per_seq
    steps = []
    for i, (prefix, new) in enumerate(seqs):
        pages = 1 + i * pages_per_seq + np.arange(pages_per_seq)
        steps.append(SeqStep(token_ids=[1] * new, prefix_len=prefix, pages=pages,
                             sampling=SamplingParams(temperature=0.0), seed=0,
                             num_output_tokens=0))
    num_tokens = sum(n for _, n in seqs)
    shape = ShapeBuckets(token_buckets=(num_tokens,), seq_buckets=(len(seqs),),
                         max_extend_seqs=len(seqs), max_pages=pages_per_seq,
                         block_q=args.block_q, vocab_words=1,
                         pages_per_tile=kv_tile // ps).shape_for(mode, steps)
    fb = build_forward_batch(steps, shape, ps)
    pool_shape = (kvh, num_pages, ps, d)
    k_pool = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    v_pool = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    q = jnp.asarray(rng.standard_normal((num_tokens, kvh * args.group, d)), dtype)
    kw = {"kv_tile": kv_tile, "scale": d**-0.5}
    if mode == ForwardMode.DECODE:
        call_args = (q, k_pool, v_pool, fb.page_table, fb.seq_lens)
        impls = {"ref": ref.decode_attention, "pallas": rpa.decode_attention}
    else:
        call_args = (q, k_pool, v_pool, fb.page_table, fb.block_rows, fb.block_seq,
                     fb.block_q_start, fb.seq_lens, fb.item_block, fb.item_tile, fb.num_items)
        impls = {"ref": ref.extend_attention, "pallas": rpa.extend_attention}

    def run(impl: str, interpret=None):
        if impl == "ref":
            return impls["ref"](*call_args, **kw)
        return impls["pallas"](*call_args, interpret=interpret, **kw)

    attended = sum(p + (n * (n + 1)) // 2 if n > 1 else p + 1 for p, n in seqs)
    kv_tokens = sum(p + n for p, n in seqs)
    return run, attended, kv_tokens, num_tokens


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    from sgl_tpu.executor.step import ForwardMode

    backend = jax.default_backend()
    dtype_name = args.dtype if args.dtype != "auto" else (
        "float32" if backend == "cpu" else "bfloat16")
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name]
    itemsize = jnp.dtype(dtype).itemsize
    heads, d = args.kv_heads * args.group, args.head_dim
    rng = np.random.default_rng(0)
    on_tpu = backend == "tpu"
    results: dict = {
        "backend": backend, "device": str(jax.devices()[0].device_kind), "dtype": dtype_name,
        "cpu_count": os.cpu_count(), "kv_heads": args.kv_heads, "group": args.group,
        "head_dim": d, "page_size": args.page_size, "kv_tile": args.kv_tile,
        "block_q": args.block_q,
        "kernel_timed": on_tpu,
        "note": None if on_tpu else "no TPU: the Pallas kernel runs only in TPU interpret "
                                    "mode here (checked once for equality, not timed)",
        "runs": [],
    }
    cases = [("decode", ForwardMode.DECODE, [(args.context - 1, 1)] * b)
             for b in _ints(args.decode_batches)]
    cases += [("prefill", ForwardMode.EXTEND, [(0, n)]) for n in _ints(args.prefill)]
    checked = False
    for phase, mode, seqs in cases:
        fn, attended, kv_tokens, num_tokens = _case(args, mode, seqs, rng, dtype)
        flops = 4 * heads * d * attended
        nbytes = (2 * kv_tokens * args.kv_heads + 2 * num_tokens * heads) * d * itemsize
        impls = ["ref", "pallas"] if on_tpu else ["ref"]
        for impl in impls:
            t = best(jax.jit(partial(fn, impl)), args.repeats, sync=jax.block_until_ready)
            row = {"phase": phase, "impl": impl, "seqs": len(seqs), "query_tokens": num_tokens,
                   "kv_tokens": kv_tokens, "seconds": round(t, 6),
                   "tok_per_s": round(num_tokens / t, 1),
                   "tflop_per_s": round(flops / t / 1e12, 4),
                   "gbyte_per_s": round(nbytes / t / 1e9, 2)}
            results["runs"].append(row)
        if on_tpu:
            ref_t, ker_t = results["runs"][-2]["seconds"], results["runs"][-1]["seconds"]
            results["runs"][-1]["speedup_vs_ref"] = round(ref_t / ker_t, 2)
        if not checked and args.interpret_check:
            interpret = None if on_tpu else "tpu"
            diff = np.abs(np.asarray(fn("pallas", interpret), np.float32)
                          - np.asarray(fn("ref"), np.float32)).max()
            results["runs"].append({"phase": phase, "impl": "pallas", "seqs": len(seqs),
                                    "query_tokens": num_tokens, "timed": on_tpu,
                                    "mode": "compiled" if on_tpu else "tpu-interpret",
                                    "max_abs_diff_vs_ref": float(diff)})
            checked = True
    return results


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--decode-batches", default="1,8,32")
    p.add_argument("--context", type=int, default=1024, help="KV length of decode sequences")
    p.add_argument("--prefill", default="512,2048", help="fresh prompt lengths")
    p.add_argument("--kv-heads", type=int, default=3)  # SmolLM2-135M: 3 KV heads, group 3, d 64
    p.add_argument("--group", type=int, default=3, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-tile", type=int, default=256)
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-interpret-check", dest="interpret_check", action="store_false",
                   help="skip the one kernel-vs-reference equality run")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
