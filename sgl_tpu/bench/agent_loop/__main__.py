"""Agent-loop benchmark: agentic workloads against one or several servers, in one invocation.

    python -m sgl_tpu.bench.agent_loop --launch ""                       # sgl-tpu, started here
    python -m sgl_tpu.bench.agent_loop --base-url http://127.0.0.1:30000 --api native
    python -m sgl_tpu.bench.agent_loop --workloads react tree-of-thought:turns=2 \\
        --compare "sgl-tpu=launch:" "sgl-tpu-nocache=launch:--disable-radix-cache" \\
                  "llamacpp=llamacpp:../peer-venv/bin/python" \\
        --output results.json            # also writes results.png

For each target (targets.py has the spec syntax) and each workload (workloads.py): start the
server if the target launches one, warm it up with the workload at another seed (at most 2
turns, so compiled batch shapes are ready), flush its cache, run the workload (runner.py),
summarize (metrics.py). Prints a table on stderr and the
result JSON (report.emit); `--compare` with `--output` also writes a PNG next to it.

Each run also reports `oracle` (oracle.py): the prompt tokens the server reported as cached
against those an unbounded cache would have reused over the same requests, and their ratio.

`--mixed-batch N` runs each workload in three phases instead (mixed.py): its agents alone, then
beside N long completions without priorities, then with them (the JSON's `mixed` section):

    python -m sgl_tpu.bench.agent_loop --launch "--enable-priority-scheduling" --mixed-batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from sgl_tpu.bench.agent_loop.agent_trace import TraceConfig
from sgl_tpu.bench.agent_loop.client import Client
from sgl_tpu.bench.agent_loop.drivers import DRIVERS, OUTPUT_MODES, DriverOptions
from sgl_tpu.bench.agent_loop.metrics import summarize
from sgl_tpu.bench.agent_loop.mixed import (
    PHASES,
    batch_programs,
    mixed_ratios,
    phase_priorities,
    preemptions,
    runs_rows,
)
from sgl_tpu.bench.agent_loop.oracle import oracle_report
from sgl_tpu.bench.agent_loop.runner import ProgramRunner, RunOptions
from sgl_tpu.bench.agent_loop.table import format_table
from sgl_tpu.bench.agent_loop.targets import PEERS, RunningTarget, TargetSpec, parse_target
from sgl_tpu.bench.agent_loop.trace import Trace
from sgl_tpu.bench.agent_loop.workloads import (
    WORKLOADS,
    Program,
    WorkloadConfig,
    describe,
    make_workload,
)
from sgl_tpu.bench.report import emit

WARMUP_SEED_OFFSET = 1000
WARMUP_MAX_TURNS = 2


def parse_workload(item: str, base: WorkloadConfig) -> tuple[str, WorkloadConfig]:
    """`name[:key=value,...]` -> (name, config with those fields replaced); the agent-trace
    generator's fields (TraceConfig) too."""
    name, _, overrides = item.partition(":")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    fields = {f.name for f in dataclasses.fields(WorkloadConfig)} - {"trace"}
    trace_fields = {f.name for f in dataclasses.fields(TraceConfig)}
    changes: dict[str, int] = {}
    trace_changes: dict[str, str] = {}
    for kv in filter(None, overrides.split(",")):
        key, eq, value = kv.partition("=")
        key = key.strip().replace("-", "_")
        if eq and key in fields:
            changes[key] = int(value)
        elif eq and key in trace_fields:
            trace_changes[key] = value
        else:
            raise ValueError(f"workload {name}: bad override {kv!r}; fields: "
                             f"{sorted(fields | trace_fields)}")
    cfg = dataclasses.replace(base, **changes)
    return name, dataclasses.replace(cfg, trace=cfg.trace.with_overrides(trace_changes))


def parse_latency(text: str) -> tuple[float, float]:
    """`S` or `LO:HI` -> (lo, hi) seconds."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = (float(lo), float(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected S or LO:HI seconds, got {text!r}") from None
    if not 0 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO <= HI, got {text!r}")
    return bounds


def sweep(workloads: list[tuple[str, WorkloadConfig]], counts: list[int] | None
          ) -> list[tuple[str, str, WorkloadConfig]]:
    """(label, workload name, config) per run: one per workload, or with `--sweep-agents` one
    per workload and agent count, labelled `name@N`; a count given again runs again, labelled
    `name@N#2`, `name@N#3`, ... (repeats of a short, noisy point)."""
    if not counts:
        return [(name, name, cfg) for name, cfg in workloads]
    if min(counts) < 1:
        raise SystemExit("--sweep-agents counts must be >= 1")
    runs = []
    for name, cfg in workloads:
        seen: dict[int, int] = {}
        for n in counts:
            seen[n] = seen.get(n, 0) + 1
            label = f"{name}@{n}" + (f"#{seen[n]}" if seen[n] > 1 else "")
            runs.append((label, name, dataclasses.replace(cfg, num_programs=n)))
    return runs


def warmup_config(cfg: WorkloadConfig, num_programs: int | None) -> WorkloadConfig | None:
    """The warm-up run's sizes: the same concurrency (batch shapes), fewer turns."""
    if num_programs == 0:
        return None
    return dataclasses.replace(cfg, num_programs=num_programs or cfg.num_programs,
                               turns=min(cfg.turns, WARMUP_MAX_TURNS),
                               trace=cfg.trace.for_warmup(WARMUP_MAX_TURNS))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgl_tpu.bench.agent_loop",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("targets (one of)")
    t.add_argument("--compare", nargs="+", metavar="SPEC",
                   help='targets as NAME=KIND:VALUE[,KEY:VALUE...], e.g. "sgl-tpu=launch:"')
    t.add_argument("--base-url", help="one running server")
    t.add_argument("--launch", metavar="FLAGS", help="start sgl-tpu with these flags")
    t.add_argument("--llamacpp-python", metavar="PYTHON",
                   help="start the llama.cpp peer with this interpreter")
    p.add_argument("--api", choices=list(DRIVERS), default=None,
                   help="API for --base-url/--launch/--llamacpp-python targets")
    p.add_argument("--json-dialect", choices=["openai", "llamacpp"], default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--model-path", default=None,
                   help="model for launched servers and the tokenizer (default: default model)")
    p.add_argument("--chat-template", default=None,
                   help="as the server's flag, for a base model: renders the prompts of "
                        "--api native/openai-completions and is passed to launched servers")
    w = p.add_argument_group("workloads")
    w.add_argument("--workloads", nargs="+", default=["react"], metavar="NAME[:k=v,...]",
                   help=f"from {', '.join(WORKLOADS)}; overrides per workload, "
                        "e.g. tree-of-thought:turns=2,branches=3")
    defaults = WorkloadConfig()
    w.add_argument("--num-programs", type=int, default=defaults.num_programs,
                   help="agents / users / trees / shared-prefix requests")
    w.add_argument("--turns", type=int, default=defaults.turns,
                   help="agent turns, chat turns, or tree depth")
    w.add_argument("--output-tokens", type=int, default=defaults.output_tokens)
    w.add_argument("--system-tokens", type=int, default=defaults.system_tokens)
    w.add_argument("--observation-tokens", type=int, default=defaults.observation_tokens)
    w.add_argument("--branches", type=int, default=defaults.branches)
    w.add_argument("--groups", type=int, default=defaults.groups)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--sweep-agents", type=int, nargs="+", default=None, metavar="N",
                   help="run each workload once per agent count (its runs are named "
                        "WORKLOAD@N; a count given again runs again as WORKLOAD@N#2, ...), "
                        "e.g. 8 8 8 16 32 64: throughput and program completion time as "
                        "agents outnumber the KV pool")
    r = p.add_argument_group("running")
    r.add_argument("--concurrency", type=int, default=0, help="programs in flight; 0: all")
    r.add_argument("--request-rate", type=float, default=float("inf"),
                   help="program arrivals per second (Poisson); default inf: all at once")
    r.add_argument("--output-mode", choices=OUTPUT_MODES, default="fixed",
                   help="fixed: exactly max tokens per unconstrained request (comparable "
                        "work); natural: stop strings and EOS end answers")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--session-hint", action="store_true",
                   help="send each program's session_id (agent-aware cache retention)")
    r.add_argument("--tool-latency", type=parse_latency, default=(0.0, 0.0), metavar="S|LO:HI",
                   help="seconds an agent waits between its turns (its tool call): fixed, or "
                        "uniform in [LO, HI] drawn per call from --seed; default 0")
    r.add_argument("--warmup-programs", type=int, default=None,
                   help="programs of another seed, at most 2 turns each, run (not measured) "
                        "before each workload, so compilation for its batch shapes is done; "
                        "default: as many as the workload has; 0: none")
    r.add_argument("--oracle-page-size", type=int, default=0,
                   help="granularity of the reuse oracle in tokens (oracle.py); default: the "
                        "server's page_size (/server_info), else 1")
    r.add_argument("--no-progress", action="store_true")
    m = p.add_argument_group("mixed traffic (priority scheduling)")
    m.add_argument("--mixed-batch", type=int, default=0, metavar="N",
                   help="run each workload's agents alone, then beside N long completions "
                        "sent at once, without and with priorities (0: off)")
    m.add_argument("--batch-prompt-tokens", type=int, default=256,
                   help="prompt of each batch completion (its own text)")
    m.add_argument("--batch-output-tokens", type=int, default=512,
                   help="tokens each batch completion generates")
    m.add_argument("--interactive-priority", type=int, default=100,
                   help="the agents' priority in the with-priority phase")
    m.add_argument("--batch-priority", type=int, default=0,
                   help="the batch's priority in the with-priority phase")
    o = p.add_argument_group("output")
    o.add_argument("--output", help="result JSON file")
    o.add_argument("--plot", help="PNG path (default with --compare: the --output path, .png)")
    o.add_argument("--save-traces", action="store_true",
                   help="write every request's record to <output>.traces.json")
    o.add_argument("--log-dir", default=tempfile.gettempdir(), help="launched servers' logs")
    return p


def single_target(args: argparse.Namespace) -> TargetSpec:
    given = [x for x in (args.base_url, args.launch, args.llamacpp_python) if x is not None]
    if len(given) != 1:
        raise SystemExit("give one of --compare, --base-url, --launch, --llamacpp-python")
    if args.base_url is not None:
        spec = f"server=url:{args.base_url}"
    elif args.launch is not None:
        spec = f"sgl-tpu=launch:{args.launch}"
    else:
        spec = f"llamacpp=llamacpp:{args.llamacpp_python}"
    target = parse_target(spec)
    return dataclasses.replace(target, api=args.api or target.api,
                               json_dialect=args.json_dialect or target.json_dialect)


def run_options(args: argparse.Namespace, priority: int | None = None,
                context_tokens: int = 0) -> RunOptions:
    return RunOptions(args.concurrency, args.request_rate, args.seed, args.session_hint,
                      not args.no_progress, args.tool_latency, priority, context_tokens)


Group = tuple[list[Program], RunOptions, str]  # programs, how to run them, progress label


async def run_groups(url: str, spec: TargetSpec, groups: list[Group], tokenizer: Any,
                     args: argparse.Namespace) -> list[Trace]:
    """Run the groups of programs at once, each as its own ProgramRunner; a trace each."""
    opts = DriverOptions(args.output_mode, args.temperature, spec.json_dialect, spec.model)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    def render(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    # The llama.cpp servers close a connection idle for a few seconds (cpp-httplib's
    # keep-alive), which races a pooled connection's reuse ("Can not write request body"):
    # a new connection per request for them.
    connector = aiohttp.TCPConnector(limit=0, force_close=spec.kind in PEERS)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        client = Client(session, url, DRIVERS[spec.api], opts, count_tokens,
                        api_key=args.api_key)
        return list(await asyncio.gather(*(
            ProgramRunner(client.send, render, run_opts, desc, count_tokens).run(programs)
            for programs, run_opts, desc in groups)))


async def run_workload(url: str, spec: TargetSpec, programs: list[Program], tokenizer: Any,
                       args: argparse.Namespace, desc: str, context_tokens: int = 0) -> Trace:
    (trace,) = await run_groups(
        url, spec, [(programs, run_options(args, context_tokens=context_tokens), desc)],
        tokenizer, args)
    return trace


def oracle_page_size(args: argparse.Namespace, info: dict[str, Any] | None) -> int:
    """The oracle's granularity: the flag, else the server's radix page, else one token."""
    return args.oracle_page_size or int((info or {}).get("page_size") or 1)


def run_mixed(target: RunningTarget, spec: TargetSpec, programs: list[Program], tokenizer: Any,
              args: argparse.Namespace, desc: str) -> dict[str, Any]:
    """`--mixed-batch`: the agents alone, then beside the batch without and with priorities
    (mixed.py), each phase after a cache flush."""
    batch = batch_programs(args.mixed_batch, args.batch_prompt_tokens, args.batch_output_tokens,
                           args.seed)
    quiet = RunOptions(seed=args.seed, progress=False)  # the batch: all at once
    phases: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        agents, batch_priority = phase_priorities(phase, args.interactive_priority,
                                                  args.batch_priority)
        groups = [(programs, run_options(args, agents), f"{desc} {phase}")]
        if phase != "alone":
            groups.append((batch, dataclasses.replace(quiet, priority=batch_priority), ""))
        target.flush_cache()
        before = preemptions(target.server_info())
        traces = asyncio.run(run_groups(target.base_url, spec, groups, tokenizer, args))
        after = preemptions(target.server_info())
        phases[phase] = {"interactive": summarize(traces[0])}
        if phase != "alone":
            phases[phase]["batch"] = summarize(traces[1])
            phases[phase]["priority_preemptions"] = (
                None if before is None or after is None else after - before)
    return {**phases, "ratios": mixed_ratios(phases)}


def server_side(info: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, Any]:
    """What the server reports after a run: its pool, how oversubscribed the run kept it
    (the programs' final trajectories over the pool), and its KV tiers' counters."""
    if info is None:
        return {}
    pool = info.get("memory", {}).get("max_total_tokens")
    out: dict[str, Any] = {"pool_tokens": pool}
    if pool:
        out["oversubscription"] = summary["trajectory_tokens"] / pool
    if "tiers" in info:
        out["tiers"] = info["tiers"]
    return out


SPEC_COUNTERS = ("num_decode_steps", "spec_verify_reqs", "spec_draft_tokens",
                 "spec_accepted_tokens")


def spec_counters(before: dict[str, Any] | None, after: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """The run's decode steps and speculative counters: sgl-tpu's `/server_info` `stats`
    after the run minus before (acceptance rate = spec_accepted_tokens / spec_draft_tokens)."""
    b, a = (before or {}).get("stats") or {}, (after or {}).get("stats") or {}
    deltas = {k: a[k] - b[k] for k in SPEC_COUNTERS if k in a and k in b}
    return {"server_stats": deltas} if deltas else {}


PROGRAM_COUNTERS = ("num_programs_held", "program_held_s", "num_programs_seen")


def program_counters(before: dict[str, Any] | None, after: dict[str, Any] | None
                     ) -> dict[str, Any]:
    """The run's program-level admission counters (`/server_info` `programs`, after minus
    before): how many programs admission control held, for how long in all."""
    b, a = (before or {}).get("programs") or {}, (after or {}).get("programs") or {}
    deltas = {k: a[k] - b[k] for k in PROGRAM_COUNTERS if k in a and k in b}
    kv_b, kv_a = b.get("kv") or {}, a.get("kv") or {}
    kv = {k: kv_a[k] - kv_b.get(k, 0) for k in kv_a}
    if kv:  # where prompt tokens came from, and what prefetching did (programs.KVCounters)
        deltas["kv"] = kv
    return {"server_programs": deltas} if deltas else {}


def replica_split(before: list[int] | None, after: list[int] | None) -> dict[str, Any]:
    """Behind the router: how many of the run's requests each replica served."""
    if before is None or after is None or len(before) != len(after):
        return {}
    return {"replica_requests": [b - a for a, b in zip(before, after, strict=True)]}


def ratios(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per workload, the first target against each other one: >1 means the first is better."""
    names = list(runs)
    out: dict[str, Any] = {}
    if len(names) < 2:
        return out
    first = runs[names[0]]
    for w, a in first.items():
        for other in names[1:]:
            b = runs[other].get(w)
            if b is None:
                continue
            entry = {}
            if b["programs_per_s"]:
                entry["throughput_x"] = a["programs_per_s"] / b["programs_per_s"]
            if a["ttft_s"]["p50"] and b["ttft_s"]["p50"] is not None:
                entry["ttft_p50_x"] = b["ttft_s"]["p50"] / a["ttft_s"]["p50"]
            out.setdefault(w, {})[f"{names[0]}_vs_{other}"] = entry
    return out


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so the servers this run launched are stopped too."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.mixed_batch < 0:
        raise SystemExit("--mixed-batch must be >= 0")
    specs = [parse_target(s) for s in args.compare] if args.compare else [single_target(args)]
    if len({s.name for s in specs}) != len(specs):
        raise SystemExit("target names must be distinct")
    base = WorkloadConfig(args.num_programs, args.turns, args.output_tokens, args.system_tokens,
                          args.observation_tokens, args.branches, args.groups)
    workloads = sweep([parse_workload(item, base) for item in args.workloads],
                      args.sweep_agents)
    from sgl_tpu.loader import load_tokenizer
    from sgl_tpu.loader.chat_templates import with_chat_template

    tokenizer = with_chat_template(load_tokenizer(args.model_path), args.chat_template)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    results: dict[str, Any] = {
        "args": {k: (v if v != float("inf") else "inf") for k, v in vars(args).items()},
        "targets": {s.name: dataclasses.asdict(s) for s in specs},
        "workloads": {label: {"config": dataclasses.asdict(cfg), "tokens": describe(
            make_workload(name, cfg, args.seed), count_tokens)}
            for label, name, cfg in workloads},
        "runs": {}, "target_errors": {},
    }
    if args.mixed_batch:
        results["mixed"] = {}
    traces: dict[str, Any] = {}
    log_dir = Path(args.log_dir)
    for spec in specs:
        runs = results["runs"].setdefault(spec.name, {})
        try:
            with RunningTarget(spec, args.model_path, log_dir, args.chat_template) as target:
                first_info = target.server_info() or {}
                context_tokens = int(first_info.get("context_len") or 0)
                compute = first_info.get("compute")
                if compute:  # sgl-tpu's kernels, quantization and CPU flags, as it serves
                    results.setdefault("server_compute", {})[spec.name] = compute
                for label, name, cfg in workloads:
                    warm_cfg = warmup_config(cfg, args.warmup_programs)
                    if warm_cfg is not None:
                        warm = make_workload(name, warm_cfg, args.seed + WARMUP_SEED_OFFSET)
                        asyncio.run(run_workload(target.base_url, spec, warm, tokenizer, args,
                                                 f"{spec.name}/{label} warm-up"))
                    programs = make_workload(name, cfg, args.seed)
                    if args.mixed_batch:
                        mixed = run_mixed(target, spec, programs, tokenizer, args,
                                          f"{spec.name}/{label}")
                        results["mixed"].setdefault(spec.name, {})[label] = mixed
                        runs.update(runs_rows(label, mixed))
                        continue
                    target.flush_cache()
                    before, info = target.replica_requests(), target.server_info()
                    trace = asyncio.run(run_workload(target.base_url, spec, programs, tokenizer,
                                                     args, f"{spec.name}/{label}",
                                                     context_tokens))
                    runs[label] = run = summarize(trace)
                    if any(p.compaction for p in programs):  # the limit compaction kept to
                        run["context_tokens"] = cfg.trace.context_tokens or context_tokens
                    run["oracle"] = oracle_report(
                        trace.records, lambda t, special: tokenizer.encode(
                            t, add_special_tokens=special), oracle_page_size(args, first_info))
                    info_after = target.server_info()
                    run.update(server_side(info_after, run))
                    run.update(spec_counters(info, info_after))
                    run.update(program_counters(info, info_after))
                    run.update(replica_split(before, target.replica_requests()))
                    if args.save_traces:
                        traces.setdefault(spec.name, {})[label] = trace.to_dict(with_text=True)
        except (RuntimeError, TimeoutError, OSError, ValueError) as e:
            results["target_errors"][spec.name] = f"{type(e).__name__}: {e}"
            print(f"target {spec.name} failed: {e}", file=sys.stderr)
    results["ratios"] = ratios(results["runs"])
    print(format_table(results["runs"]), file=sys.stderr)
    emit(results, args.output)
    if args.save_traces and args.output:
        Path(args.output).with_suffix(".traces.json").write_text(json.dumps(traces))
    plot_path = args.plot or (str(Path(args.output).with_suffix(".png"))
                              if args.output and len(specs) > 1 else None)
    if plot_path and any(results["runs"].values()):
        from sgl_tpu.bench.agent_loop.plot import plot_compare

        plot_compare(results["runs"], plot_path,
                     f"agent loop: {', '.join(label for label, _, _ in workloads)}")
        print(f"plot: {plot_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
