"""The configuration tree: one flat, validated `ServerArgs` (what the CLI and `Engine(**kwargs)`
accept, with SGLang's flag names) from which each component gets only its own frozen part:

    ServerArgs ──► RunnerConfig     (model runner: weights, dtype, KV pool, shape buckets; built
              │                      with every "auto" resolved by executor/registry.py)
              ├──► SchedulerConfig  (batching policy, token budgets, radix cache)
              └──► HTTP settings    (host, port, api key; read directly by the server)

A leaf module: it imports nothing of the project. Fields that name a registry entry (policy,
executor, attention and grammar backends, chat template) are checked against the registries by
`sgl_tpu.choices` before a model loads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16")
# --kv-cache-dtype (SGLang's flag): auto = the model's compute dtype; bfloat16 (or bf16) halves a
# float32 model's KV bytes; fp8_e5m2 (unscaled, as SGLang's) quarters them. SGLang's scaled
# fp8_e4m3 and fp4 are refused by name.
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "fp8_e5m2")
UNSUPPORTED_KV_CACHE_DTYPES = ("fp8_e4m3", "fp4_e2m1")
# --kv-cache-dtype -> the KV pool's element type (RunnerConfig.kv_cache_dtype)
KV_POOL_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "fp8_e5m2": "float8_e5m2"}
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


def check_priority_scheduling(cfg: ServerArgs | SchedulerConfig) -> None:
    """ValueError for a bad priority-scheduling setting (the fields both configs share)."""
    threshold = cfg.priority_scheduling_preemption_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(f"priority_scheduling_preemption_threshold must be an integer >= 0, "
                         f"got {threshold!r}")
    rate = cfg.priority_aging_rate
    if isinstance(rate, bool) or not isinstance(rate, int | float) \
            or not 0 <= rate < float("inf"):
        raise ValueError(f"priority_aging_rate must be a finite number >= 0, got {rate!r}")
    default, (lo, hi) = cfg.default_priority_value, PRIORITY_RANGE
    if default is not None and (isinstance(default, bool) or not isinstance(default, int)
                                or not lo <= default <= hi):
        raise ValueError(f"default_priority_value must be an integer in [{lo}, {hi}], "
                         f"got {default!r}")
    if cfg.retraction_policy not in RETRACTION_POLICIES:
        raise ValueError(f"retraction_policy must be one of {RETRACTION_POLICIES}, "
                         f"got {cfg.retraction_policy!r}")
    if cfg.retraction_policy == "priority" and not cfg.enable_priority_scheduling:
        raise ValueError("--retraction-policy priority requires --enable-priority-scheduling")


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
    # the KV pool's element type: "auto" (= dtype), "bfloat16" (under a float32 model) or
    # "float8_e5m2": K/V rounded to it as written, widened as attention reads them
    kv_cache_dtype: str = "auto"
    # a hybrid model's sliding-window pool (torch backend, mem_cache/swa_pool.py): local layers
    # keep their K/V on `swa_num_pages` window pages (page 0 included), global layers on
    # `num_pages`; 0: every layer on `num_pages`. `swa_window`: the local layers' window.
    swa_num_pages: int = 0
    swa_window: int = 0

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float8_e5m2"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, bfloat16 or float8_e5m2, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_tile % self.page_size:
            raise ValueError(f"kv_tile ({self.kv_tile}) must be a multiple of page_size "
                             f"({self.page_size})")

    @property
    def kv_dtype(self) -> str:
        """The KV pool's element type, resolved: "float32", "bfloat16" or "float8_e5m2"."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def max_pages_per_seq(self) -> int:
        """Page-table width: whole KV tiles covering context_len, so tile reads never clamp."""
        num_tiles = -(-self.context_len // self.kv_tile)
        return num_tiles * (self.kv_tile // self.page_size)


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_running_requests: int
    max_extend_seqs: int
    chunked_prefill_size: int  # token budget of one EXTEND batch
    context_len: int
    schedule_policy: str = "program"
    disable_radix_cache: bool = False
    max_top_logprobs: int = 20
    session_retention_s: float = 30.0  # see ServerArgs
    radix_eviction_policy: str = "lru"  # a name in mem_cache/eviction.py EVICTION_POLICIES
    max_retention_s: float = 600.0  # see ServerArgs (the longest pin of any kind)
    session_ttl_s: float = 300.0
    tool_pause_grace_s: float = 10.0
    # resolved from ServerArgs.speculative_algorithm by executor/registry.py: a DRAFTERS name
    # or None (off); drafting happens only while at most speculative_max_batch requests run
    # (None: at any batch size)
    speculative_algorithm: str | None = None
    speculative_max_batch: int | None = None
    # auto: each batch-size bucket drafts only while its measured seconds per output token
    # beat plain steps (scheduler/speculative.py DraftGate); why speculation is what it is
    speculative_gate: bool = False
    speculative_resolution: str = ""
    speculative_num_draft_tokens: int = 4
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 8
    speculative_suffix_max_tree_depth: int = 24
    speculative_suffix_max_cached_requests: int = 10_000
    speculative_suffix_max_spec_factor: float = 1.0
    speculative_suffix_min_token_prob: float = 0.1
    # Dispatch a DECODE step before the previous one's tokens reach the host (resolved from
    # ServerArgs.overlap_schedule by executor/registry.py; see scheduler/overlap.py).
    overlap_schedule: bool = False
    kv_cache_dtype: str = "auto"  # the runner's resolved KV pool dtype (reported only)
    # decode steps over batch state kept on the device (jax decode state, torch static step;
    # reported only)
    device_decode_state: bool = False
    # Priority scheduling (SGLang's flags; scheduler/priority.py): see ServerArgs.
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    default_priority_value: int | None = None
    retraction_policy: str = "length"
    priority_aging_rate: float = PRIORITY_AGING_RATE
    # Programs (scheduler/programs.py): see ServerArgs.
    program_admission: bool = False
    program_ttl_s: float = 600.0
    pooling: str = "last"  # embedding requests: see ServerArgs

    def __post_init__(self) -> None:
        check_priority_scheduling(self)


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
        for name, lo in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1),
                         ("dp_rank", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= {lo}, "
                                 f"got {value!r}")

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
class ServerArgs:
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    # CORS: origins allowed to call the API from a browser (none by default: a page on another
    # origin cannot read responses, and JSON bodies need a preflight it does not get).
    allow_origins: tuple[str, ...] = ()
    max_request_bytes: int = 16 * 2**20  # largest HTTP request body (413 beyond)
    # a streamed request gets its first token, then an update every this many tokens (and its
    # last); a request's own `stream_interval` sampling parameter overrides it
    stream_interval: int = 1
    served_model_name: str | None = None
    dtype: str = "auto"
    # KV pool: auto (= the compute dtype; bfloat16 under --dtype auto resolving to float32 on
    # a CPU, see executor/registry.py), bfloat16 / bf16
    kv_cache_dtype: str = "auto"
    page_size: int = 16
    max_total_tokens: int = 65536  # KV pool capacity in tokens
    max_running_requests: int = 64
    max_extend_seqs: int = 32
    chunked_prefill_size: int = 2048
    context_length: int | None = None  # None: the model's
    schedule_policy: str = "program"
    disable_radix_cache: bool = False
    # A finished request with a session_id keeps its prompt + output in the radix cache at
    # eviction priority for this long (0 = off): its agent's next turn, after a tool call,
    # resends it. 30 s covers typical tool round trips (code runs, searches, API calls take
    # well under that) while bounding how long an abandoned session keeps its priority; the
    # KV stays evictable throughout, it is only evicted after unretained KV.
    session_retention_s: float = 30.0
    # Cache control for agents (scheduler/sessions.py): which unlocked KV is evicted first
    # (lru, or priority: the requests' `priority`, low first); the longest a request's
    # `retention_seconds` or a session's TTL may pin KV; the TTL of an /open_session without a
    # `timeout` (renewed by each request of the session); how long a turn that ends in tool
    # calls keeps its KV pinned on the device (0 = off), after which it is evicted (or demoted
    # to the host tier) the normal way.
    radix_eviction_policy: str = "lru"
    max_retention_s: float = 600.0
    session_ttl_s: float = 300.0
    tool_pause_grace_s: float = 10.0
    # Priority scheduling (SGLang's flags, scheduler/priority.py): waiting requests are
    # admitted by `priority` (higher first; lower first with
    # schedule_low_priority_values_first), and one that does not fit retracts running requests
    # more than the threshold below it (unless disable_priority_preemption). A request without
    # a priority gets default_priority_value (None: 0). Every request gains
    # priority_aging_rate levels per second since it arrived, so a low priority is delayed,
    # never starved (0: no aging). retraction_policy "priority": a short KV pool retracts the
    # lowest priority first instead of the least progress ("length").
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    default_priority_value: int | None = None
    retraction_policy: str = "length"
    priority_aging_rate: float = PRIORITY_AGING_RATE
    # Programs (scheduler/programs.py): the agents behind requests, named by their session
    # (or Anthropic's metadata.user_id), are forgotten program_ttl_s after their last request.
    # With schedule_policy "program", admission control holds new programs' first turns while
    # the admitted programs' KV working sets fill the pool and host tier, unless
    # disable_program_admission.
    program_ttl_s: float = 600.0
    disable_program_admission: bool = False
    # KV cache tiers below the pool (SGLang's HiCache flags, mem_cache/tiers.py): pages evicted
    # from the pool demote to host memory, then to disk; the pages that follow a request's
    # device match load back at admission. The disk tier, in a folder per model fingerprint,
    # survives restarts. Off by default.
    enable_hierarchical_cache: bool = False
    # A hybrid model's local (sliding-window) layers, Gemma 2 and 3's, keep their K/V in a pool
    # of their own that holds what running requests' windows and the radix cache's recent
    # prefixes need (SGLang's SWA memory pool, mem_cache/swa_pool.py; torch backend), so the
    # memory of --max-total-tokens holds more tokens. swa_full_tokens_ratio: the window pool's
    # tokens per main-pool token (at least a window plus a prefill chunk).
    disable_hybrid_swa_memory: bool = False
    swa_full_tokens_ratio: float = 0.125
    hicache_ratio: float = 2.0  # host tier size as a multiple of the pool's (unless size)
    hicache_size: float = 0.0  # host tier size in GB; 0: from hicache_ratio
    hicache_write_policy: str = "write_through"  # or "write_back"
    hicache_storage_backend: str | None = None  # "file": the disk tier, in hicache_storage_dir
    hicache_storage_dir: str | None = None  # None: "sgl-tpu-hicache-<uid>" in the temp folder
    hicache_storage_max_bytes: int = 0  # 0: a quarter of the folder's free space at start
    hicache_storage_durability: str = "none"  # or "fsync": each page file and its folder
    # Responses API: stored responses (their conversations, for previous_response_id) kept in
    # memory, at most this many (least recently used dropped first), each this long after its
    # last use.
    responses_max_stored: int = 1024
    responses_ttl_s: float = 3600.0
    # Embeddings (/v1/embeddings, /encode): how a prompt's last hidden states are pooled into
    # one vector, a name in scheduler/pooling.py POOLING_METHODS (last suits decoder models)
    pooling: str = "last"
    kv_tile: int = 256
    block_q: int = 128
    attention_backend: str = "auto"  # auto: the Pallas TPU kernel on TPU, else the reference
    min_token_bucket: int = 64
    max_top_logprobs: int = 20
    skip_warmup: bool = False
    grammar_backend: str = "llguidance"  # or "outlines", "xgrammar", "none"
    disable_jump_forward: bool = False
    # Speculative decoding (SGLang's flags): "NGRAM" drafts up to speculative_num_draft_tokens
    # tokens per request and step from the request's own context (its last n tokens, n from
    # the max down to the min window, matched earlier in it) and verifies them in the decode
    # step (scheduler/speculative.py); "SUFFIX" also drafts from recent requests' outputs.
    # "auto": SUFFIX on CPUs, each batch size drafting only while its measured seconds per
    # output token beat plain steps (scheduler/speculative.py DraftGate)
    # (executor/registry.py resolve_speculation); "none" or None: off.
    speculative_algorithm: str | None = "auto"
    speculative_num_draft_tokens: int = 4
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 8
    # "SUFFIX" also drafts from the outputs of recent requests (scheduler/suffix.py): runs of
    # up to max_tree_depth tokens of the last max_cached_requests outputs (and at most
    # suffix.MAX_CACHED_TOKENS tokens); a draft follows the most frequent continuation while
    # its probability is >= min_token_prob, for at most max_spec_factor x the matched length.
    speculative_suffix_max_tree_depth: int = 24
    speculative_suffix_max_cached_requests: int = 10_000
    speculative_suffix_max_spec_factor: float = 1.0
    speculative_suffix_min_token_prob: float = 0.1
    log_level: str = "info"
    backend: str = "auto"  # executor: "jax", "torch", or "auto" (the faster one here)
    torch_compile: str = "auto"  # torch backend: auto = on for tpu/cuda, off on CPU (see help)
    disable_compile: bool = False  # torch backend: run eagerly (debugging); = torch_compile off
    overlap_schedule: str = "auto"  # see the CLI help; resolved by executor/registry.py
    disable_overlap_schedule: bool = False  # SGLang's flag; = overlap_schedule off
    jax_decode_state: str = "auto"  # see the CLI help; resolved by executor/registry.py
    device: str = "auto"  # torch backend device
    quantization: str = "auto"  # weights: none/gguf/int8/int4, auto (sgl_tpu/quantization)
    # Data parallelism: N replicas of this server behind the sglang-router on --port (see
    # server/replicas.py); router_args are the `--router-*` flags, passed on to the router.
    dp_size: int = 1
    router_policy: str = "cache_aware"
    router_args: tuple[str, ...] = ()
    # Tensor parallelism (SGLang's flags): the model split over tp_size devices; with nnodes > 1
    # one process per host, rank 0 at node_rank 0 serves HTTP, jax.distributed /
    # torch.distributed meet at dist_init_addr ("host:port").
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: int = 120  # seconds every rank has to join the group (SGLang's --dist-timeout)
    # torch on CPU: the executor's intra-op threads, fixed at start (0 = every CPU the process
    # may use).
    torch_threads: int = 0
    # torch on CPU: GOMP_SPINCOUNT of the executor's OpenMP threads (0 = sleep at once; None =
    # the environment's GOMP_SPINCOUNT / OMP_WAIT_POLICY, else executor/omp_wait.py's default)
    omp_spin_count: int | None = None
    # CUDA graphs of the torch backend's decode step (SGLang's flags): batches up to
    # cuda_graph_max_bs sequences (None: --max-running-requests) replay a captured graph.
    # Accepted and inert on CPU/TPU.
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    tool_call_parser: str | None = None  # None: picked from the chat template (logged)
    reasoning_parser: str | None = None  # "qwen3" / "deepseek-r1": split <think> blocks
    # A request's tokens do not depend on its batch mates, prompt chunking or radix-cache hits
    # (batch-invariant kernels; see sgl_tpu/executor/batch_invariant.py for what it costs).
    enable_deterministic_inference: bool = False
    chat_template: str | None = None  # built-in name or Jinja file; None: the model's own
    # KV events for a cache-aware router (SGLang's --kv-events-config): a JSON object of
    # KVEventsConfig's keys; None (or publisher "null"): none published.
    kv_events_config: str | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "max_total_tokens", "max_running_requests", "max_extend_seqs",
                     "chunked_prefill_size", "kv_tile", "block_q", "min_token_bucket",
                     "max_request_bytes", "stream_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        for name in ("session_retention_s", "max_retention_s", "session_ttl_s",
                     "tool_pause_grace_s", "program_ttl_s"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not 0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 < self.session_ttl_s <= self.max_retention_s:
            raise ValueError(f"session_ttl_s must be in (0, max_retention_s = "
                             f"{self.max_retention_s}], got {self.session_ttl_s}")
        if isinstance(self.torch_threads, bool) or not isinstance(self.torch_threads, int) \
                or self.torch_threads < 0:
            raise ValueError(f"torch_threads must be an integer >= 0, got {self.torch_threads!r}")
        if self.omp_spin_count is not None and (
                isinstance(self.omp_spin_count, bool) or not isinstance(self.omp_spin_count, int)
                or self.omp_spin_count < 0):
            raise ValueError(f"omp_spin_count must be an integer >= 0, "
                             f"got {self.omp_spin_count!r}")
        if self.cuda_graph_max_bs is not None and (
                isinstance(self.cuda_graph_max_bs, bool)
                or not isinstance(self.cuda_graph_max_bs, int) or self.cuda_graph_max_bs < 1):
            raise ValueError(f"cuda_graph_max_bs must be a positive integer, "
                             f"got {self.cuda_graph_max_bs!r}")
        if self.overlap_schedule not in OVERLAP_SCHEDULE:
            raise ValueError(f"overlap_schedule must be one of {OVERLAP_SCHEDULE}, "
                             f"got {self.overlap_schedule!r}")
        if self.jax_decode_state not in JAX_DECODE_STATE:
            raise ValueError(f"jax_decode_state must be one of {JAX_DECODE_STATE}, "
                             f"got {self.jax_decode_state!r}")
        if self.torch_compile not in TORCH_COMPILE:
            raise ValueError(f"torch_compile must be one of {TORCH_COMPILE}, "
                             f"got {self.torch_compile!r}")
        if self.device not in TORCH_DEVICES:
            raise ValueError(f"device must be one of {TORCH_DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype in UNSUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} is not supported: "
                             f"sgl-tpu keeps no KV scales; use auto (the model's dtype), "
                             f"bfloat16 (bf16) or fp8_e5m2")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.backend == "jax":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} needs the torch backend; "
                             f"--backend jax stores the KV cache in the model's dtype (auto)")
        if self.max_total_tokens < 2 * self.page_size:
            raise ValueError("max_total_tokens must hold at least two pages")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if isinstance(self.responses_max_stored, bool) or not isinstance(
                self.responses_max_stored, int) or self.responses_max_stored < 1:
            raise ValueError(f"responses_max_stored must be a positive integer, "
                             f"got {self.responses_max_stored!r}")
        if (isinstance(self.responses_ttl_s, bool)
                or not isinstance(self.responses_ttl_s, int | float)
                or not 0 < self.responses_ttl_s < float("inf")):
            raise ValueError(f"responses_ttl_s must be a finite number > 0, "
                             f"got {self.responses_ttl_s!r}")
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) \
                or not 1 <= self.dp_size <= 256:
            raise ValueError(f"dp_size must be an integer in [1, 256], got {self.dp_size!r}")
        for name, hi in (("tp_size", 1024), ("nnodes", 1024)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ValueError(f"{name} must be an integer in [1, {hi}], got {value!r}")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be an integer in [0, nnodes={self.nnodes}), "
                             f"got {self.node_rank!r}")
        if isinstance(self.dist_timeout, bool) or not isinstance(self.dist_timeout, int) \
                or self.dist_timeout < 1:
            raise ValueError(f"dist_timeout must be a positive integer (seconds), got "
                             f"{self.dist_timeout!r}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's address)")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {ROUTER_POLICIES}, "
                             f"got {self.router_policy!r}")
        if self.router_args and self.dp_size == 1:
            raise ValueError("router flags (--router-*) need --dp-size > 1")
        for name, hi in (("speculative_num_draft_tokens", 64),
                         ("speculative_ngram_min_match_window_size", 64),
                         ("speculative_ngram_max_match_window_size", 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ValueError(f"{name} must be an integer in [1, {hi}], got {value!r}")
        for name, lo, hi in (("speculative_suffix_max_tree_depth", 2, 1024),
                             ("speculative_suffix_max_cached_requests", 1, 10**7)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if not 0 < self.speculative_suffix_max_spec_factor <= 64:
            raise ValueError("speculative_suffix_max_spec_factor must be in (0, 64], got "
                             f"{self.speculative_suffix_max_spec_factor!r}")
        if not 0 <= self.speculative_suffix_min_token_prob <= 1:
            raise ValueError("speculative_suffix_min_token_prob must be in [0, 1], got "
                             f"{self.speculative_suffix_min_token_prob!r}")
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
        if self.speculative_ngram_min_match_window_size \
                > self.speculative_ngram_max_match_window_size:
            raise ValueError("speculative_ngram_min_match_window_size must not exceed "
                             "speculative_ngram_max_match_window_size")
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
        ratio = self.swa_full_tokens_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {ratio!r}")
        check_priority_scheduling(self)
        if self.kv_events_config is not None:
            KVEventsConfig.from_json(self.kv_events_config)
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")

    def _check_hicache(self) -> None:
        for name in ("hicache_ratio", "hicache_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.hicache_ratio == 0 and self.hicache_size == 0:
            raise ValueError("the host tier needs --hicache-ratio > 0 or --hicache-size > 0")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, "
                             f"got {self.hicache_write_policy!r}")
        if self.hicache_storage_backend not in (None, "file"):
            raise ValueError(f"hicache_storage_backend must be file (or unset), "
                             f"got {self.hicache_storage_backend!r}")
        if isinstance(self.hicache_storage_max_bytes, bool) \
                or not isinstance(self.hicache_storage_max_bytes, int) \
                or self.hicache_storage_max_bytes < 0:
            raise ValueError(f"hicache_storage_max_bytes must be an integer >= 0, "
                             f"got {self.hicache_storage_max_bytes!r}")
        if self.hicache_storage_durability not in HICACHE_STORAGE_DURABILITIES:
            raise ValueError(f"hicache_storage_durability must be one of "
                             f"{HICACHE_STORAGE_DURABILITIES}, "
                             f"got {self.hicache_storage_durability!r}")
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
        """The scheduler's config; overlap and speculation as executor/registry.py resolved
        them (off unless given)."""
        return SchedulerConfig(
            page_size=self.page_size,
            max_running_requests=self.max_running_requests,
            max_extend_seqs=runner.max_extend_seqs,
            chunked_prefill_size=runner.token_buckets[-1],
            context_len=runner.context_len,
            schedule_policy=self.schedule_policy,
            disable_radix_cache=self.disable_radix_cache,
            max_top_logprobs=self.max_top_logprobs,
            session_retention_s=float(self.session_retention_s),
            radix_eviction_policy=self.radix_eviction_policy,
            max_retention_s=float(self.max_retention_s),
            session_ttl_s=float(self.session_ttl_s),
            tool_pause_grace_s=float(self.tool_pause_grace_s),
            speculative_algorithm=speculative_algorithm,
            speculative_max_batch=speculative_max_batch,
            speculative_gate=speculative_gate,
            speculative_resolution=speculative_resolution,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            speculative_ngram_min_match_window_size=self.speculative_ngram_min_match_window_size,
            speculative_ngram_max_match_window_size=self.speculative_ngram_max_match_window_size,
            speculative_suffix_max_tree_depth=self.speculative_suffix_max_tree_depth,
            speculative_suffix_max_cached_requests=self.speculative_suffix_max_cached_requests,
            speculative_suffix_max_spec_factor=float(self.speculative_suffix_max_spec_factor),
            speculative_suffix_min_token_prob=float(self.speculative_suffix_min_token_prob),
            overlap_schedule=overlap_schedule,
            kv_cache_dtype=runner.kv_dtype,
            device_decode_state=runner.jax_decode_state or runner.static_decode,
            enable_priority_scheduling=self.enable_priority_scheduling,
            schedule_low_priority_values_first=self.schedule_low_priority_values_first,
            priority_scheduling_preemption_threshold=(
                self.priority_scheduling_preemption_threshold),
            disable_priority_preemption=self.disable_priority_preemption,
            default_priority_value=self.default_priority_value,
            retraction_policy=self.retraction_policy,
            priority_aging_rate=float(self.priority_aging_rate),
            program_admission=(self.schedule_policy == "program"
                               and not self.disable_program_admission),
            program_ttl_s=float(self.program_ttl_s),
            pooling=self.pooling,
        )
