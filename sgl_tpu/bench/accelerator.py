"""One command for an accelerator's table: the executor's prefill and decode steps, a profile of
one decode step, and servers with one and many streams, per backend, in one JSON.

    python -m sgl_tpu.bench.accelerator --model-path DIR --out-dir RESULTS
        [--backends jax,torch] [--dtype bfloat16] [--prefill 512,2048] [--batches 1,64]
        [--context 1024] [--sampling greedy,temperature,top-k,sampled] [--streams 1,32]
        [--output-tokens 64] [--rounds 2] [--client-procs 4]
        [--parts executor,servers,profile,host] [--server-flags "..."]
        [--timeout 600] [--budget SECONDS] [--summary FILE] [--tools-dir DIR]

Each part runs as its own process, so one backend's device memory is free before the next:

    executor  sgl_tpu.bench.executor    prefill tok/s, decode step ms (torch: the packing path
                                        and the CUDA-graph static step, greedy and sampled)
    profile   tools/jax_step_profile.py (jax: where the jitted step's time goes);
              tools/torch_profile.py (torch: the executor's decode steps with Python calls,
              host and device ms, kernel launches and top operators per step)
    servers   sgl_tpu.bench.serving --compare overlap
                                        two servers (overlap on / off) with 1 and N streams
    host      the same servers on a `tools/random_checkpoint.py --minimal` model of the same
              vocabulary (one layer of width 64, written to --out-dir/host_model): what the
              server costs around the model, i.e. the most the servers part can reach here

The parts run in the order --parts names them, each for every backend before the next part
(the table's first columns first). `--budget` bounds the whole run (an accelerator lent for a
few minutes): each part still to run gets an equal share of the seconds left, at least
MIN_PART_S and at most --timeout, and the parts that no longer fit are recorded as skipped.

The servers' streams are read by --client-procs processes (one Python reader parses ~25k
chunks/s, about the many-stream target; each row reports `client_busy_max`, near 1 when the
readers set the pace). The parts' JSONs land in --out-dir (`<part>_<backend>.json`, with each
one's stderr beside it on failure); the summary takes one row per backend and quantity from
them and also holds every part's whole JSON, status and seconds, so that one file carries the
run (`--summary`, default --out-dir/summary.json; rewritten after each part, so a run cut
short keeps what it has; printed at the end). A part that fails or runs past its timeout is
recorded as such, with the rows it printed before it stopped (a JSON marked `partial`), and
the rest still run; its processes (a part's servers too) are ended with it. Device memory:
JAX is told not to preallocate (XLA_PYTHON_CLIENT_PREALLOCATE=false), so the two servers of a
part can share one chip. Use a random-weight checkpoint of the model's shape
(`tools/random_checkpoint.py`) where the weights are not at hand.

The profilers and the random checkpoint are scripts of the repository's `tools/` folder, not of
the package: the profile and host parts run them from --tools-dir (default: the `tools/` beside
the checkout's `sgl_tpu/`; an offline bundle carries a copy, see `tools/offline_bundle.py`),
and are recorded as skipped where there is none.

    python -m sgl_tpu.bench.accelerator --lower tpu,cuda [--model-path X] [--model-config F]
        [--tp-size 1,4,8] --output FILE

lowers the JAX runner's jitted steps for those platforms on this host instead, without the
chips (`python -m sgl_tpu.bench.lowering`, run as its own process): collectives, custom calls
and host callbacks, shape buckets and bytes per chip, as one JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sgl_tpu.bench.report import emit, model_label
from sgl_tpu.bench.serving import OVERLAP_CONFIGS
from sgl_tpu.bench.serving import summarize as summarize_streams

PARTS = ("executor", "servers", "profile", "host")
HOST_MODEL = "host_model"  # in --out-dir: the `host` part's minimal model
# Under --budget, a part is not started with fewer seconds than this: no server or compiled
# step of this model starts in less, so the time would be spent for nothing.
MIN_PART_S = 30.0
GRACE_S = 15.0  # a part past its timeout: seconds from SIGTERM to SIGKILL of its processes
CHECKOUT_TOOLS = Path(__file__).resolve().parents[2] / "tools"  # in a checkout, not a wheel


def part_commands(args: argparse.Namespace, backend: str, out: Path) -> dict[str, list[str]]:
    """The command of each part for `backend`, writing its JSON to `out / <part>_<backend>`
    (the profile and host parts only where --tools-dir holds their scripts)."""
    py = [sys.executable, "-m"]
    model = ["--model-path", args.model_path] if args.model_path else []
    executor = ["--backends", backend, "--dtypes", args.dtype, "--decode-batches", args.batches,
                "--context", str(args.context)]
    if backend == "torch":
        executor += ["--torch-decode-paths", "packing,static"]
    flags = f"--backend {backend} --dtype {args.dtype} {args.server_flags}".strip()
    servers = ["--compare", "overlap", "--concurrency", *args.streams.split(","),
               "--rounds", str(args.rounds), "--output-tokens", str(args.output_tokens),
               "--client-procs", str(args.client_procs), "--server-flags", flags]
    cmds = {"executor": py + ["sgl_tpu.bench.executor", *model, *executor, "--prefill",
                              args.prefill, "--repeats", "3", "--sampling", args.sampling],
            "servers": py + ["sgl_tpu.bench.serving", *model, *servers]}
    tools = Path(args.tools_dir)
    if (tools / "random_checkpoint.py").exists():
        cmds["host"] = py + ["sgl_tpu.bench.serving", "--model-path", str(out / HOST_MODEL),
                             *servers]
    if backend == "jax" and (tools / "jax_step_profile.py").exists():
        cmds["profile"] = [sys.executable, str(tools / "jax_step_profile.py"), *model,
                           "--dtype", args.dtype, "--batches", args.batches,
                           "--context", str(args.context), "--steps", "10"]
    elif backend != "jax" and (tools / "torch_profile.py").exists():
        cmds["profile"] = [sys.executable, str(tools / "torch_profile.py"), *model, *executor,
                           "--prefill", "", "--repeats", "5", "--count-calls",
                           "--sampling", "greedy,temperature,top-k"]
    return {part: cmd + ["--output", str(out / f"{part}_{backend}.json")]
            for part, cmd in cmds.items() if part in args.parts.split(",")}


def write_host_model(args: argparse.Namespace, out: Path) -> None:
    """The host part's model: --model-path's shape, minimal, with random weights."""
    script = [sys.executable, str(Path(args.tools_dir) / "random_checkpoint.py")]
    model = ["--model-path", args.model_path] if args.model_path else []
    for cmd in (["shape", str(out / HOST_MODEL), "--minimal", *model],
                ["weights", str(out / HOST_MODEL)]):
        subprocess.run(script + cmd, check=True, stdout=subprocess.DEVNULL)


def part_timeout(cap: float, left_s: float | None, parts_left: int) -> float | None:
    """The timeout of the next part: `cap` (--timeout) without a budget; with one, an equal
    share of the `left_s` seconds over the `parts_left` parts still to run (this one included),
    raised to MIN_PART_S and cut to `cap` and to what is left once GRACE_S is kept back (a
    part past its timeout takes up to that long to end). None: too little left to start it."""
    if left_s is None:
        return cap
    usable = left_s - GRACE_S
    if usable < MIN_PART_S:
        return None
    return min(cap, usable, max(MIN_PART_S, left_s / parts_left))


def run_part(cmd: list[str], output: Path, timeout: float) -> dict[str, Any]:
    """Run one part in a process group of its own; -> its status, seconds and (when it wrote
    it) JSON. The group is ended when the part ends or passes `timeout`: a part killed
    mid-way would otherwise leave its servers running (holding the chip's memory and the
    host's cores) under the parts that follow."""
    t0 = time.perf_counter()
    stdout_path = output.with_suffix(".stdout.txt")
    with open(stdout_path, "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=timeout)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timeout after {timeout:.0f} s"
            _signal_group(proc.pid, signal.SIGTERM)  # servers stop their children on SIGTERM
            try:
                _, stderr = proc.communicate(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                _, stderr = proc.communicate()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever of the group outlived the part
    result: dict[str, Any] = {"status": status, "seconds": round(time.perf_counter() - t0, 1)}
    if status != "ok":
        output.with_suffix(".stderr.txt").write_text(stderr)
        result["stderr_tail"] = stderr[-2000:]
    try:
        result["json"] = json.loads(output.read_text())
    except (OSError, ValueError):  # not written: cut short, or failed mid-way
        if rows := _printed_rows(stdout_path):
            result["json"] = {"partial": True, "runs": rows}
    return result


def _printed_rows(path: Path) -> list[dict[str, Any]]:
    """The rows a part printed as it went, one JSON object a line (every bench this runs
    does), up to where it was stopped."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # the final indented JSON's lines, a line cut off by the kill
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is gone already
        pass


def summarize(backend: str, parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table's row of one backend: prefill tok/s by size, decode step ms by batch and
    path/sampling, server output tok/s by streams (overlap on and off) of the model and of the
    minimal model (the host's ceiling)."""
    row: dict[str, Any] = {"backend": backend}
    runs = parts.get("executor", {}).get("json", {}).get("runs", [])
    row["prefill_tok_per_s"] = {r["tokens"]: r["tok_per_s"] for r in runs
                                if r["phase"] == "prefill"}
    row["decode_step_ms"] = {
        f"b{r['batch']} {r.get('decode_path', 'packing')} {r.get('sampling', 'greedy')}":
        r["median_ms"] for r in runs if r["phase"] == "decode"}
    for part, key in (("servers", "server_output_tok_per_s"),
                      ("host", "host_ceiling_output_tok_per_s")):
        out = parts.get(part, {}).get("json", {})
        summary = out.get("summary") or summarize_streams(out.get("runs", []),
                                                          tuple(OVERLAP_CONFIGS))
        row[key] = {f"{c} streams": {"overlap": s.get("overlap_output_tok_per_s"),
                                     "serial": s.get("serial_output_tok_per_s"),
                                     "client_busy_max": s.get("client_busy_max")}
                    for c, s in summary.items()}
    row["status"] = {part: p["status"] for part, p in parts.items()}
    return row


LOWERING = "sgl_tpu.bench.lowering"  # its own process: JAX starts with its XLA_FLAGS


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--lower" or a.startswith("--lower=") for a in argv):
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        sys.exit(subprocess.call([sys.executable, "-m", LOWERING, *argv], env=env))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--backends", default="jax,torch")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefill", default="512,2048")
    p.add_argument("--batches", default="1,64", help="decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="KV tokens per decoding sequence")
    p.add_argument("--sampling", default="greedy,temperature,top-k,sampled",
                   help="the executor part's decode samplings (bench.executor --sampling)")
    p.add_argument("--streams", default="1,32", help="concurrent server streams")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--client-procs", type=int, default=4,
                   help="processes that read the servers' streams")
    p.add_argument("--server-flags", default="",
                   help="more flags for the servers (e.g. --skip-warmup: bench.serving warms "
                        "each server with every stream count's batch anyway)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="which parts, in the order they run")
    p.add_argument("--timeout", type=float, default=600, help="seconds per part at most")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run, shared among the parts (see above)")
    p.add_argument("--summary", default=None,
                   help="where the summary goes (default: --out-dir/summary.json)")
    p.add_argument("--tools-dir", default=str(CHECKOUT_TOOLS),
                   help="the folder of the profile part's scripts (tools/ of a checkout)")
    args = p.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from {PARTS}")
    t0 = time.monotonic()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = Path(args.summary) if args.summary else out / "summary.json"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    backends = args.backends.split(",")
    commands = {backend: part_commands(args, backend, out) for backend in backends}
    if any("host" in cmds for cmds in commands.values()):
        write_host_model(args, out)
    jobs = [(part, backend) for part in args.parts.split(",") for backend in backends]
    results: dict[str, Any] = {"model": model_label(args.model_path), "args": vars(args),
                               "backends": {}, "parts": {}}
    done: dict[str, dict[str, dict[str, Any]]] = {backend: {} for backend in backends}
    for i, (part, backend) in enumerate(jobs):
        left = None if args.budget is None else args.budget - (time.monotonic() - t0)
        timeout = part_timeout(args.timeout, left, len(jobs) - i)
        name = f"{part}_{backend}"
        if part not in commands[backend]:
            script = f"{backend} profiler" if part == "profile" else "random_checkpoint.py"
            result: dict[str, Any] = {"status": f"skipped: no {script} in "
                                                f"--tools-dir {args.tools_dir}", "seconds": 0}
        elif timeout is None:
            result = {"status": "skipped: the budget is spent", "seconds": 0}
        else:
            print(f"[{backend}] {part} (at most {timeout:.0f} s) ...", file=sys.stderr,
                  flush=True)
            result = run_part(commands[backend][part], out / f"{name}.json", timeout)
        done[backend][part] = results["parts"][name] = result
        # rewritten after every part: a run cut short keeps the rows it has
        results["backends"][backend] = summarize(backend, done[backend])
        results["seconds"] = round(time.monotonic() - t0, 1)
        summary.write_text(json.dumps(results, indent=2))
    emit({k: v for k, v in results.items() if k != "parts"}, None)


if __name__ == "__main__":
    main()
