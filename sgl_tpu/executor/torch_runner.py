"""TorchModelRunner: the `--backend torch` executor (PyTorch on tpu / cuda / cpu).

Owns the torch device state and implements `sgl_tpu.executor.runner.ModelRunner`:

    list[SeqStep] ──_pack──► TorchBatch (tensors padded to the token / sequence bucket)
        ──LlamaTorch.forward──► hidden [T, D]   (dense layer parts compiled per bucket with
                                                 torch.compile(dynamic=False); attention eager)
        ──logits of the sampled rows──► torch_sampler.sample ──► StepResult (numpy)

Device state: weights (`llama_torch.Weights`), a token-major KV pool per layer
([num_pages * page_size, kvh, d]; page 0 takes padding writes) and the penalty-count rows
([max_running + 1, V] int32, row 0 scratch), all updated in place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from sgl_tpu.config import RunnerConfig
from sgl_tpu.executor import torch_sampler
from sgl_tpu.executor.forward_batch import pick_bucket
from sgl_tpu.executor.runner import StepResult
from sgl_tpu.executor.torch_device import resolve_device, set_cpu_threads
from sgl_tpu.kernels import paged_attention_torch as attn
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.models.llama_torch import LlamaTorch, convert_weights
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.scheduler.schedule_batch import ForwardMode, SeqStep

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TorchBatch:
    """One step's tensors. T = the token bucket (EXTEND) or sequence bucket (DECODE) when
    compiled; the exact count when eager (no compiled shapes to reuse, so no padding)."""

    input_ids: torch.Tensor  # i64[T]
    positions: torch.Tensor  # i64[T]
    out_slots: torch.Tensor  # i64[T]; padding rows write slot 0 (reserved page 0)
    sample_rows: torch.Tensor  # i64[n] row of each real sequence's last token
    extend_seqs: list[attn.ExtendSeq] | None  # EXTEND
    decode: attn.DecodeBatch | None  # DECODE


class TorchModelRunner:
    backend = "torch"

    def __init__(self, model_config: ModelConfig, params: dict, config: RunnerConfig) -> None:
        self.model_config = model_config
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            logger.info("torch backend: %d CPU threads", set_cpu_threads())
        self.dtype = _DTYPES[config.dtype]
        self.vocab_size = model_config.vocab_size
        self._compiles = 0
        compile_fn = self._compile if config.compile else None
        prepack = (not config.compile and self.device.type == "cpu"
                   and self.dtype == torch.bfloat16)
        weights = convert_weights(params, model_config, self.dtype, self.device, prepack)
        self.model = LlamaTorch(model_config, weights, compile_fn)
        num_slots = config.num_pages * config.page_size
        shape = (num_slots, model_config.num_kv_heads, model_config.head_dim)
        self.kv_pools = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                          torch.zeros(shape, dtype=self.dtype, device=self.device))
                         for _ in range(model_config.num_layers)]
        self.token_counts = torch.zeros((config.max_running_requests + 1, self.vocab_size),
                                        dtype=torch.int32, device=self.device)
        logger.info("torch backend on %s, %s, compile=%s, prepacked weights=%s", self.device,
                    config.dtype, config.compile, prepack)

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

    @property
    def kv_bytes(self) -> int:
        k, _ = self.kv_pools[0]
        return 2 * k.numel() * k.element_size() * len(self.kv_pools)

    # ---- packing -----------------------------------------------------------------------
    def _pack(self, mode: ForwardMode, steps: Sequence[SeqStep], num_rows: int | None
              ) -> TorchBatch:
        c = self.config
        ps = c.page_size
        n = len(steps)
        if num_rows is None:  # (warm-up passes a bucket)
            num_rows = self._num_rows(mode, steps)
        input_ids = np.zeros(num_rows, np.int64)
        positions = np.zeros(num_rows, np.int64)
        out_slots = np.zeros(num_rows, np.int64)
        sample_rows = np.zeros(n, np.int64)
        extend_seqs = []
        t = 0
        for i, st in enumerate(steps):
            k = len(st.token_ids)
            end = st.prefix_len + k
            pages = np.asarray(st.pages, np.int64)
            if len(pages) * ps < end or len(pages) > c.max_pages_per_seq:
                raise ValueError(f"sequence {i}: {len(pages)} pages cannot hold {end} tokens")
            pos = np.arange(st.prefix_len, end)
            input_ids[t : t + k] = st.token_ids
            positions[t : t + k] = pos
            out_slots[t : t + k] = pages[pos // ps] * ps + pos % ps
            sample_rows[i] = t + k - 1
            if mode == ForwardMode.EXTEND:
                extend_seqs.append(attn.ExtendSeq(
                    start=t, num_new=k, prefix_len=st.prefix_len,
                    slots=attn.context_slots(pages, ps, end).to(self.device)))
            t += k
        decode = self._decode_batch(steps, num_rows) if mode == ForwardMode.DECODE else None
        dev = self.device
        return TorchBatch(
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            out_slots=torch.from_numpy(out_slots).to(dev),
            sample_rows=torch.from_numpy(sample_rows).to(dev),
            extend_seqs=extend_seqs if mode == ForwardMode.EXTEND else None,
            decode=decode,
        )

    def _num_rows(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> int:
        """Rows T of a step: its bucket (validated against the largest) when compiled."""
        c = self.config
        if mode == ForwardMode.DECODE:
            exact = len(steps)
            bucket = pick_bucket(c.seq_buckets, exact, "decode batch size")
        else:
            if len(steps) > c.max_extend_seqs:
                raise ValueError(f"{len(steps)} sequences exceed max_extend_seqs "
                                 f"{c.max_extend_seqs}")
            exact = sum(len(st.token_ids) for st in steps)
            bucket = pick_bucket(c.token_buckets, exact, "extend batch tokens")
        return bucket if c.compile else exact

    def _decode_batch(self, steps: Sequence[SeqStep], num_rows: int) -> attn.DecodeBatch:
        """Split each context into the whole pages all sequences share (leading page ids equal
        in every page table: a radix-cache prefix) and the rest, [B, Lown] with Lown = the
        longest rest rounded up to whole pages (attention runs eagerly: no bucketing)."""
        ps = self.config.page_size
        lens = np.array([st.prefix_len + len(st.token_ids) for st in steps])
        tables = [np.asarray(st.pages, np.int64)[: -(-n // ps)]
                  for st, n in zip(steps, lens, strict=True)]
        first = tables[0][: min(lens) // ps]  # whole pages every sequence fills
        for t in tables[1:]:
            same = first == t[: len(first)]
            first = first[: len(first) if same.all() else int(same.argmin())]
        n_shared = len(first) if len(steps) > 1 else 0
        own_pages = max(len(t) for t in tables) - n_shared
        pages = np.zeros((num_rows, own_pages), np.int64)
        for i, t in enumerate(tables):
            pages[i, : len(t) - n_shared] = t[n_shared:]
        slots = (pages[:, :, None] * ps + np.arange(ps)).reshape(num_rows, own_pages * ps)
        own_lens = np.ones(num_rows, np.int64)  # padding rows see slot 0 (never all-masked)
        own_lens[: len(steps)] = lens - n_shared * ps
        mask = np.arange(own_pages * ps)[None, :] < own_lens[:, None]
        shared = (first[:n_shared, None] * ps + np.arange(ps)).reshape(-1)
        dev = self.device
        return attn.DecodeBatch(shared_slots=torch.from_numpy(shared).to(dev),
                                slots=torch.from_numpy(slots).to(dev),
                                mask=torch.from_numpy(mask[:, None, :]).to(dev))

    # ---- steps -------------------------------------------------------------------------
    def forward(self, mode: ForwardMode, steps: Sequence[SeqStep]) -> StepResult:
        return self._run(mode, steps, None)

    @torch.inference_mode()
    def _run(self, mode: ForwardMode, steps: Sequence[SeqStep], num_rows: int | None
             ) -> StepResult:
        batch = self._pack(mode, steps, num_rows)
        scale = self.model.scale
        if mode == ForwardMode.EXTEND:
            attention = partial(_extend, seqs=batch.extend_seqs, scale=scale)
        else:
            attention = partial(_decode, batch=batch.decode, scale=scale)
        hidden = self.model.forward(batch.input_ids, batch.positions, batch.out_slots,
                                    self.kv_pools, attention)
        logits = self.model.logits(hidden.index_select(0, batch.sample_rows))  # [n, V]
        token_ids, logprobs, top_ids, top_lp = self._sample(mode, steps, logits)
        return StepResult(
            token_ids=token_ids.to(torch.int32).cpu().numpy(),
            logprobs=logprobs.cpu().numpy(),
            top_ids=top_ids.to(torch.int32).cpu().numpy(),
            top_logprobs=top_lp.cpu().numpy(),
            hidden=hidden if mode == ForwardMode.EXTEND else None,
        )

    def _sample(self, mode: ForwardMode, steps: Sequence[SeqStep], logits: torch.Tensor):
        dev = self.device

        def col(fn, dtype):
            return torch.tensor([fn(s) for s in steps], dtype=dtype, device=dev)

        rows = col(lambda s: s.counts_row, torch.int64)
        if mode == ForwardMode.EXTEND:
            reset = [s.counts_row for s in steps if s.counts_reset]
            if reset:
                self.token_counts[reset] = 0
        penalties = None
        if any(s.sampling.uses_penalties for s in steps):
            penalties = (self.token_counts.index_select(0, rows),
                         col(lambda s: s.sampling.frequency_penalty, torch.float32),
                         col(lambda s: s.sampling.presence_penalty, torch.float32),
                         col(lambda s: s.sampling.repetition_penalty, torch.float32))
        bitmask = None
        if any(s.bitmask is not None for s in steps):
            words = -(-self.vocab_size // 32)
            mask = np.full((len(steps), words), -1, np.int32)
            for i, s in enumerate(steps):
                if s.bitmask is not None:
                    mask[i] = s.bitmask
            bitmask = torch.from_numpy(mask).to(dev)
        seeds = np.array([s.seed & 0xFFFFFFFF for s in steps], np.uint64)
        step_idx = np.array([s.num_output_tokens for s in steps], np.uint64)
        token_ids, logprobs, top_ids, top_lp = torch_sampler.sample(
            logits,
            temperature=col(lambda s: s.sampling.temperature, torch.float32),
            top_p=col(lambda s: s.sampling.top_p, torch.float32),
            top_k=col(lambda s: s.sampling.top_k, torch.int64),
            min_p=col(lambda s: s.sampling.min_p, torch.float32),
            uniforms=torch.from_numpy(torch_sampler.row_uniforms(seeds, step_idx)).to(dev),
            penalties=penalties,
            bitmask=bitmask,
            num_top_logprobs=self.config.max_top_logprobs,
        )
        valid = col(lambda s: s.sample_valid, torch.int32)
        self.token_counts.index_put_((rows, token_ids), valid, accumulate=True)
        return token_ids, logprobs, top_ids, top_lp

    @torch.inference_mode()
    def token_logprobs(self, hidden: torch.Tensor, target_ids: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        targets = torch.zeros(hidden.shape[0], dtype=torch.int64, device=self.device)
        targets[: len(target_ids)] = torch.as_tensor(np.asarray(target_ids, np.int64))
        logp = torch.log_softmax(self.model.logits(hidden), dim=-1)  # [T, V]
        chosen = logp.gather(1, targets[:, None])[:, 0]
        top_lp, top_ids = torch.topk(logp, self.config.max_top_logprobs, dim=-1)
        return (chosen.cpu().numpy(), top_ids.to(torch.int32).cpu().numpy(),
                top_lp.cpu().numpy())

    @torch.inference_mode()
    def row_logits(self, hidden: torch.Tensor, rows: np.ndarray) -> np.ndarray:
        idx = torch.as_tensor(np.asarray(rows, np.int64), device=self.device)
        return self.model.logits(hidden.index_select(0, idx)).cpu().numpy()

    # ---- warm-up -----------------------------------------------------------------------
    def warmup(self) -> float:
        """Run every token bucket (EXTEND) and sequence bucket (DECODE) once with a dummy
        sequence on reserved page 0, compiling each shape when compile is on."""
        t0 = time.perf_counter()
        step = SeqStep(token_ids=[0], prefix_len=0, pages=np.zeros(1, np.int64),
                       sampling=SamplingParams(temperature=0.0, max_new_tokens=1), seed=0,
                       num_output_tokens=0, sample_valid=False)
        c = self.config
        all_buckets = c.compile  # eager: one run of each mode is enough
        for num_rows in c.token_buckets if all_buckets else c.token_buckets[:1]:
            result = self._run(ForwardMode.EXTEND, [step], num_rows)
            self.token_logprobs(result.hidden, np.zeros(1, np.int32))
        for n_seqs in c.seq_buckets if all_buckets else c.seq_buckets[:1]:
            self._run(ForwardMode.DECODE, [step] * n_seqs, n_seqs)
        elapsed = time.perf_counter() - t0
        logger.info("warm-up: %d compiled graphs in %.1f s", self._compiles, elapsed)
        return elapsed


def _extend(q, k_pool, v_pool, *, seqs, scale):
    return attn.extend_attention(q, k_pool, v_pool, seqs, scale)


def _decode(q, k_pool, v_pool, *, batch, scale):
    return attn.decode_attention(q, k_pool, v_pool, batch, scale)
