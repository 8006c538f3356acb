"""A host class's speed measurements against llama-server, in one command: the comparisons of
docs/benchmarks.md ("Both sizes against llama-server") at the default model and at the
1.4B-class widened one, with the ratios the speed criteria name.

    python -m sgl_tpu.bench.host_class --llama-server path/to/llama-server [--out-dir DIR]
        [--sizes 135m,1.4b] [--runs single,c8_256,agent,cold2k] [--dry-run]

Each run is one `python -m sgl_tpu.bench.agent_loop --compare ...` writing DIR/<size>_<run>.json,
all one after the other (leave the machine idle):

    single   one react agent, 4 turns of 128 tokens (1.4B: 2 turns): auto, none, llama -np 1
    c8_256   8 streams of 256 tokens on the shared 1.2k-token prompt: auto, none, llama -np 8
    agent    8 agents x 6 turns x 64 tokens on the shared prompt: auto, none, llama -np 8
    cold2k   one cold ~2k-token prompt, 16 tokens: auto, llama -np 1

`auto` is the server's defaults, `none` the same with `--speculative-algorithm none`. The
1.4B-class model is the default one widened 3x (`tools/widen_gguf.py --factor 3 --ffn-size
6912`), written to DIR once. On an AMX host (`amx_bf16` in /proc/cpuinfo) llama-server gets
`--no-repack`, without which its AMX weight repacking crashes it on the first request.

DIR/summary.json then holds the host (CPU model, SIMD flags and memory read bandwidth: a
one-stream decode step streams the weights, so hosts of one CPU model differ by it),
`/server_info` `compute` of
the `auto` server at each size, and per size and run:

    itl_p50_ms          {target: ITL p50}          single, c8_256, agent
    none_over_llama     ITL none / llama-server    (criterion: <= 0.7 at one stream)
    auto_over_none      ITL auto / none            (criterion: <= 1.05 everywhere)
    decode_tok_s        {target: 8 / ITL p50}      c8_256, the aggregate of 8 streams
    programs_per_s      {target: ...}              agent (criterion at 135M: auto >= 8x llama)
    ttft_s              {target: TTFT p50}         cold2k
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from sgl_tpu.bench.report import emit

WIDE_GGUF = "smollm2-w3.gguf"
RUNS = {  # name -> (workload, llama-server slots, targets beside llama-server)
    "single": ("react:num_programs=1,turns={turns},output_tokens=128", 1, ("auto", "none")),
    "c8_256": ("react:turns=1,output_tokens=256", 8, ("auto", "none")),
    "agent": ("react", 8, ("auto", "none")),
    "cold2k": ("private-react:num_programs=1,turns=1,output_tokens=16,system_tokens=2000", 1,
               ("auto",)),
}
SIZES = ("135m", "1.4b")
SIMD_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
              "amx_int8")


def cpu_info(path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The first CPU's model name and which of SIMD_FLAGS it has."""
    model, flags = "", set()
    try:
        text = Path(path).read_text()
    except OSError:
        return {"model": "unknown", "flags": []}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "flags": [f for f in SIMD_FLAGS if f in flags]}


def run_command(run: str, size: str, llama_server: str, model_path: str | None, out: Path,
                amx: bool) -> list[str]:
    """The agent-loop command of one run at one size."""
    workload, slots, targets = RUNS[run]
    workload = workload.format(turns=2 if size == "1.4b" else 4)
    context = 8192 if slots == 1 else 32768
    peer_args = f"-c {context} -np {slots}" + (" --no-repack" if amx else "")
    # the 1.4B model's KV pool: its 9 KV heads of 64 take 3x the default model's bytes a token
    pool = " --max-total-tokens 16384" if size == "1.4b" else ""
    compare = [f"auto=launch:{pool.strip()}"]
    if "none" in targets:
        compare.append(f"none=launch:{pool.strip()} --speculative-algorithm none")
    compare.append(f"llama-server=llama-server:{llama_server},args:{peer_args},api:openai-chat")
    cmd = [sys.executable, "-m", "sgl_tpu.bench.agent_loop", "--api", "openai-chat",
           "--no-progress", "--warmup-programs", "1", "--workloads", workload,
           "--compare", *compare, "--output", str(out), "--log-dir", str(out.parent)]
    if model_path is not None:
        cmd[3:3] = ["--model-path", model_path]
    return cmd


def summarize_run(run: str, result: dict[str, Any]) -> dict[str, Any]:
    """The ratios of one run's agent-loop JSON (module doc)."""
    rows = {target: next(iter(per.values())) for target, per in result["runs"].items() if per}

    def p50(target: str, key: str) -> float | None:
        row = rows.get(target)
        return None if row is None else row[key]["p50"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out: dict[str, Any] = {"errors": result.get("target_errors", {})}
    if run == "cold2k":
        out["ttft_s"] = {t: p50(t, "ttft_s") for t in rows}
        out["auto_over_llama"] = ratio(p50("auto", "ttft_s"), p50("llama-server", "ttft_s"))
        return out
    itl = {t: None if p50(t, "itl_s") is None else p50(t, "itl_s") * 1e3 for t in rows}
    out["itl_p50_ms"] = itl
    out["none_over_llama"] = ratio(itl.get("none"), itl.get("llama-server"))
    out["auto_over_llama"] = ratio(itl.get("auto"), itl.get("llama-server"))
    out["auto_over_none"] = ratio(itl.get("auto"), itl.get("none"))
    if run == "c8_256":
        out["decode_tok_s"] = {t: 8e3 / v if v else None for t, v in itl.items()}
    if run == "agent":
        out["programs_per_s"] = {t: rows[t]["programs_per_s"] for t in rows}
        out["auto_over_llama_programs"] = ratio(out["programs_per_s"].get("auto"),
                                                out["programs_per_s"].get("llama-server"))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="llama-server binary (peers' build)")
    p.add_argument("--out-dir", default="host-class")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    sizes, runs = args.sizes.split(","), args.runs.split(",")
    for bad in [s for s in sizes if s not in SIZES] + [r for r in runs if r not in RUNS]:
        raise SystemExit(f"unknown size or run {bad!r}; sizes: {', '.join(SIZES)}; "
                         f"runs: {', '.join(RUNS)}")
    out_dir = Path(args.out_dir)
    host = cpu_info()
    amx = "amx_bf16" in host["flags"]
    wide = out_dir / WIDE_GGUF
    plan: list[tuple[str, str, list[str], Path]] = []
    if "1.4b" in sizes and not wide.exists():
        tool = Path(__file__).resolve().parents[2] / "tools" / "widen_gguf.py"
        plan.append(("1.4b", "widen", [sys.executable, str(tool), str(wide), "--factor", "3",
                                       "--ffn-size", "6912"], wide))
    for size in sizes:
        model = str(wide) if size == "1.4b" else None
        for run in runs:
            out = out_dir / f"{size}_{run}.json"
            plan.append((size, run, run_command(run, size, args.llama_server, model, out, amx),
                         out))
    if args.dry_run:
        for _, _, cmd, _ in plan:
            print(shlex.join(cmd))
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    # (the torch backend's module, by name: this module imports no framework)
    host["memory_read_gb_s"] = importlib.import_module(
        "sgl_tpu.backends.torch.device").memory_read_gb_s()
    summary: dict[str, Any] = {"host": host, "compute": {}, "runs": {}}
    for size, run, cmd, out in plan:
        print(f"host_class: {size} {run}: {shlex.join(cmd)}", file=sys.stderr)
        done = subprocess.run(cmd).returncode
        if run == "widen":
            if done:
                raise SystemExit(f"widening the default model failed ({done})")
            continue
        if done or not out.exists():
            summary["runs"].setdefault(size, {})[run] = {"errors": {"command": f"exit {done}"}}
            continue
        result = json.loads(out.read_text())
        summary["runs"].setdefault(size, {})[run] = summarize_run(run, result)
        compute = result.get("server_compute", {}).get("auto")
        if compute and size not in summary["compute"]:
            summary["compute"][size] = compute
    emit(summary, str(out_dir / "summary.json"))


if __name__ == "__main__":
    main()
