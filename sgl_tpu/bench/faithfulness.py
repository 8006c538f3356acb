"""Faithfulness as a benchmark axis: perplexity and top-1 agreement with the float32 reference,
over the same tokens, for this server's default path and for llama.cpp (`llama-perplexity`) on
the same GGUF.

    python -m sgl_tpu.bench.faithfulness [--model-path M.gguf] [--llama-perplexity BIN]
        [--text-file FILE] [--ctx 128] [--chunks N] [--threads 2] [--output OUT.json]

The tokens: `TEXT` (or `--text-file`'s text) through the model's tokenizer, cut into chunks of
`--ctx` tokens (the chunk's first token replaced by BOS where the GGUF adds one), scored as
llama-perplexity scores them: each chunk from an empty cache, the positions from ctx/2 on
predicting the next token (the first half is context only), so ctx/2 - 1 positions per chunk.

Our side runs the model twice in this process: the reference (`--quantization none --dtype
float32`: the GGUF's weights dequantized to float32), each chunk in one step, and the default
path (the server's defaults: `auto` quantization and dtype, what `/server_info` `compute`
reports), one token per step (every projection where decode runs it, as
tools/quant_quality.py does). The
reference's logits are written in llama-perplexity's `--kl-divergence-base` format (the
header, the tokens, then per scored position the log-probabilities in 16 bits over their top
16 nats), and `llama-perplexity -m M --kl-divergence-base FILE --kl-divergence` evaluates the
GGUF on exactly those tokens against exactly that reference. Both sides' top-1 agreement is
taken against the argmax of that 16-bit encoding (first index on ties, as llama-perplexity
takes it), so both compare with one reference:

    ours.perplexity / reference.perplexity   exp(mean NLL) over the scored positions
    ours.top1_agreement                      fraction of positions whose argmax equals the
                                             reference's
    ours.kld_mean                            mean KL divergence from the reference's float32
                                             log-probabilities (not their 16-bit encoding)
    llama.perplexity, llama.top1_agreement   llama-perplexity's "Mean PPL(Q)", "Same top p"
    llama.kld_mean                           its "Mean KLD" against the reference
"""

from __future__ import annotations

import argparse
import math
import re
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sgl_tpu.bench.report import emit

TEXT = (
    "A language model reads text as a sequence of tokens and predicts, one step at a time, "
    "which token comes next. To serve such a model quickly, an inference server keeps the "
    "keys and values of every token it has already processed, so that the next step only "
    "computes the newest position. Agents send the same long instructions again and again: "
    "the description of their tools, the rules they must follow and the conversation so far. "
    "A cache of prompt prefixes lets the server skip that repeated work and answer sooner. "
    "When the model is small, most of the time of a decoding step goes to reading its weights "
    "from memory, because each weight is used only once per token. Storing the weights in "
    "four bits instead of sixteen reduces that traffic, and the step becomes faster as long as "
    "the arithmetic stays cheap. With many requests in one batch the balance changes: the "
    "weights are read once for all of them, the arithmetic grows with the batch, and the "
    "plain sixteen-bit path wins again. A careful server therefore picks the representation "
    "for each step by the number of rows it has to compute, and it measures where the two "
    "paths cross instead of guessing. Quality matters as much as speed. A quantized model "
    "should produce the same answers as the original for most prompts, and its perplexity on "
    "ordinary text should stay close to the reference, so that users know what they trade."
)
REFERENCE = ("none", "float32")  # (quantization, dtype) of the float32 reference


def chunks(ids: list[int], ctx: int, bos: int | None, limit: int | None = None
           ) -> list[list[int]]:
    """The evaluated chunks of `ctx` tokens (llama-perplexity's: whole chunks only, at most
    `limit`), each chunk's first token replaced by `bos` when the model adds one."""
    if ctx < 4 or len(ids) < 2 * ctx:
        raise ValueError(f"the text is {len(ids)} tokens: --ctx {ctx} needs at least "
                         f"{2 * ctx} and ctx >= 4")
    out = [list(ids[i * ctx:(i + 1) * ctx]) for i in range(len(ids) // ctx)][:limit]
    if bos is not None:
        for c in out:
            c[0] = bos
    return out


def encode_base(logits: np.ndarray) -> np.ndarray:
    """llama-perplexity's 16-bit log-probabilities of rows of logits [T, V] (its saved-logits
    format): per row two float32 (scale, min log-prob) as four uint16, then V uint16 codes of
    the logits over the top 16 nats, padded to an even count."""
    logits = logits.astype(np.float32)
    t, v = logits.shape
    nv = 2 * ((v + 1) // 2) + 4
    out = np.zeros((t, nv), np.uint16)
    mx = logits.max(axis=1)
    mn = np.maximum(logits.min(axis=1), mx - 16)
    lse = np.log(np.exp(logits - mx[:, None]).sum(axis=1, dtype=np.float64)).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    head = np.stack([scale, (mn - mx - lse).astype(np.float32)], axis=1)
    out[:, :4] = head.view(np.uint16).reshape(t, 4)
    inv = np.where(scale > 0, 1 / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    codes = np.rint(inv[:, None] * (logits - mn[:, None]))
    out[:, 4:4 + v] = np.where(logits > mn[:, None], codes, 0).astype(np.uint16)
    return out


def base_argmax(encoded: np.ndarray, n_vocab: int) -> np.ndarray:
    """The argmax of each encoded row (first index on ties): the reference's top-1."""
    return encoded[:, 4:4 + n_vocab].argmax(axis=1)


def write_base(path: Path, ctx: int, n_vocab: int, token_chunks: list[list[int]],
               encoded: np.ndarray) -> None:
    """A `--kl-divergence-base` file: "_logits_", n_ctx, n_vocab, n_chunk (int32), the
    chunks' tokens (int32) and the encoded rows (ctx/2 - 1 per chunk, in order)."""
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(struct.pack("<iii", ctx, n_vocab, len(token_chunks)))
        f.write(np.asarray(token_chunks, np.int32).tobytes())
        f.write(encoded.tobytes())


def token_steps(engine, ids: np.ndarray, mode: str = "extend") -> Iterator[Any]:
    """Run `ids[:-1]` through the runner one token per step from an empty cache (its own
    pages), each step's sampled token forced to the next id (a mask that allows only it), and
    yield each step's StepResult: its log-prob is the next id's under the raw logits. `mode`:
    "extend" (every projection where decode runs it; the result keeps its hidden states) or
    "decode" (decode's attention kernels too, as a served request's steps after its prefill)."""
    from sgl_tpu.executor.step import ForwardMode, SeqStep, mask_words
    from sgl_tpu.sampling_params import SamplingParams

    runner = engine.scheduler.runner
    forward_mode = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE}[mode]
    page_size = engine.server_args.page_size
    pages = np.arange(1, 1 + -(-len(ids) // page_size), dtype=np.int32)
    greedy = SamplingParams(temperature=0.0)
    mask = np.zeros(mask_words(runner.vocab_size), np.uint32)
    for pos in range(len(ids) - 1):
        target = int(ids[pos + 1])
        mask[:] = 0
        mask[target // 32] = 1 << (target % 32)
        step = SeqStep(token_ids=ids[pos:pos + 1], prefix_len=pos, pages=pages,
                       sampling=greedy, seed=0, num_output_tokens=pos,
                       bitmask=mask.view(np.int32).copy())
        result = runner.forward(forward_mode, [step])
        if int(result.token_ids[0]) != target:
            raise RuntimeError(f"step {pos} sampled {result.token_ids[0]}, not {target}")
        yield result


def scored_logits(engine, token_chunks: list[list[int]], per_token: bool) -> np.ndarray:
    """Logits [chunks * (ctx/2 - 1), V] at the scored positions, each chunk from an empty cache
    (its own pages): one token per step (`per_token`: where decode runs each projection) or
    the chunk in one step."""
    from sgl_tpu.executor.step import ForwardMode, SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    runner = engine.scheduler.runner
    page_size = engine.server_args.page_size
    rows = []
    for chunk in token_chunks:
        ids = np.asarray(chunk, np.int32)
        ctx, first = len(ids), len(ids) // 2
        if per_token:
            rows += [runner.row_logits(result.hidden, np.zeros(1, np.int64))
                     for pos, result in enumerate(token_steps(engine, ids)) if pos >= first]
            continue
        pages = np.arange(1, 1 + -(-ctx // page_size), dtype=np.int32)
        step = SeqStep(token_ids=ids, prefix_len=0, pages=pages,
                       sampling=SamplingParams(temperature=0.0), seed=0, num_output_tokens=0)
        result = runner.forward(ForwardMode.EXTEND, [step])
        rows.append(runner.row_logits(result.hidden, np.arange(first, ctx - 1)))
    return np.concatenate(rows).astype(np.float32)


def targets_of(token_chunks: list[list[int]]) -> np.ndarray:
    """The next token at each scored position."""
    return np.concatenate([np.asarray(c[len(c) // 2 + 1:], np.int64) for c in token_chunks])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    mx = x.max(axis=1, keepdims=True)
    return x - mx - np.log(np.exp(x - mx).sum(axis=1, keepdims=True))


def score(logits: np.ndarray, targets: np.ndarray, ref_top1: np.ndarray,
          ref_logits: np.ndarray | None = None) -> dict[str, Any]:
    """Perplexity over the scored positions, top-1 agreement with `ref_top1` and, given the
    reference's logits, the mean KL divergence from them."""
    lp = log_softmax(logits)
    nll = -lp[np.arange(len(lp)), targets]
    out = {"perplexity": round(math.exp(float(nll.mean())), 4),
           "top1_agreement": round(float((lp.argmax(axis=1) == ref_top1).mean()), 4),
           "positions": len(lp)}
    if ref_logits is not None:
        ref = log_softmax(ref_logits)
        out["kld_mean"] = round(float((np.exp(ref) * (ref - lp)).sum(axis=1).mean()), 6)
    return out


def make_engine(model_path: str | None, quantization: str, dtype: str, threads: int,
                kv_cache_dtype: str = "auto", attention_backend: str = "auto"):
    """An in-process engine on the torch backend whose runner these benches step directly."""
    from sgl_tpu import Engine

    return Engine(model_path, backend="torch", quantization=quantization, dtype=dtype,
                  kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend,
                  torch_threads=threads, skip_warmup=True, max_total_tokens=4096,
                  max_running_requests=4, grammar_backend="none")


def _add_bos(model_path: str) -> int | None:
    """The BOS id llama.cpp puts first in each chunk, or None when the GGUF adds none (or the
    checkpoint is no GGUF: then only our side runs)."""
    if not model_path.endswith(".gguf"):
        return None
    import gguf

    fields = gguf.GGUFReader(model_path).fields

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    return value("tokenizer.ggml.bos_token_id") if value("tokenizer.ggml.add_bos_token") else None


LLAMA_LINES = {"perplexity": r"Mean PPL\(Q\)\s*:\s*([\d.]+)",
               "reference_perplexity": r"Mean PPL\(base\)\s*:\s*([\d.]+)",
               "kld_mean": r"Mean\s+KLD:\s*([\d.]+)",
               "top1_agreement": r"Same top p:\s*([\d.]+)"}


def parse_llama(text: str) -> dict[str, Any]:
    """The figures of llama-perplexity's --kl-divergence report (top-1 as a fraction)."""
    out: dict[str, Any] = {}
    for key, pattern in LLAMA_LINES.items():
        m = re.search(pattern, text)
        out[key] = None if m is None else float(m.group(1))
    if out["top1_agreement"] is not None:
        out["top1_agreement"] = round(out["top1_agreement"] / 100, 4)
    return out


def llama_side(binary: str, model_path: str, base: Path, ctx: int, threads: int
               ) -> dict[str, Any]:
    cmd = [binary, "-m", model_path, "--kl-divergence-base", str(base), "--kl-divergence",
           "-c", str(ctx), "-b", str(ctx), "-t", str(threads), "-tb", str(threads)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    text = done.stdout + done.stderr
    out = {"command": " ".join([Path(binary).name, "-m", Path(model_path).name, cmd[3], "BASE",
                                *cmd[5:]]),
           **parse_llama(text), "seconds": round(time.perf_counter() - t0, 1)}
    if done.returncode or out["top1_agreement"] is None:
        out["error"] = f"exit {done.returncode}: " + text[-600:]
    elif "inconsistent vocabulary" in text:
        out["error"] = "llama-perplexity: inconsistent vocabulary"
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from sgl_tpu.loader.default_model import default_model_path

    model_path = args.model_path or default_model_path()
    text = TEXT if args.text_file is None else Path(args.text_file).read_text()
    result: dict[str, Any] = {"model_path": Path(model_path).name, "ctx": args.ctx,
                              "threads": args.threads,
                              "text": "built-in" if args.text_file is None else args.text_file,
                              "text_chars": len(text)}
    t0 = time.perf_counter()
    engine = make_engine(model_path, *REFERENCE, args.threads)
    ids = engine.tokenizer.encode(text)
    token_chunks = chunks(ids, args.ctx, _add_bos(model_path), args.chunks)
    targets = targets_of(token_chunks)
    ref_logits = scored_logits(engine, token_chunks, per_token=False)
    del engine
    n_vocab = ref_logits.shape[1]
    encoded = encode_base(ref_logits)
    ref_top1 = base_argmax(encoded, n_vocab)
    result.update(text_tokens=len(ids), chunks=len(token_chunks), n_vocab=n_vocab)
    result["reference"] = {"quantization": REFERENCE[0], "dtype": REFERENCE[1],
                           **score(ref_logits, targets, ref_top1),
                           "seconds": round(time.perf_counter() - t0, 1)}
    t0 = time.perf_counter()
    engine = make_engine(model_path, "auto", "auto", args.threads)
    logits = scored_logits(engine, token_chunks, per_token=True)
    compute = engine.scheduler.runner.compute_info()
    del engine
    kernels = compute.get("cpu", {}).get("compiled_kernels", {})
    result["ours"] = {"dtype": compute["dtype"], "gemm": compute["gemm"],
                      "quantization": compute.get("quantization"),
                      "kernel_flavours": {k: v.get("flavour") for k, v in kernels.items()},
                      **score(logits, targets, ref_top1, ref_logits),
                      "seconds": round(time.perf_counter() - t0, 1)}
    if args.llama_perplexity:
        with tempfile.TemporaryDirectory() as tmp:
            base = Path(tmp) / "f32_base.kld"
            write_base(base, args.ctx, n_vocab, token_chunks, encoded)
            result["llama"] = llama_side(args.llama_perplexity, model_path, base, args.ctx,
                                         args.threads)
    return result


def parser(description: str, model_help: str = "default: the default model"
           ) -> argparse.ArgumentParser:
    """The arguments of every bench that steps an in-process engine's runner."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model-path", default=None, help=model_help)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--output", default=None, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.split("\n\n")[0], "a GGUF (default: the default model)")
    p.add_argument("--llama-perplexity", default=None,
                   help="llama.cpp's llama-perplexity binary (none: our side only)")
    p.add_argument("--text-file", default=None,
                   help="score this file's text instead of the built-in 273-token one")
    p.add_argument("--ctx", type=int, default=128, help="tokens per chunk (llama's -c)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
