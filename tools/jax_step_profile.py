"""Where a JAX decode step's time goes: a `jax.profiler` trace of the real runner, split by the
named scopes of the jitted step (layers: attention / KV write / projections; logits; sampler:
penalties, top-k/top-p, draw, argmax, log-probs; penalty counts), plus the host's batch build.

    python tools/jax_step_profile.py [--model-path PATH] [--dtype auto]
        [--attention-backends ref,gathered] [--batches 1,64] [--context 1024] [--steps 20]
        [--sampling greedy,sampled,penalized] [--output FILE]

Per (attention backend, batch, sampling) it times `runner.forward` (wall, the backends
interleaved ABAB so their ratio is fair on a shared machine), times the host side alone
(`batch_shape` + `build_forward_batch`), and traces `--steps` steps:

    trace events with args.hlo_op (XLA:CPU thunks; on a GPU the device's kernel events)
      -> HLO instruction of the compiled step or sampler program (`compiled.as_text()`)
      -> its metadata op_name, e.g. "jit(_step_impl)/layers/attention/while/body/dot_general"
      -> part "layers/attention"

Times are self times (a `while` loop's own time excludes the ops of its body) summed per part
and divided by the steps; `device_ms` is their total. XLA:CPU runs independent thunks on
several threads, so there `device_ms` can exceed the wall time; on a GPU one stream's kernels
are serial and `step_ms - device_ms` is launch and host overhead. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import numpy as np

from sgl_tpu.bench.report import emit, model_label

SAMPLING = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.7, top_p=0.9, top_k=40),
    "penalized": dict(temperature=0.7, top_p=0.9, top_k=40, frequency_penalty=0.5,
                      presence_penalty=0.2, repetition_penalty=1.1),
}
# Named scopes of the step (backends/jax/runner.py, backends/jax/models/llama.py,
# backends/jax/sampler.py).
TOP_SCOPES = ("layers", "logits", "sampler", "penalty_counts")
LAYER_SCOPES = ("attention", "kv_write", "qkv_proj", "o_proj", "mlp")
SAMPLER_SCOPES = ("penalties_mask", "top_k_top_p", "bisect", "draw", "argmax", "logprobs")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
# Parameters' op_names name the weight: an op without metadata of its own (XLA:CPU drops it
# from some dots) is placed by the weight it reads.
_LAYER_WEIGHT = re.compile(r"\['layers'\]\[\d+\]\['(\w+)'\]")
_WEIGHT_PARTS = {
    **dict.fromkeys(("wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm", "attn_norm"),
                    "layers/qkv_proj"),
    "wo": "layers/o_proj", "post_attn_norm": "layers/o_proj",
    **dict.fromkeys(("w_gate", "w_up", "w_down", "mlp_norm", "post_mlp_norm", "router"),
                    "layers/mlp"),
}


def part_of(op_name: str | None) -> str:
    """op_name metadata -> part, e.g. "layers/attention", "sampler/top_k_top_p", "other"."""
    if not op_name:
        return "other"
    comps = op_name.split("/")
    top = next((c for c in comps if c in TOP_SCOPES), None)
    if top is None:
        return "other"
    rest = comps[comps.index(top) + 1:]
    if top == "layers":
        return "layers/" + next((c for c in rest if c in LAYER_SCOPES), "other")
    if top == "sampler":
        inner = [c for c in rest if c in SAMPLER_SCOPES]
        return "sampler/" + (inner[-1] if inner else "other")
    return top


def _weight_part(op_name: str | None) -> str | None:
    """The part a parameter's weight belongs to ("params['layers'][3]['wq']" -> qkv_proj)."""
    if not op_name or not op_name.startswith("params["):
        return None
    m = _LAYER_WEIGHT.search(op_name)
    if m:
        return _WEIGHT_PARTS.get(m.group(1))
    return "logits" if op_name.startswith(("params['embed']", "params['lm_head']")) else None


def _operands(line: str) -> list[str]:
    """Names of an HLO instruction's operands (inside the parentheses after its opcode)."""
    rhs = line.split(" = ", 1)[1]
    start = rhs.find("(")
    depth, end = 0, len(rhs)
    for i in range(start, len(rhs)):
        depth += {"(": 1, ")": -1}.get(rhs[i], 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rhs[start:end])


def hlo_parts(hlo_text: str) -> dict[str, str]:
    """Instruction name -> part, from a compiled module's text. An instruction without an
    op_name takes the most common part of the computations it calls (a fusion, a loop), else
    the part of the weight it reads."""
    own: dict[str, str | None] = {}
    calls: dict[str, list[str]] = {}
    operands: dict[str, list[str]] = {}
    members: dict[str, list[str]] = collections.defaultdict(list)
    computation = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m and " = " not in line:
            computation = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        op = _OP_NAME.search(line)
        own[name] = op.group(1).replace("\\'", "'") if op else None
        called = _CALLS.findall(line)
        for b in _BRANCHES.findall(line):
            called += [c.strip().lstrip("%") for c in b.split(",")]
        calls[name] = called
        operands[name] = _operands(line)
        if computation is not None:
            members[computation].append(name)

    memo: dict[str, str] = {}

    def resolve(name: str, depth: int = 0) -> str:
        if name in memo:
            return memo[name]
        part = part_of(own.get(name))
        if part == "other" and depth < 8:
            votes = collections.Counter(
                resolve(i, depth + 1) for c in calls.get(name, ()) for i in members.get(c, ()))
            votes.pop("other", None)
            if votes:
                part = votes.most_common(1)[0][0]
        if part == "other" and own.get(name) is None:
            weights = [_weight_part(own.get(o)) for o in operands.get(name, ())]
            part = next((w for w in weights if w), part)
        memo[name] = part
        return part

    return {name: resolve(name) for name in own}


def trace_parts(trace_dir: str, module_prefix: str, parts: dict[str, str]) -> dict[str, float]:
    """Microseconds of self time per part over all events of the step's module in the trace."""
    files = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    if not files:
        raise RuntimeError(f"no trace written under {trace_dir}")
    with gzip.open(files[0]) as f:
        events = json.load(f)["traceEvents"]
    proc = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})
           and e["args"].get("hlo_module", "").startswith(module_prefix)]
    on_device = [e for e in ops if "/device:" in proc.get(e["pid"], "")]
    ops = on_device or ops  # a GPU trace: kernels on the device, not the host's launches
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[(e["pid"], e["tid"])].append(e)
    total: dict[str, float] = collections.defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, part, self time]
        for e in evs:
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1][0] <= start:
                _, part, self_us = stack.pop()
                total[part] += self_us
            if stack:
                stack[-1][2] -= e["dur"]  # nested: not the parent's own time
            stack.append([end, parts.get(e["args"]["hlo_op"], "other"), e["dur"]])
        for _, part, self_us in stack:
            total[part] += self_us
    return dict(total)


def _steps(batch: int, context: int, page_size: int, vocab: int, sampling: str, rng):
    from sgl_tpu.executor.step import SeqStep
    from sgl_tpu.sampling_params import SamplingParams

    params = SamplingParams(**SAMPLING[sampling])
    per_seq = -(-(context + 1) // page_size)
    return [SeqStep(token_ids=[int(rng.integers(0, vocab))], prefix_len=context,
                    pages=np.arange(1 + i * per_seq, 1 + (i + 1) * per_seq, dtype=np.int32),
                    sampling=params, seed=i, num_output_tokens=1, return_logprob=False)
            for i in range(batch)]


def profile_one(runner, steps, num_steps: int) -> dict:
    """Host build time and the traced parts of `num_steps` DECODE steps (already compiled)."""
    import jax
    import jax.numpy as jnp

    from sgl_tpu.backends.jax.forward_batch import build_forward_batch
    from sgl_tpu.backends.jax.runner import sample_inputs
    from sgl_tpu.executor.step import ForwardMode

    mode = ForwardMode.DECODE
    t0 = time.perf_counter()
    for _ in range(num_steps):
        fb = build_forward_batch(steps, runner.batch_shape(mode, steps), runner.config.page_size)
    host_ms = 1e3 * (time.perf_counter() - t0) / num_steps
    # The step is two programs: the model (`_step`) and the sampler (`_sample`); each one's
    # events are split by its own HLO (instruction names repeat across modules).
    step = runner._step.lower(runner.params, runner.kv_pools, runner._last_token_ids, fb,
                              mode=mode).compile()
    logits = jax.ShapeDtypeStruct((fb.sample_idx.shape[0], runner.vocab_size), jnp.float32)
    sampler = runner._sample.lower(logits, runner.token_counts, runner._last_token_ids,
                                   sample_inputs(fb), reset_rows=False).compile()
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(num_steps):
                runner.forward(mode, steps)
        per_part = collections.Counter()
        for module, compiled in (("jit__step_impl", step), ("jit__sample_impl", sampler)):
            per_part.update(trace_parts(tmp, module, hlo_parts(compiled.as_text())))
    parts_ms = {k: round(v / 1e3 / num_steps, 4) for k, v in sorted(per_part.items())}
    return {"host_build_ms": round(host_ms, 4), "device_ms": round(sum(parts_ms.values()), 4),
            "parts_ms": parts_ms}


def run(args: argparse.Namespace) -> dict:
    import jax

    from sgl_tpu.config import ServerArgs
    from sgl_tpu.executor.registry import create_model_runner, runner_config
    from sgl_tpu.executor.step import ForwardMode
    from sgl_tpu.loader import load_model

    loaded = load_model(args.model_path)
    cfg = loaded.config
    backends = args.attention_backends.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    runners = {}
    for name in backends:
        sargs = ServerArgs(model_path=args.model_path, dtype=args.dtype, skip_warmup=True,
                           backend="jax", attention_backend=name,
                           max_total_tokens=max(batches) * (args.context + 32) + 64,
                           max_running_requests=max(batches), chunked_prefill_size=256)
        runners[name] = create_model_runner(cfg, loaded.params,
                                            runner_config(sargs, cfg.context_len))
    some = next(iter(runners.values()))
    results: dict = {"model": model_label(loaded.model_path), "jax_platform": jax.default_backend(),
                     "device": str(jax.devices()[0]), "dtype": some.config.dtype,
                     "context": args.context, "steps": args.steps, "runs": []}
    rng = np.random.default_rng(0)
    for batch in batches:
        for sampling in args.sampling.split(","):
            steps = _steps(batch, args.context, some.config.page_size, cfg.vocab_size,
                           sampling, rng)
            walls: dict[str, list[float]] = {name: [] for name in runners}
            for r in runners.values():  # compile + warm
                r.forward(ForwardMode.DECODE, steps)
            for _ in range(args.steps):  # ABAB: a fair ratio on a shared machine
                for name, r in runners.items():
                    t0 = time.perf_counter()
                    r.forward(ForwardMode.DECODE, steps)
                    walls[name].append(time.perf_counter() - t0)
            for name, r in runners.items():
                row = {"attention_backend": r.config.attention_backend, "batch": batch,
                       "sampling": sampling,
                       "step_ms": round(1e3 * statistics.median(walls[name]), 3),
                       **profile_one(r, steps, args.steps)}
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
            if len(runners) > 1:
                first = results["runs"][-len(runners)]
                for row in results["runs"][-len(runners) + 1:]:
                    row[f"step_over_{first['attention_backend']}"] = round(
                        row["step_ms"] / first["step_ms"], 3)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backends", default="ref,gathered",
                   help="comma list of JAX attention backends (executor/attention_registry.py)")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024, help="KV tokens per sequence")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed and traced")
    p.add_argument("--sampling", default="greedy,sampled",
                   help="comma list of " + "/".join(SAMPLING))
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    emit(run(args), args.output)


if __name__ == "__main__":
    main()
