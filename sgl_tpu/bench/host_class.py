"""A host class's speed measurements against llama-server, in one command: the comparisons of
docs/benchmarks.md ("Both sizes against llama-server") at the default model and at the
1.4B-class widened one, with the ratios the speed criteria name.

    python -m sgl_tpu.bench.host_class --llama-server path/to/llama-server [--out-dir DIR]
        [--sizes 135m,1.4b] [--runs single,c8_256,agent,cold2k,faithfulness] [--dry-run]
        [--resume]
    python -m sgl_tpu.bench.host_class --isa avx2|avx2-vnni|avx512|native
        [--llama-build-dir D] ...

Each run but `faithfulness` is one `python -m sgl_tpu.bench.agent_loop --compare ...` writing
DIR/<size>_<run>.json, all one after the other (leave the machine idle):

    single   one react agent, 4 turns of 128 tokens (1.4B: 2 turns): auto, none, llama -np 1
    c8_256   8 streams of 256 tokens on the shared 1.2k-token prompt: auto, none, llama -np 8
    agent    8 agents x 6 turns x 64 tokens on the shared prompt: auto, none, llama -np 8
    cold2k   one cold ~2k-token prompt, 16 tokens: auto, llama -np 1

and `faithfulness` is `python -m sgl_tpu.bench.faithfulness` (DIR/<size>_faithfulness.json):
perplexity and top-1 agreement with the float32 reference over one text, of our default path
and of llama-perplexity (the one beside llama-server) on the same GGUF and tokens.

`auto` is the server's defaults, `none` the same with `--speculative-algorithm none`. The
1.4B-class model is the default one widened 3x (`tools/widen_gguf.py --factor 3 --ffn-size
6912`), written to DIR once (or to --wide-gguf). On an AMX host (`amx_bf16` in /proc/cpuinfo)
llama-server gets `--no-repack`, without which its AMX weight repacking crashes it on the
first request.

`--isa` runs one instruction-set level on both sides: llama-server and llama-perplexity built
for it by tools/build_llama_server.sh (into --llama-build-dir, default $TMPDIR/llama-server-ISA,
built first when absent), and our servers under the caps of ISAS (the compiled kernels'
flavour, oneDNN's ISA). A level this CPU lacks is refused. `summary.json` `isa` records both
sides: our environment, the kernel flavours and oneDNN ISA the `auto` server reports it loaded
(`as_requested` false when they are not the level asked for), and llama.cpp's build switches.

DIR/summary.json then holds the host (CPU model, SIMD flags and memory read bandwidth on the
server's threads, before and after the runs: a one-stream decode step streams the weights, so
hosts of one CPU model differ by it), `/server_info` `compute` of the `auto` server at each
size, the bandwidth floor of a decode step per size (`floor`: the GGUF's bytes a step reads,
every tensor but a token embedding that has a separate output head, over the best bandwidth
measured), and per size and run:

    itl_p50_ms          {target: ITL p50}          single, c8_256, agent
    none_over_llama     ITL none / llama-server    (criterion: <= 0.7 at one stream)
    auto_over_none      ITL auto / none            (criterion: <= 1.05 everywhere)
    decode_tok_s        {target: 8 / ITL p50}      c8_256, the aggregate of 8 streams
    programs_per_s      {target: ...}              agent (criterion at 135M: auto >= 8x llama)
    ttft_s              {target: TTFT p50}         cold2k
    itl_over_floor      {target: ITL p50 / floor}  single (`auto`'s tokens include drafts)
    faithfulness        ours / reference / llama   perplexity, top1_agreement (kld_mean)

and beside it summary.md and summary.png, the host class's table and plot of every criterion
(`bench.host_class_report`, which also renders an existing summary).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sgl_tpu.bench import host_class_report
from sgl_tpu.bench.report import emit

WIDE_GGUF = "smollm2-w3.gguf"
RUNS = {  # name -> (workload, llama-server slots, targets beside llama-server)
    "single": ("react:num_programs=1,turns={turns},output_tokens=128", 1, ("auto", "none")),
    "c8_256": ("react:turns=1,output_tokens=256", 8, ("auto", "none")),
    "agent": ("react", 8, ("auto", "none")),
    "cold2k": ("private-react:num_programs=1,turns=1,output_tokens=16,system_tokens=2000", 1,
               ("auto",)),
}
RUN_NAMES = (*RUNS, "faithfulness")
SIZES = ("135m", "1.4b")
SIMD_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "amx_bf16", "amx_int8")
TOOLS = Path(__file__).resolve().parents[2] / "tools"
ISA_ENV = ("SGL_TPU_CPU_KERNELS", "ONEDNN_MAX_CPU_ISA")
# --isa -> (our servers' environment, the compiled-kernel flavour that should load, the CPU
# flags both sides need). avx512 caps oneDNN below AMX, as llama.cpp's avx512 build has no AMX;
# its compiled kernels are the native build (-march=native: AVX-512 on the CPUs this level
# runs on). native: no caps on either side.
ISAS = {
    "avx2": ({"SGL_TPU_CPU_KERNELS": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2", ("avx2",)),
    "avx2-vnni": ({"SGL_TPU_CPU_KERNELS": "avx2-vnni", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
                  "avx2-vnni", ("avx2", "avx_vnni")),
    "avx512": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "native",
               ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")),
    "native": ({}, "native", ()),
}


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


def isa_refusal(isa: str, flags: list[str]) -> str | None:
    """Why this CPU (its SIMD_FLAGS) cannot run `isa`, or None."""
    missing = [f for f in ISAS[isa][2] if f not in flags]
    if not missing:
        return None
    why = f"--isa {isa} needs {', '.join(missing)}, which this CPU lacks"
    if isa == "avx2-vnni" and "avx512_vnni" in flags:
        why += ("; its VNNI is AVX512-VNNI only (EVEX), and llama.cpp's GGML_AVX_VNNI build "
                "executes the VEX vpdpbusd of AVX-VNNI (_mm256_dpbusd_avx_epi32), which stops "
                "with SIGILL here. Use --isa avx512 (AVX512-VNNI) or --isa avx2")
    return why


def isa_env(isa: str | None, base: dict[str, str]) -> dict[str, str]:
    """The environment of our servers at `isa`: `base` less any ISA cap, plus the level's."""
    if isa is None:
        return dict(base)
    env = {k: v for k, v in base.items() if k not in ISA_ENV}
    env.update(ISAS[isa][0])
    return env


def loaded_isa(compute: dict[str, Any], expected_flavour: str | None) -> dict[str, Any]:
    """What a server's `/server_info` `compute` says it runs: compiled-kernel flavours, the
    quantized GEMM's vector code, oneDNN's ISA; `as_requested` whether every loaded kernel is
    `expected_flavour`."""
    cpu = compute.get("cpu", {})
    flavours = {k: v.get("flavour") for k, v in cpu.get("compiled_kernels", {}).items()}
    quant = compute.get("quantization") or {}
    onednn = cpu.get("onednn", {})
    out: dict[str, Any] = {"kernel_flavours": flavours, "quantized_simd": quant.get("simd"),
                           "quantized_vnni": quant.get("vnni"), "onednn_isa": onednn.get("isa"),
                           "onednn_max_cpu_isa": onednn.get("max_cpu_isa")}
    if expected_flavour is not None:
        loaded = [f for f in flavours.values() if f is not None]
        out["as_requested"] = bool(loaded) and all(f == expected_flavour for f in loaded)
    return out


def weight_bytes(gguf_path: str) -> int:
    """Bytes of a GGUF's weights one decode step reads: every tensor as stored, less the token
    embedding when a separate output head exists (a step reads one embedding row; a tied
    embedding is read whole by the head)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def floor_ratios(itl_ms: dict[str, float | None], floor_ms: float) -> dict[str, float | None]:
    """ITL p50 over the bandwidth floor of a step, per target."""
    return {t: None if v is None else round(v / floor_ms, 3) for t, v in itl_ms.items()}


def faithfulness_command(model_path: str | None, llama_perplexity: str | None, out: Path
                         ) -> list[str]:
    """The faithfulness run at one size (bench.faithfulness)."""
    cmd = [sys.executable, "-m", "sgl_tpu.bench.faithfulness", "--threads", "2",
           "--output", str(out)]
    if model_path is not None:
        cmd += ["--model-path", model_path]
    if llama_perplexity is not None:
        cmd += ["--llama-perplexity", llama_perplexity]
    return cmd


def summarize_faithfulness(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one faithfulness result (bench.faithfulness)."""
    keys = ("perplexity", "top1_agreement", "kld_mean", "positions", "dtype", "gemm",
            "kernel_flavours", "error")
    return {"ctx": result.get("ctx"), "positions": result.get("reference", {}).get("positions"),
            **{side: {k: v for k, v in result[side].items() if k in keys}
               for side in ("reference", "ours", "llama") if side in result}}


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


def llama_binaries(args: argparse.Namespace) -> tuple[str, str | None, Path | None,
                                                    list[str] | None]:
    """(llama-server, llama-perplexity or None, its build folder or None, the build command
    to run first or None) from --llama-server or --isa."""
    if args.llama_server:
        server = Path(args.llama_server)
        perplexity = server.with_name("llama-perplexity")
        return (str(server), str(perplexity) if perplexity.exists() else None,
                server.parent.parent, None)
    if args.isa is None:
        raise SystemExit("give --llama-server, or --isa to build llama-server for that level")
    build_dir = Path(args.llama_build_dir or Path(tempfile.gettempdir()) /
                     f"llama-server-{args.isa}")
    server, perplexity = build_dir / "bin" / "llama-server", build_dir / "bin" / "llama-perplexity"
    build = None
    if not (server.exists() and perplexity.exists()):
        build = ["bash", str(TOOLS / "build_llama_server.sh"), args.isa, str(build_dir)]
    return str(server), str(perplexity), build_dir, build


def _bandwidth() -> float:
    # (the torch backend's module, by name: this module imports no framework)
    return importlib.import_module("sgl_tpu.backends.torch.device").memory_read_gb_s()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary (llama-perplexity beside it runs faithfulness)")
    p.add_argument("--isa", choices=list(ISAS), default=None,
                   help="one instruction-set level on both sides (module doc)")
    p.add_argument("--llama-build-dir", default=None,
                   help="with --isa: llama.cpp's build for it (tools/build_llama_server.sh)")
    p.add_argument("--out-dir", default=None, help="default: host-class[-ISA]")
    p.add_argument("--wide-gguf", default=None,
                   help=f"the 1.4B-class model (default: OUT_DIR/{WIDE_GGUF}, made when absent)")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--runs", default=",".join(RUN_NAMES))
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs whose result is already in OUT_DIR (an interrupted run)")
    args = p.parse_args(argv)
    sizes, runs = args.sizes.split(","), args.runs.split(",")
    for bad in [s for s in sizes if s not in SIZES] + [r for r in runs if r not in RUN_NAMES]:
        raise SystemExit(f"unknown size or run {bad!r}; sizes: {', '.join(SIZES)}; "
                         f"runs: {', '.join(RUN_NAMES)}")
    host = cpu_info()
    if args.isa is not None and (why := isa_refusal(args.isa, host["flags"])):
        raise SystemExit(why)
    out_dir = Path(args.out_dir or ("host-class" + (f"-{args.isa}" if args.isa else "")))
    llama_server, llama_perplexity, build_dir, build = llama_binaries(args)
    amx = "amx_bf16" in host["flags"]
    wide = Path(args.wide_gguf) if args.wide_gguf else out_dir / WIDE_GGUF
    plan: list[tuple[str, str, list[str], Path]] = []
    if build is not None:
        plan.append(("", "build", build, Path(llama_server)))
    if "1.4b" in sizes and not wide.exists():
        plan.append(("1.4b", "widen", [sys.executable, str(TOOLS / "widen_gguf.py"), str(wide),
                                       "--factor", "3", "--ffn-size", "6912"], wide))
    for size in sizes:
        model = str(wide) if size == "1.4b" else None
        for run in runs:
            out = out_dir / f"{size}_{run}.json"
            cmd = (faithfulness_command(model, llama_perplexity, out) if run == "faithfulness"
                   else run_command(run, size, llama_server, model, out, amx))
            plan.append((size, run, cmd, out))
    env = isa_env(args.isa, dict(os.environ))
    if args.dry_run:
        if args.isa is not None:
            print("# our servers' environment: " + " ".join(
                f"{k}={env[k]}" for k in ISA_ENV if k in env))
        for _, _, cmd, _ in plan:
            print(shlex.join(cmd))
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    host["memory_read_gb_s"] = _bandwidth()
    host["memory_read_threads"] = importlib.import_module("torch").get_num_threads()
    summary: dict[str, Any] = {"host": host, "compute": {}, "floor": {}, "runs": {}}
    expected = ISAS[args.isa][1] if args.isa else None
    flags_file = None if build_dir is None else build_dir / "build_flags.txt"
    summary["isa"] = {"name": args.isa,
                      "ours": {"env": {k: env[k] for k in ISA_ENV if k in env},
                               "expected_flavour": expected, "loaded": {}},
                      "llama": {"binary": Path(llama_server).name}}
    for size, run, cmd, out in plan:
        if args.resume and run not in ("build", "widen") and out.exists():
            print(f"host_class: {size} {run}: kept {out}", file=sys.stderr)
            done = 0
        else:
            print(f"host_class: {size} {run}: {shlex.join(cmd)}", file=sys.stderr)
            done = subprocess.run(cmd, env=env).returncode
        if run in ("build", "widen"):
            if done:
                raise SystemExit(f"{run} failed ({done}): {shlex.join(cmd)}")
            continue
        if done or not out.exists():
            summary["runs"].setdefault(size, {})[run] = {"errors": {"command": f"exit {done}"}}
            continue
        result = json.loads(out.read_text())
        if run == "faithfulness":
            summary["runs"].setdefault(size, {})[run] = summarize_faithfulness(result)
            continue
        summary["runs"].setdefault(size, {})[run] = summarize_run(run, result)
        compute = result.get("server_compute", {}).get("auto")
        if compute and size not in summary["compute"]:
            summary["compute"][size] = compute
            summary["isa"]["ours"]["loaded"][size] = loaded_isa(compute, expected)
    if flags_file is not None and flags_file.exists():
        summary["isa"]["llama"]["build"] = flags_file.read_text().strip()
    host["memory_read_gb_s_after"] = _bandwidth()
    best = max(host["memory_read_gb_s"], host["memory_read_gb_s_after"])
    for size in sizes:
        model = str(wide) if size == "1.4b" else importlib.import_module(
            "sgl_tpu.loader.default_model").default_model_path()
        nbytes = weight_bytes(model)
        floor_ms = nbytes / (best * 1e9) * 1e3
        summary["floor"][size] = {"weight_bytes": nbytes, "memory_read_gb_s": best,
                                  "floor_ms": round(floor_ms, 3)}
        single = summary["runs"].get(size, {}).get("single", {})
        if "itl_p50_ms" in single:
            single["itl_over_floor"] = floor_ratios(single["itl_p50_ms"], floor_ms)
    emit(summary, str(out_dir / "summary.json"))
    (out_dir / "summary.md").write_text(host_class_report.markdown(summary) + "\n")
    host_class_report.plot(summary, str(out_dir / "summary.png"))


if __name__ == "__main__":
    main()
