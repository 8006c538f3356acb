"""TorchModelRunner: the `--backend torch` executor (PyTorch on tpu / cuda / cpu). Never
imports JAX.

Owns the torch device state and implements `sgl_tpu.executor.step.ModelRunner`:

    list[SeqStep] ──step.build_host_batch──► HostBatch ──+ attention batch──► TorchBatch (rows:
        the token / sequence bucket when compiled, exact when eager)
        ──model.forward──► hidden [T, D]   (the registry's torch model for the architecture;
                                            dense layer parts compiled per bucket with
                                            torch.compile(dynamic=False); attention eager)
        ──logits of the sampled rows──► sampler.sample(HostBatch.sampling) ──► StepResult

Overlap scheduling: `dispatch` runs the step in one worker thread (torch releases the GIL in
its kernels, so the scheduler's host work runs meanwhile); steps run in dispatch order, and a
DECODE step's placeholder input ids are resolved at its start from the token ids the previous
step left on the device (`_last_token_ids`). The static step (below) only enqueues its work on
CUDA and copies its results to pinned host memory without blocking, so the worker launches
step t+1 while the device still runs step t; its `result()` waits for the copies. On CPU
(`config.cpu_compute_thread`) that worker is the compute thread, which runs every torch call
of the runner from its construction on, not only the dispatched steps (compute_thread.py).

Device state: weights (`llama_torch.Weights`), a token-major KV pool per layer
([num_pages * page_size, kvh, d]; page 0 takes padding writes) and the penalty-count rows
([max_running + 1, V] int32, row 0 scratch), all updated in place. With a sliding-window pool
(`config.swa_num_pages`, hybrid models) the local layers' pools hold [swa_num_pages *
page_size, kvh, d] instead, and each step reaches them through the window pages the scheduler
gives each sequence (`SeqStep.swa_pages`, mem_cache/swa_pool.py).

With `config.static_decode` (on for CUDA, where its buckets become CUDA graphs), DECODE steps
of one token per sequence take the static-shape step over device-resident batch state instead
(static_decode.py, decode_state.py); other steps take the packing path above.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from sgl_tpu.backends.torch import invariant_linear, sampler
from sgl_tpu.backends.torch.attention import products as attention_products
from sgl_tpu.backends.torch.compute_thread import ComputeThread
from sgl_tpu.backends.torch.decode_state import row_uniforms
from sgl_tpu.backends.torch.device import (
    cpu_info,
    cpu_prepacks_bf16,
    resolve_device,
    set_cpu_threads,
)
from sgl_tpu.backends.torch.kv_pool import KVPool
from sgl_tpu.backends.torch.lora import LoraStack
from sgl_tpu.backends.torch.paged_attention import shared_align_pages
from sgl_tpu.backends.torch.static_decode import StaticDecode
from sgl_tpu.config import RunnerConfig
from sgl_tpu.executor import batch_invariant
from sgl_tpu.executor import step as step_contract
from sgl_tpu.executor.attention_registry import get_attention_backend
from sgl_tpu.executor.step import ForwardMode, PendingStep, SeqStep, StepResult
from sgl_tpu.kv_dtypes import kv_dtype
from sgl_tpu.lora import LoraAdapter
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.models.registry import torch_model

logger = logging.getLogger(__name__)
T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class _Dispatched:
    """A step handed to the worker thread: `result()` waits for the worker to run (or
    enqueue) it, then for the step's own results."""

    future: Future

    def result(self) -> StepResult:
        return self.future.result().result()


def _by_layer_kind(full: Callable[..., torch.Tensor], local: Callable[..., torch.Tensor],
                   q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   sliding_window: int | None = None, **kwargs: Any) -> torch.Tensor:
    """A hybrid model's attention over a sliding-window pool: local layers (those passing a
    window) read their pool through the window pages, global layers through the main pages."""
    attention = full if sliding_window is None else local
    return attention(q, k_pool, v_pool, sliding_window=sliding_window, **kwargs)


@dataclass(frozen=True)
class TorchBatch:
    """One step's tensors. T = the token bucket (EXTEND) or sequence bucket (DECODE) when
    compiled; the exact count when eager (no compiled shapes to reuse, so no padding)."""

    input_ids: torch.Tensor  # i64[T]
    positions: torch.Tensor  # i64[T]
    out_slots: torch.Tensor  # i64[T]; padding rows write slot 0 (reserved page 0)
    sample_rows: torch.Tensor  # i64[n] row of each real sequence's last token
    extend_seqs: list | None  # EXTEND: the attention backend's ExtendSeq per sequence
    decode: Any  # DECODE: the attention backend's DecodeBatch


class TorchModelRunner:
    backend = "torch"

    def __init__(self, model_config: ModelConfig, params: dict, config: RunnerConfig) -> None:
        # CPU under overlap scheduling: every torch call of this runner on one thread, so the
        # process has one OpenMP team (compute_thread.py); else the caller's thread, and
        # dispatched steps on a worker thread made at the first dispatch
        self._compute = ComputeThread() if config.cpu_compute_thread else None
        self._worker: ComputeThread | None = None  # runs dispatched steps, in order
        self._in_flight: Future | None = None  # the last dispatched step
        try:
            self._call(self._build, model_config, params, config)
        except BaseException:
            self.close()  # no thread outlives a runner that failed to build
            raise

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the compute thread if there is one, else here."""
        return fn(*args) if self._compute is None else self._compute.call(fn, *args)

    def close(self) -> None:
        """End the compute or worker thread (after the calls already given to it)."""
        for thread in (self._compute, self._worker):
            if thread is not None:
                thread.shutdown()

    def _build(self, model_config: ModelConfig, params: dict, config: RunnerConfig) -> None:
        self.model_config = model_config
        if config.static_decode and model_config.num_experts:
            # the registry never builds this config (runner_config's num_experts)
            raise ValueError("the static decode step cannot run mixture-of-experts layers: "
                             "they route on the host (backends/torch/models/moe.py)")
        self.config = config  # as the registry resolved it, never rewritten
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            logger.info("torch backend: %d CPU threads", set_cpu_threads(config.cpu_threads))
        self.dtype = _DTYPES[config.dtype]
        self.vocab_size = model_config.vocab_size
        self.vocab_words = step_contract.mask_words(self.vocab_size)
        self._compiles = 0
        self.attn = get_attention_backend(config.attention_backend)
        compile_fn = self._compile if config.compile else None
        # deterministic on a CPU: projections on the fixed-order GEMM (invariant_linear.py)
        self.invariant_gemm = config.deterministic and self.device.type == "cpu"
        if self.invariant_gemm:
            invariant_linear.require_kernel()
        prepack = (not config.compile and self.device.type == "cpu" and not self.invariant_gemm
                   and self.dtype == torch.bfloat16 and cpu_prepacks_bf16())
        self.quantization = None  # quantize.QuantizationReport when projections are quantized
        self.prepacked = prepack
        self.model = self._build_model(params, model_config, prepack, compile_fn)
        self.layer_ops = self._use_layer_ops()
        # --kv-cache-dtype: K/V stored in the pool's element type as they are written
        # (write_kv / rope_write_kv), widened to the query's dtype as attention reads
        self.kv_pools = self._kv_pool()
        self.decode_layers = self._use_decode_layers()
        self.lora = self._lora_stack() if config.max_loras else None
        self.token_counts = torch.zeros((config.max_running_requests + 1, self.vocab_size),
                                        dtype=torch.int32, device=self.device)
        self.static_decode = None
        if config.static_decode:
            self.static_decode = StaticDecode(
                config, self.model, self.attn, self.kv_pools, self.token_counts, self.device,
                self.dtype, model_config.sliding_window)
        self._last_token_ids: torch.Tensor | None = None  # i64[n] of the last step run
        logger.info("torch backend on %s, %s (KV cache %s), compile=%s, prepacked weights=%s, "
                    "fixed-order GEMM=%s, quantization=%s, fused layer ops=%s, compiled decode "
                    "layers=%s, static decode=%s, CUDA graphs=%s", self.device, config.dtype,
                    config.kv_dtype, config.compile, prepack, self.invariant_gemm,
                    self.quantization.method if self.quantization else "none",
                    self.layer_ops, self.decode_layers, config.static_decode, config.cuda_graph)

    def _lora_stack(self) -> LoraStack:
        """The adapter slots (--enable-lora): Llama-family dense layers, run eagerly."""
        from sgl_tpu.backends.torch.models.llama import LlamaTorch

        if (type(self.model) is not LlamaTorch or self.model_config.num_experts
                or self.model_config.gemma is not None or self.config.compile):
            raise ValueError("LoRA adapters need a dense Llama-family model on one device, run "
                             "eagerly (no --torch-compile on)")
        c = self.config
        return LoraStack(self.model_config, c.max_loras, c.max_lora_rank, c.lora_target_modules,
                         self.device)

    def load_lora(self, lora_id: int, adapter: LoraAdapter) -> None:
        """Give adapter `lora_id` a slot (ValueError when none is free)."""
        self._call(self.lora.load, lora_id, adapter)

    def unload_lora(self, lora_id: int) -> None:
        self._call(self.lora.unload, lora_id)

    def _lora_linear(self, steps: Sequence[SeqStep], host: step_contract.HostBatch):
        """The step's `LoraLinear` (models/llama.py), or None when no sequence has an
        adapter."""
        if self.lora is None or not any(st.lora_id for st in steps):
            return None
        n = host.num_seqs
        ids = np.zeros(len(host.input_ids), np.int64)  # [T] each token row's adapter
        ids[: host.num_tokens] = np.repeat([st.lora_id for st in steps[:n]],
                                           host.extend_lens[:n])
        return partial(self.lora.linear_for, batch=self.lora.batch(ids))

    def _local_layers(self) -> list[bool]:
        """Per layer, whether its K/V lives in the sliding-window pool."""
        gemma = self.model_config.gemma
        if not self.config.swa_num_pages:
            return [False] * self.model_config.num_layers
        if gemma is None:
            raise ValueError("a sliding-window pool needs a model with local and global layers")
        return list(gemma.sliding_layers)

    def _kv_pool(self) -> KVPool:
        """Every layer's K and V pools (the model's own KV head count: a tensor-parallel rank
        stores only its heads)."""
        c, local = self.config, self._local_layers()
        return KVPool(kv_dtype(c.kv_dtype),
                      [(c.swa_num_pages if is_local else c.num_pages) * c.page_size
                       for is_local in local],
                      local, c.page_size, self.model.cfg.num_kv_heads,
                      self.model_config.head_dim, self.device)

    def _build_model(self, params: dict, model_config: ModelConfig, prepack: bool, compile_fn):
        """The registry's torch model for the architecture (backends/torch/tp.py overrides)."""
        return torch_model(model_config.arch).build_model(
            params, model_config, dtype=self.dtype, device=self.device, prepack=prepack,
            write_kv=self.attn.write_kv, compile_fn=compile_fn,
            quantize=(invariant_linear.invariant_weights if self.invariant_gemm
                      else self._quantizer(params, model_config)))

    def _use_layer_ops(self) -> bool:
        """Hand the model the compiled layer ops (backends/torch/kernels/layer_ops_cpu.py) on an
        eager CPU runner when they are built and the model takes them; whether it did."""
        if not self.config.cpu_layer_ops or self.config.compile or self.device.type != "cpu":
            return False
        if not kv_dtype(self.config.kv_dtype).fused_write:
            logger.info("fused layer ops off: they do not write a %s KV pool",
                        self.config.kv_dtype)
            return False
        from sgl_tpu.backends.torch.kernels import layer_ops_cpu

        use = getattr(self.model, "use_layer_ops", None)
        if use is None:
            return False
        if not layer_ops_cpu.usable(self.device, self.dtype):
            logger.info("fused layer ops off: %s", layer_ops_cpu.why_unavailable()
                        or f"{self.dtype} is not one of theirs")
            return False
        return use(layer_ops_cpu.load())

    def _use_decode_layers(self) -> bool:
        """Run decode steps' layers in one compiled call (layer_ops_cpu.decode_layers) when the
        layer ops are in use, attention is the compiled kernel (one pool) and the model can;
        whether it does."""
        use = getattr(self.model, "use_decode_layers", None)
        return bool(self.layer_ops and self.attn.compiled_decode and use is not None
                    and not self.config.swa_num_pages and use(self.kv_pools, self.attn.bf16_dots))

    def _quantizer(self, params: dict, model_config: ModelConfig):
        """Weights -> Weights with quantized projections (`config.quantization`), or None."""
        method = self.config.quantization
        if method == "none":
            return None
        from sgl_tpu.backends.torch import quantize

        matrices = quantize.quantized_matrices(method, params, model_config,
                                               self.config.model_path,
                                               with_head=self.dtype == torch.float32)
        if matrices is None:
            return None

        def apply(weights):
            weights, self.quantization = quantize.quantize_weights(
                weights, matrices,
                quantize.auto_method(self.dtype) if method == "auto" else method, self.dtype)
            return weights

        return apply

    # ---- compilation -------------------------------------------------------------------
    def _compile(self, fn):
        """torch.compile(dynamic=False): one graph per input shape (= bucket), counted."""
        import torch._dynamo

        # 3 compiled functions x (token buckets + sequence buckets) graphs, never evicted.
        limit = 4 * (len(self.config.token_buckets) + len(self.config.seq_buckets))
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)

        def counting_backend(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            self._compiles += 1
            return compile_fx(gm, example_inputs)

        return torch.compile(fn, dynamic=False, backend=counting_backend)

    def num_compilations(self) -> int:
        return self._compiles

    def compute_info(self) -> dict[str, Any]:
        """What `/server_info` reports this runner computes with: device, dtype, the
        projections' GEMM, whether AMX runs them, and on CPUs the ISA oneDNN and the compiled
        kernels use (so a user can tell which published figures apply to their machine)."""
        if self.invariant_gemm:
            gemm = "fixed-order"
        elif self.quantization is not None:
            gemm = f"quantized ({self.quantization.method})"
        else:
            gemm = "oneDNN prepacked" if self.prepacked else "torch"
        info: dict[str, Any] = {"backend": "torch", "device": str(self.device),
                                "dtype": self.config.dtype, "gemm": gemm,
                                "attention": self.attn.name,
                                "attention_products": attention_products(
                                    self.attn.name, self.config.kv_dtype)}
        if self.quantization is not None:
            info["quantization"] = self.quantization.info()
        if self.device.type == "cpu":
            cpu = cpu_info()
            info["cpu"] = cpu
            info["amx_in_use"] = (cpu["onednn"]["amx"] and self.dtype == torch.bfloat16
                                  and not self.invariant_gemm)
            # a decode step's layer loop: one compiled call (for steps of up to max rows: None,
            # any), or Python between the kernels
            info["decode_layers"] = "compiled" if self.decode_layers else "python"
            if self.decode_layers:
                info["decode_layers_max_rows"] = self.model.decode_layers_max_rows
        return info

    @property
    def decode_row_limit(self) -> int | None:
        """The most rows a DECODE step runs on the kernels a one-row step runs on (None: any):
        the scheduler keeps speculative verify rows within it (speculative.py)."""
        return None if self.quantization is None else self.quantization.row_limit()

    @property
    def kv_bytes(self) -> int:
        return self.kv_pools.nbytes

    # ---- KV pages to and from host memory (the lower cache tiers) ------------------------
    def kv_page_layout(self) -> str:
        return self.kv_pools.page_layout()

    def read_kv_pages(self, pages: np.ndarray, out: np.ndarray | None = None,
                      window_pages: np.ndarray | None = None) -> np.ndarray:
        self._wait_in_flight()
        return self._call(self.kv_pools.read_pages, pages, out, window_pages)

    def write_kv_pages(self, pages: np.ndarray, rows: np.ndarray,
                       window_pages: np.ndarray | None = None) -> None:
        self._wait_in_flight()
        self._call(self.kv_pools.write_pages, pages, rows, window_pages)

    def _wait_in_flight(self) -> None:
        """Let a step dispatched to the worker thread finish (its pages are never the ones a
        tier reads or writes, but its kernels run on the same pool tensors)."""
        if self._in_flight is not None:
            futures.wait([self._in_flight])

    # ---- the step's tensors -----------------------------------------------------------
    def _host_batch(self, mode: ForwardMode, steps: Sequence[SeqStep], num_rows: int | None
                    ) -> step_contract.HostBatch:
        """The step's host arrays: `num_rows` token rows (warm-up, deterministic padding), else
        the token / sequence bucket when compiled and the exact count when eager (no compiled
        shapes to reuse); one sequence row per sequence (the sampler reads the real rows only)
        and a page table as wide as the longest sequence's pages (attention runs eagerly)."""
        c = self.config
        if num_rows is None:
            bucket, exact = step_contract.step_rows(
                mode, steps, token_buckets=c.token_buckets, seq_buckets=c.seq_buckets,
                max_extend_seqs=c.max_extend_seqs)
            num_rows = bucket if c.compile else exact
        return step_contract.build_host_batch(
            mode, steps, num_tokens=num_rows, num_seqs=len(steps), page_size=c.page_size,
            max_pages=c.max_pages_per_seq, num_mask_words=self.vocab_words, trim_pages=True)

    def _torch_batch(self, host: step_contract.HostBatch) -> TorchBatch:
        """The HostBatch as this runner's tensors, plus the attention backend's description."""
        dev = self.device
        extend_seqs, decode = self._attention_batch(host, host.page_table)
        return TorchBatch(
            input_ids=torch.from_numpy(host.input_ids).to(dev),
            positions=torch.from_numpy(host.positions).to(dev),
            out_slots=torch.from_numpy(host.out_slots).to(dev),
            sample_rows=torch.from_numpy(host.sample_rows[: host.num_seqs]).to(dev),
            extend_seqs=extend_seqs,
            decode=decode,
        )

    def _attention_batch(self, host: step_contract.HostBatch, page_table: np.ndarray,
                         share: bool = True) -> tuple[list | None, Any]:
        """The attention backend's (extend sequences, decode batch) of the step, over
        `page_table` (the host batch's, or its window pages'); `share`: decode reads the
        pages all sequences share once."""
        ps, dev = self.config.page_size, self.device
        if host.mode != ForwardMode.EXTEND:
            return None, self._decode_batch(host, page_table, share)
        n = host.num_seqs
        return [self.attn.ExtendSeq(
            start=start, num_new=num_new, prefix_len=prefix_len,
            slots=self.attn.context_slots(
                page_table[i, : -(-end // ps)].astype(np.int64), ps, end).to(dev))
            for i, (start, num_new, prefix_len, end) in enumerate(zip(
                host.starts[:n].tolist(), host.extend_lens[:n].tolist(),
                host.prefix_lens[:n].tolist(), host.seq_lens[:n].tolist(), strict=True))], None

    def _window_batch(self, host: step_contract.HostBatch, steps: Sequence[SeqStep]
                      ) -> tuple[torch.Tensor, list | None, Any]:
        """The local layers' (K/V write slots, extend sequences, decode batch): the host
        batch's pages mapped to the window pages the steps carry (padding and dropped pages:
        page 0, which local layers never read: their window masks it)."""
        ps = self.config.page_size
        window_of = np.zeros(self.config.num_pages, np.int64)
        for st in steps:
            if st.swa_pages is not None:
                window_of[np.asarray(st.pages, np.int64)] = st.swa_pages
        out = host.out_slots.astype(np.int64)
        out_slots = torch.from_numpy(window_of[out // ps] * ps + out % ps).to(self.device)
        # (a window masks each sequence's own keys: no shared part)
        extend_seqs, decode = self._attention_batch(host, window_of[host.page_table],
                                                    share=False)
        return out_slots, extend_seqs, decode

    def _decode_batch(self, host: step_contract.HostBatch, page_table: np.ndarray | None = None,
                      share: bool = True) -> Any:
        """Split each context into the whole pages all sequences share (leading page ids equal
        in every page table: a radix-cache prefix) and the rest, [T, Lown] with Lown = the
        longest rest rounded up to whole pages (attention runs eagerly: no bucketing).
        The shared part is a whole number of `DECODE_CHUNK_KEYS`, so every row's attention
        reads its context in the same chunks whatever rows share the step (batch invariance:
        a speculative verify's rows compute what one-row decodes compute).
        `page_table`: the host batch's unless given; `share`: False keeps every page own."""
        ps = self.config.page_size
        page_table = host.page_table if page_table is None else page_table
        n, num_rows = host.num_seqs, len(host.input_ids)
        lens = host.seq_lens[:n]
        need = -(-lens // ps)  # pages holding each context
        # [n, max(need)]; a row's columns past its need may hold pages it does not read yet
        tables = page_table[:n, : need.max()].astype(np.int64)
        common = int(lens.min()) // ps  # whole pages every sequence fills
        differs = (tables[:, :common] != tables[:1, :common]).any(axis=0)
        n_common = int(differs.argmax()) if differs.any() else common
        # a sliding window masks each sequence's own oldest keys: no shared part then
        window = self.model_config.sliding_window
        n_common -= n_common % shared_align_pages(ps)
        n_shared = n_common if n > 1 and window is None and share else 0
        own_pages = int(need.max()) - n_shared
        pages = np.zeros((num_rows, own_pages), np.int64)
        pages[:n] = np.where(np.arange(n_shared, n_shared + own_pages) < need[:, None],
                             tables[:, n_shared:], 0)
        slots = (pages[:, :, None] * ps + np.arange(ps)).reshape(num_rows, own_pages * ps)
        own_lens = np.ones(num_rows, np.int64)  # padding rows see slot 0 (never all-masked)
        own_lens[:n] = lens - n_shared * ps
        mask = np.arange(own_pages * ps)[None, :] < own_lens[:, None]
        if window is not None:
            mask &= np.arange(own_pages * ps)[None, :] > own_lens[:, None] - 1 - window
        bias = np.where(mask, np.float32(0), np.float32(-np.inf))[:, None, :]
        shared = (tables[0, :n_shared, None] * ps + np.arange(ps)).reshape(-1)
        dev = self.device
        return self.attn.DecodeBatch(shared_slots=torch.from_numpy(shared).to(dev),
                                slots=torch.from_numpy(slots).to(dev),
                                bias=torch.from_numpy(bias).to(dev, self.dtype))

    # ---- steps -------------------------------------------------------------------------
    def forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> StepResult:
        if self._compute is not None:  # (taken after the steps dispatched before it)
            return self._compute.call(self._forward_done, mode, steps).result()
        if self._in_flight is not None:  # keep the order of dispatched steps
            futures.wait([self._in_flight])  # (its error, if any, went to its caller)
            self._in_flight = None
        return self._forward(mode, steps).result()

    def dispatch(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> PendingStep:
        """Start the step in the worker thread; `result()` waits for its StepResult."""
        if self._compute is not None:  # (in order with every other call given to it)
            return _Dispatched(self._compute.submit(self._forward_done, mode, steps))
        if self._worker is None:
            self._worker = ComputeThread("torch-step", one_arena=False)
        self._in_flight = self._worker.submit(self._forward, mode, steps)
        return _Dispatched(self._in_flight)

    def _forward_done(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> PendingStep:
        """`_forward` and its results, on the compute thread."""
        return step_contract.DoneStep(self._forward(mode, steps).result())

    def _forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> PendingStep:
        """Run (or, for the static step on CUDA, enqueue) one step."""
        if (mode == ForwardMode.DECODE and self.static_decode is not None
                and self.static_decode.accepts(steps)):
            return self._run_static(steps)
        if self.static_decode is not None:  # its mirror's placeholders no longer name the
            self.static_decode.state.mirror.dispatched(None)  # last step's rows
        if self.config.deterministic and len(steps) < batch_invariant.MIN_ROWS:
            padded, num_rows = batch_invariant.pad_steps(mode, steps)
            return step_contract.DoneStep(
                batch_invariant.trim_result(self._run(mode, padded, num_rows), len(steps)))
        return step_contract.DoneStep(self._run(mode, steps, None))

    def _run_static(self, steps: Sequence[SeqStep]) -> PendingStep:
        """The static decode step, launched: placeholder inputs are resolved on the device
        from the last step's token ids (which stay there), so on CUDA this step is enqueued
        behind the previous one without waiting for its tokens to reach the host."""
        pending = self.static_decode.launch(steps, self._last_token_ids)
        self._last_token_ids = pending.device_token_ids
        return pending

    @torch.inference_mode()
    def _run(self, mode: ForwardMode, steps: Sequence[SeqStep], num_rows: int | None
             ) -> StepResult:
        host = self._host_batch(mode, steps, num_rows)
        batch = self._torch_batch(host)
        input_ids = batch.input_ids
        if step_contract.has_placeholders(steps):
            prev = self._last_token_ids  # [n_prev]
            input_ids = torch.where(input_ids < 0, prev[(-input_ids - 1).clamp(min=0)],
                                    input_ids)
        attention = self._attention(mode, batch.extend_seqs, batch.decode)
        window_args = {}
        if mode != ForwardMode.EXTEND and self.decode_layers:
            window_args = {"decode_batch": batch.decode}
        if self.config.swa_num_pages:  # local layers: their own slots and attention batch
            local_out_slots, extend_seqs, decode = self._window_batch(host, steps)
            attention = partial(_by_layer_kind, attention,
                                self._attention(mode, extend_seqs, decode))
            window_args = {"local_out_slots": local_out_slots}
        lora = self._lora_linear(steps, host)
        if lora is not None:
            window_args["lora"] = lora
        hidden = self.model.forward(input_ids, batch.positions, batch.out_slots,
                                    self.kv_pools, attention, **window_args)
        logits = self.model.logits(hidden.index_select(0, batch.sample_rows))  # [n, V]
        token_ids, logprobs, top_ids, top_lp = self._sample(mode, host.sampling, logits)
        self._last_token_ids = token_ids
        return StepResult(
            token_ids=token_ids.to(torch.int32).cpu().numpy(),
            logprobs=logprobs.cpu().numpy(),
            top_ids=top_ids.to(torch.int32).cpu().numpy(),
            top_logprobs=top_lp.cpu().numpy(),
            hidden=hidden if mode == ForwardMode.EXTEND else None,
        )

    def _attention(self, mode: ForwardMode, extend_seqs: list | None, decode: Any
                   ) -> Callable[..., torch.Tensor]:
        """The step's attention with its batch bound in."""
        scale = self.model.scale
        if mode != ForwardMode.EXTEND:
            return partial(self.attn.decode_attention, batch=decode, scale=scale)
        attention = partial(self.attn.extend_attention, seqs=extend_seqs, scale=scale)
        if self.model_config.sliding_window is not None:
            attention = partial(attention, sliding_window=self.model_config.sliding_window)
        return attention

    def _sample(self, mode: ForwardMode, cols: step_contract.SamplingColumns,
                logits: torch.Tensor):
        dev = self.device

        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(a).to(device=dev, dtype=dtype)

        rows = t(cols.counts_rows, torch.int64)
        if mode == ForwardMode.EXTEND and cols.counts_reset.any():
            self.token_counts[cols.counts_rows[cols.counts_reset].tolist()] = 0
        penalties = None
        if cols.uses_penalties:
            penalties = (self.token_counts.index_select(0, rows),
                         t(cols.frequency_penalty, torch.float32),
                         t(cols.presence_penalty, torch.float32),
                         t(cols.repetition_penalty, torch.float32))
        token_ids, logprobs, top_ids, top_lp = sampler.sample(
            logits,
            temperature=t(cols.temperature, torch.float32),
            top_p=t(cols.top_p, torch.float32),
            top_k=t(cols.top_k, torch.int64),
            min_p=t(cols.min_p, torch.float32),
            uniforms=row_uniforms(t(cols.seed.astype(np.int64), torch.int64),
                                  t(cols.step.astype(np.int64), torch.int64)),
            penalties=penalties,
            bitmask=None if cols.bitmask is None else t(cols.bitmask, torch.int32),
            num_top_logprobs=self.config.max_top_logprobs,
            logprob_rows=t(cols.return_logprob, torch.bool),
        )
        valid = t(cols.sample_valid, torch.int32)
        self.token_counts.index_put_((rows, token_ids), valid, accumulate=True)
        return token_ids, logprobs, top_ids, top_lp

    def token_logprobs(self, hidden: torch.Tensor, target_ids: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._call(self._token_logprobs, hidden, target_ids)

    @torch.inference_mode()
    def _token_logprobs(self, hidden: torch.Tensor, target_ids: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        targets = torch.zeros(hidden.shape[0], dtype=torch.int64, device=self.device)
        targets[: len(target_ids)] = torch.as_tensor(np.asarray(target_ids, np.int64))
        logp = torch.log_softmax(self.model.logits(hidden), dim=-1)  # [T, V]
        chosen = logp.gather(1, targets[:, None])[:, 0]
        top_lp, top_ids = torch.topk(logp, self.config.max_top_logprobs, dim=-1)
        return (chosen.cpu().numpy(), top_ids.to(torch.int32).cpu().numpy(),
                top_lp.cpu().numpy())

    def row_logits(self, hidden: torch.Tensor, rows: np.ndarray) -> np.ndarray:
        return self._call(self._row_logits, hidden, rows)

    @torch.inference_mode()
    def _row_logits(self, hidden: torch.Tensor, rows: np.ndarray) -> np.ndarray:
        idx = torch.as_tensor(np.asarray(rows, np.int64), device=self.device)
        return self.model.logits(hidden.index_select(0, idx)).cpu().numpy()

    def hidden_rows(self, hidden: torch.Tensor, rows: np.ndarray) -> np.ndarray:
        return self._call(self._hidden_rows, hidden, rows)

    @torch.inference_mode()
    def _hidden_rows(self, hidden: torch.Tensor, rows: np.ndarray) -> np.ndarray:
        idx = torch.as_tensor(np.asarray(rows, np.int64), device=self.device)
        return hidden.index_select(0, idx).float().cpu().numpy()

    # ---- warm-up -----------------------------------------------------------------------
    def warmup(self) -> float:
        """Run every token bucket (EXTEND) and sequence bucket (DECODE) once with the dummy
        step on reserved page 0, compiling each shape when compile is on."""
        return self._call(self._warmup)

    def _warmup(self) -> float:
        t0 = time.perf_counter()
        step = step_contract.warmup_step()
        c = self.config
        all_buckets = c.compile  # eager: one run of each mode is enough
        for num_rows in c.token_buckets if all_buckets else c.token_buckets[:1]:
            result = self._run(ForwardMode.EXTEND, [step], num_rows)
            self.token_logprobs(result.hidden, np.zeros(1, np.int32))
        for n_seqs in c.seq_buckets if all_buckets else c.seq_buckets[:1]:
            self._run(ForwardMode.DECODE, [step] * n_seqs, n_seqs)
        if self.static_decode is not None:  # CUDA graphs of the decode buckets (else no-op)
            self.static_decode.warmup()
        elapsed = time.perf_counter() - t0
        logger.info("warm-up: %d compiled graphs in %.1f s", self._compiles, elapsed)
        return elapsed
