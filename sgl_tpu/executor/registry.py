"""Registry of executor backends (`--backend`) and the resolution of every "auto" runner setting.

    ServerArgs ──runner_config(args, model_context_len)──► RunnerConfig (all names resolved)
               ──create_model_runner(model_config, params, cfg)──► a step.ModelRunner

    --backend jax    backends/jax/runner.py    XLA: TPU, GPU, CPU
    --backend torch  backends/torch/runner.py  PyTorch: tpu (TorchTPU), cuda, cpu
    --backend auto   torch on CPU when PyTorch is installed (bf16 GEMMs on AVX-512/AMX; XLA:CPU
                     measured several times slower), jax where JAX has an accelerator

Every backend-specific answer comes from that backend's platform module
(sgl_tpu/backends/<backend>/platform.py), imported by name: nothing here imports a framework or a
home, nothing on the torch path loads JAX (a torch scheduler process never does), so the
platform check for `--backend auto` reads the environment and installed packages instead of
asking JAX. The RunnerConfig built here is final: runners never rewrite it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from sgl_tpu.config import RunnerConfig, ServerArgs, pow2_buckets
from sgl_tpu.executor import batch_invariant
from sgl_tpu.executor.attention_registry import resolve_attention_backend
from sgl_tpu.executor.step import ModelRunner
from sgl_tpu.kv_dtypes import KV_FLAG_DTYPES, backend_refusal
from sgl_tpu.mem_cache.swa_pool import pool_split
from sgl_tpu.models.config import GemmaConfig, ModelConfig
from sgl_tpu.quantization import resolve_quantization

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutorBackend:
    runner: str  # "module:Class" of its ModelRunner
    requires: str  # the package it needs
    install_hint: str


EXECUTOR_BACKENDS: dict[str, ExecutorBackend] = {
    "jax": ExecutorBackend("sgl_tpu.backends.jax.runner:JaxModelRunner", "jax",
                           "pip install 'sgl-tpu'"),
    "torch": ExecutorBackend("sgl_tpu.backends.torch.runner:TorchModelRunner", "torch",
                             "pip install 'sgl-tpu[torch]'"),
}
BACKEND_CHOICES = ("auto", *EXECUTOR_BACKENDS)

# Packages whose presence means JAX will run on an accelerator rather than the CPU.
_JAX_ACCELERATOR_PACKAGES = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin")


def jax_has_accelerator() -> bool:
    """Whether JAX would pick a TPU/GPU here, judged without importing JAX: `JAX_PLATFORMS` when
    set, else an installed TPU runtime or CUDA plugin."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() != "cpu"
    return any(importlib.util.find_spec(p) is not None for p in _JAX_ACCELERATOR_PACKAGES)


def resolve_backend(backend: str) -> str:
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
    if backend != "auto":
        return backend
    if importlib.util.find_spec("torch") is not None and not jax_has_accelerator():
        return "torch"
    return "jax"


def platform(backend: str) -> ModuleType:
    """The backend's platform module (its answers to every `auto` setting)."""
    return importlib.import_module(f"sgl_tpu.backends.{backend}.platform")


def _resolve_dtype(args: ServerArgs, backend: str) -> str:
    return args.dtype if args.dtype != "auto" else platform(backend).default_dtype(args)


def _resolve_compile(args: ServerArgs, backend: str) -> bool:
    if backend != "torch" or args.disable_compile or args.torch_compile == "off":
        return False
    if args.torch_compile == "on":
        return True
    return platform(backend).compile_default(args)


def resolve_overlap_schedule(args: ServerArgs, backend: str) -> bool:
    """--overlap-schedule: auto = on for accelerators. On this project's CPUs the overlapped
    loop (its torch runner on one compute thread) measured as fast as the serial one, not
    faster: the host work it hides is small next to a CPU step
    (docs/overlap-scheduling.md)."""
    if args.disable_overlap_schedule or args.overlap_schedule == "off":
        return False
    if args.overlap_schedule == "on":
        return True
    return platform(backend).overlap_default(args)


def resolve_speculation(args: ServerArgs, backend: str, overlap_schedule: bool
                        ) -> tuple[str | None, int | None]:
    """--speculative-algorithm -> (drafter name or None, the largest decode batch that drafts or
    None for any); `explain_speculation` says why."""
    return _speculation(args, backend, overlap_schedule)[0], None


def explain_speculation(args: ServerArgs, backend: str, overlap_schedule: bool) -> str:
    """Why speculation resolved as it did (the start-up log and /server_info)."""
    return _speculation(args, backend, overlap_schedule)[1]


def _speculation(args: ServerArgs, backend: str, overlap_schedule: bool
                 ) -> tuple[str | None, str]:
    """auto: SUFFIX on the torch backend on a CPU, where each batch-size bucket drafts only while
    its measured seconds per output token with drafts beat plain steps (speculative.py
    DraftGate): drafts paid 1.3-1.75x on a 2-core AMX CPU, where rows are cheap, and nothing
    on AVX-512/AVX2 CPUs without AMX, where the gate keeps plain steps
    (docs/speculative-decoding.md). Off elsewhere: accelerators run overlap scheduling, which
    speculation excludes (a draft needs the previous step's token), the JAX runner pads a
    verify's rows to its compiled buckets, and --enable-deterministic-inference keeps plain
    steps."""
    algorithm = args.speculative_algorithm
    if algorithm in (None, "none"):
        return None, "off: --speculative-algorithm none"
    if algorithm != "auto":
        return algorithm, (f"{algorithm}: asked for by name; every batch size drafts while a "
                           f"request's acceptance rate pays for its rows")
    if args.enable_deterministic_inference:
        return None, "auto -> off: --enable-deterministic-inference keeps plain steps"
    if backend != "torch":
        return None, f"auto -> off: the {backend} runner pads a verify's rows to its buckets"
    if overlap_schedule or _torch_device_type(args) != "cpu":
        return None, "auto -> off: overlap scheduling runs, and a draft needs the last token"
    return "SUFFIX", ("auto -> SUFFIX, gated: each batch-size bucket drafts only while its "
                      "measured seconds per output token with drafts beat plain steps")


def _is_gguf_checkpoint(model_path: str | None) -> bool:
    if model_path is None:
        return True  # the default model (loader/default_model.py)
    from sgl_tpu.loader import resolve_model_path
    from sgl_tpu.loader.gguf_loader import is_gguf_file

    try:
        path = resolve_model_path(model_path)  # a packaged model's name: its file
    except FileNotFoundError:  # its wheel is missing: loading the model says so
        return False
    return path.is_file() and is_gguf_file(path)


def _resolve_quantization(args: ServerArgs, backend: str, compile: bool) -> str:
    device_type = _torch_device_type(args) if backend == "torch" else "cpu"
    dtype = _resolve_dtype(args, backend)
    return resolve_quantization(args.quantization, backend=backend, device_type=device_type,
                                compile=compile, is_gguf=_is_gguf_checkpoint(args.model_path),
                                dtype=dtype, f32_kernels=_f32_quant_kernels(args, backend,
                                                                            dtype))


def _f32_quant_kernels(args: ServerArgs, backend: str, dtype: str) -> bool:
    """Whether float32 activations would get the compiled block kernels (they load): asked by
    auto and gguf-a8 only."""
    if args.quantization not in ("auto", "gguf-a8") or backend != "torch" or dtype != "float32":
        return False
    return platform(backend).f32_quant_kernels()


def _torch_device_type(args: ServerArgs) -> str:
    return platform("torch").device_type(args)


def runner_config(args: ServerArgs, model_context_len: int, *, num_experts: int = 0,
                  gemma: GemmaConfig | None = None) -> RunnerConfig:
    """The runner's frozen config with backend, dtype, compile, attention and quantization
    resolved; final (runners never rewrite it). `num_experts`: the model's (a mixture of
    experts keeps the packing decode path); `gemma`: a hybrid model's layer kinds (for its
    sliding-window pool)."""
    context_len = min(args.context_length or model_context_len, model_context_len)
    chunk = max(args.chunked_prefill_size, args.min_token_bucket)
    backend = resolve_backend(args.backend)
    deterministic = args.enable_deterministic_inference
    compile = _resolve_compile(args, backend) and not deterministic
    seq_buckets = pow2_buckets(1, args.max_running_requests)
    attention = resolve_attention_backend(args.attention_backend, backend,
                                          _torch_device_type(args) if backend == "torch"
                                          else None)
    if deterministic:
        seq_buckets = batch_invariant.row_buckets(seq_buckets)
        attention = batch_invariant.resolve_attention(args.attention_backend, backend)
    dtype = _resolve_dtype(args, backend)
    lora = _resolve_lora(args, backend, deterministic)
    compile = compile and not lora
    static = _resolve_cuda_graph(args, backend, deterministic or num_experts > 0 or bool(lora))
    pools = _resolve_pools(args, backend, gemma, chunk, bool(static))
    return RunnerConfig(
        model_path=args.model_path,
        dtype=dtype,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        max_extend_seqs=min(args.max_extend_seqs, args.max_running_requests),
        context_len=context_len,
        token_buckets=pow2_buckets(args.min_token_bucket, chunk),
        seq_buckets=seq_buckets,
        kv_tile=max(args.kv_tile, args.page_size),
        block_q=args.block_q,
        max_top_logprobs=args.max_top_logprobs,
        warmup=not args.skip_warmup,
        attention_backend=attention,
        backend=backend,
        compile=compile,
        device=args.device,
        # deterministic: dense weights (the quantized kernels are picked per row count)
        quantization="none" if deterministic else _resolve_quantization(args, backend, compile),
        cpu_threads=args.torch_threads,
        cpu_compute_thread=_resolve_cpu_compute_thread(args, backend),
        tp_size=args.tp_size,
        deterministic=deterministic,
        jax_decode_state=_resolve_jax_decode_state(args, backend),
        kv_cache_dtype=_resolve_kv_cache_dtype(args, backend, dtype),
        **static,
        **pools,
        **lora,
    )


def _resolve_lora(args: ServerArgs, backend: str, deterministic: bool) -> dict:
    """RunnerConfig's LoRA fields (--enable-lora, implied by --lora-paths): slots, rank and
    modules, the rank and modules defaulting to what the --lora-paths adapters use. LoRA runs
    on the torch backend, one device, eagerly (docs/lora.md)."""
    from sgl_tpu.lora import LORA_MODULES, LoraError, parse_lora_paths, read_config

    if not (args.enable_lora or args.lora_paths):
        return {}
    if backend != "torch":
        raise ValueError(f"--enable-lora needs the torch backend (--backend torch); the {backend}"
                         f" backend serves no LoRA adapters")
    why = ("--tp-size 1 and --nnodes 1" if args.tp_size > 1 or args.nnodes > 1
           else "no --enable-deterministic-inference" if deterministic
           else "no --torch-compile on" if args.torch_compile == "on" else None)
    if why is not None:
        raise ValueError(f"--enable-lora needs {why}")
    configs = []
    for _, path in parse_lora_paths(args.lora_paths):
        try:
            configs.append(read_config(path))
        except LoraError as e:
            raise ValueError(f"--lora-paths: {e}") from None
    ranks = [c.get("r") for c in configs if isinstance(c.get("r"), int)]
    modules = set(args.lora_target_modules)
    if not modules:
        for c in configs:
            target = c.get("target_modules")
            modules |= set(target) if isinstance(target, list) else {"all"}
    if not modules or "all" in modules:
        modules = set(LORA_MODULES)
    return dict(max_loras=args.max_loras_per_batch,
                max_lora_rank=args.max_lora_rank or max(ranks, default=16),
                lora_target_modules=tuple(m for m in LORA_MODULES if m in modules))


def swa_pool_blocker(args: ServerArgs, backend: str, gemma: GemmaConfig | None,
                     static_decode: bool) -> str | None:
    """Why a model gets no sliding-window pool (None: it does)."""
    if gemma is None or all(gemma.sliding_layers) or not any(gemma.sliding_layers):
        return "the model has no mix of sliding-window and global layers"
    return ("--disable-hybrid-swa-memory" if args.disable_hybrid_swa_memory
            else "it needs the torch backend" if backend != "torch"
            else "it needs one device (--tp-size 1, --nnodes 1)"
            if args.tp_size > 1 or args.nnodes > 1
            else "the static decode step (CUDA graphs) reads one pool" if static_decode
            else None)


def _resolve_pools(args: ServerArgs, backend: str, gemma: GemmaConfig | None, chunk: int,
                   static_decode: bool) -> dict:
    """RunnerConfig's pool sizes: --max-total-tokens of every layer's K/V, or, for a hybrid
    model, that memory split between the main pool and the sliding-window pool
    (mem_cache/swa_pool.py)."""
    ps = args.page_size
    why = swa_pool_blocker(args, backend, gemma, static_decode)
    split = None if why is not None else pool_split(
        args.max_total_tokens, len(gemma.sliding_layers), sum(gemma.sliding_layers),
        args.swa_full_tokens_ratio,
        # a window and a prefill chunk (a decoding request's window pages stay as many: one
        # page in as one drops out)
        gemma.sliding_window + chunk + 2 * ps, ps)
    if split is None:
        if gemma is not None:
            logger.info("sliding-window pool off (%s): every layer keeps every token",
                        why or "its window pool would leave the global layers no more tokens")
        return {"num_pages": -(-args.max_total_tokens // ps) + 1}
    main, window = split
    logger.info("sliding-window pool: %d tokens of every layer's memory hold %d tokens, "
                "with %d window tokens for the local layers", args.max_total_tokens, main,
                window)
    return {"num_pages": main // ps + 1, "swa_num_pages": window // ps + 1,
            "swa_window": gemma.sliding_window}


def _resolve_cpu_compute_thread(args: ServerArgs, backend: str) -> bool:
    """One compute thread for the torch runner on CPU when its steps overlap (a torch
    tensor-parallel group runs serially)."""
    return (backend == "torch" and args.tp_size == 1 and args.nnodes == 1
            and _torch_device_type(args) == "cpu" and resolve_overlap_schedule(args, backend))


def _resolve_kv_cache_dtype(args: ServerArgs, backend: str, dtype: str) -> str:
    """--kv-cache-dtype: "auto" or a pool element type of sgl_tpu/kv_dtypes.py's table, on the
    backends its entry names (the JAX attention kernels, Pallas included, read pools of the
    compute dtype).

    "auto" is the compute dtype, except where the dtype was left to the machine too (`--dtype
    auto`) and resolved to float32 on a CPU without AMX (torch backend): there the pool
    is bfloat16, half the bytes a decode step's attention streams (as llama.cpp's f16 KV
    default; +0.04% perplexity, docs/quantization.md). An explicit `--dtype float32`
    keeps float32 K/V, and so does deterministic inference (its invariant kernels are checked
    on pools of the compute dtype). `dtype`: the resolved compute dtype."""
    if args.kv_cache_dtype == "auto":
        if (backend == "torch" and args.dtype == "auto" and not args.enable_deterministic_inference
                and dtype == "float32" and _torch_device_type(args) == "cpu"):
            return "bfloat16"
        return "auto"
    why = backend_refusal(args.kv_cache_dtype, backend)
    if why is not None:
        raise ValueError(why)
    return KV_FLAG_DTYPES[args.kv_cache_dtype]


def _resolve_jax_decode_state(args: ServerArgs, backend: str) -> bool:
    """Device-resident decode batch state for the jax backend (`--jax-decode-state`): auto = on
    for accelerators, where a step's host -> device copies cost latency (docs/backends.md); on
    CPU the packing path measured the same and stays the default. Under tensor parallelism on
    one host the state is replicated like the packed batch. Across hosts (`--nnodes`) every
    rank replays rank 0's runner calls in order (parallel/leader.py) and gets the same
    replicated token ids back, so their mirrors make the same diffs and scatter the same rows
    (tests/test_tp_jax_multihost.py)."""
    if backend != "jax" or args.jax_decode_state == "off":
        return False
    if args.jax_decode_state == "on":
        return True
    return platform(backend).decode_state_default(args)


def _resolve_cuda_graph(args: ServerArgs, backend: str, packing_only: bool) -> dict:
    """RunnerConfig's static-decode fields: on for torch on CUDA (one rank) unless
    --disable-cuda-graph or `packing_only` (deterministic inference; mixture-of-experts layers,
    whose routing reads per-expert counts on the host: a sync a CUDA graph cannot record);
    everywhere else the eager step (the flags are accepted)."""
    if backend != "torch" or args.disable_cuda_graph or packing_only or args.tp_size > 1:
        return {}
    if not platform(backend).cuda_graphs(args):
        return {}
    max_bs = min(args.cuda_graph_max_bs or args.max_running_requests, args.max_running_requests)
    return dict(static_decode=True, static_decode_max_bs=max_bs, cuda_graph=True)


def check_deterministic_model(model_config: ModelConfig) -> None:
    """--enable-deterministic-inference covers dense full-attention layers: the invariant
    attention kernels have no sliding window or soft-cap, and expert GEMMs see a row count that
    depends on the batch's routing."""
    why = ("sliding-window / soft-capped attention" if model_config.gemma is not None
           or model_config.sliding_window is not None else
           "mixture-of-experts layers" if model_config.num_experts else None)
    if why:
        raise ValueError(f"--enable-deterministic-inference does not cover {why} yet "
                         f"({model_config.arch!r}); run without it")


def create_model_runner(model_config: ModelConfig, params: dict, config: RunnerConfig
                        ) -> ModelRunner:
    """Build the runner of `config.backend` (already resolved)."""
    spec = EXECUTOR_BACKENDS.get(config.backend)
    if spec is None:
        raise ValueError(f"unknown backend {config.backend!r}")
    if importlib.util.find_spec(spec.requires) is None:
        raise ValueError(f"--backend {config.backend} needs {spec.requires}: {spec.install_hint}")
    if config.deterministic:
        check_deterministic_model(model_config)
    module, _, cls = spec.runner.partition(":")
    factory: Callable[..., ModelRunner] = getattr(importlib.import_module(module), cls)
    return factory(model_config, params, config)
