"""Inter-token latency of 8 concurrent streams over 4 LoRA adapters against 8 of the base model,
on a running server (docs/lora.md).

    python tools/lora_itl.py adapters DIR        # DIR/a0..a3: PEFT adapters (rank 8, q_proj and
                                                 # v_proj, PEFT's default targets) shaped for the
                                                 # default model, random non-zero weights
    python -m sgl_tpu.launch_server --port 30000 --lora-paths a0=DIR/a0 a1=DIR/a1 a2=DIR/a2 \\
        a3=DIR/a3
    python tools/lora_itl.py measure --url http://127.0.0.1:30000 --rounds 8

`measure` alternates rounds of 8 streamed /generate requests (greedy, 64 tokens, distinct
prompts): all on the base model, then a0 a1 a2 a3 a0 a1 a2 a3 (one batch mixing the four).
Per round it takes the median gap between streamed chunks (after each stream's first 8), and
the scheduler process's CPU time per decode step (its /proc stat over the round divided by the
tokens of one stream: the step cost, which other load on the machine disturbs far less than
wall-clock gaps; Linux, server on this host). It prints each configuration's best round (the
least disturbed), the median round, and the ratios. Needs `peft` for `adapters`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import requests

# SmolLM2-135M-Instruct's projections (the default model)
DEFAULT_MODEL_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, vocab_size=64)


def make_adapters(folder: str, count: int = 4, rank: int = 8) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    for i in range(count):
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**DEFAULT_MODEL_SHAPE))
        peft_model = get_peft_model(model, LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
            init_lora_weights=False))
        peft_model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        peft_model.save_pretrained(f"{folder}/a{i}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(url: str, names: list[str], max_new_tokens: int) -> float:
    """Median inter-token gap (ms) of concurrent streams, one per entry of `names`."""
    gaps_all: list[float] = []
    lock = threading.Lock()

    def run(i: int, name: str) -> None:
        body = {"text": f"Write a long story about robot number {i} who learns to paint.",
                "stream": True, "sampling_params": {
                    "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        if name != "base":
            body["lora_path"] = name
        last, gaps = None, []
        with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
        with lock:
            gaps_all.extend(gaps[8:])

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1000 * statistics.median(gaps_all)


def measure(url: str, rounds: int, max_new_tokens: int) -> dict:
    configs = {"base": ["base"] * 8, "4 adapters": [f"a{i % 4}" for i in range(8)]}
    pid = requests.get(url + "/server_info", timeout=30).json()["scheduler_pid"]
    itl: dict[str, list[float]] = {k: [] for k in configs}
    cpu: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(rounds):
        for key, names in configs.items():
            start = cpu_s(pid)
            itl[key].append(one_round(url, names, max_new_tokens))
            cpu[key].append(1000 * (cpu_s(pid) - start) / max_new_tokens)
    out: dict = {}
    for key in configs:
        out[key] = {"best_round_itl_ms": round(min(itl[key]), 1),
                    "median_round_itl_ms": round(statistics.median(itl[key]), 1),
                    "median_cpu_ms_per_step": round(statistics.median(cpu[key]), 1)}
    for stat in out["base"]:
        out[f"ratio_{stat}"] = round(out["4 adapters"][stat] / out["base"][stat], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("adapters", help="write 4 PEFT adapters for the default model")
    make.add_argument("folder")
    run = sub.add_parser("measure", help="ITL of 8 streams: base vs 4 adapters")
    run.add_argument("--url", default="http://127.0.0.1:30000")
    run.add_argument("--rounds", type=int, default=8)
    run.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.command == "adapters":
        make_adapters(args.folder)
    else:
        print(json.dumps(measure(args.url, args.rounds, args.max_new_tokens)))


if __name__ == "__main__":
    main()
