"""The torch backend's static-shape decode step, captured as CUDA graphs on CUDA.

    SeqSteps (n, one token each) ──DecodeState.sync──► device rows [0, S), pages [:, 0:P)
        S = the smallest batch bucket >= n, P = the smallest page bucket >= every context
    static_forward(S, P)   fixed shapes, no host values, no data-dependent Python:
        positions = rows' cached lengths; KV slots from the page table (gather)
        K/V write (index_copy_) and paged decode attention (the backend's decode_attention
        over [S, P * page_size] gathered keys, masked by length) inside every layer
        ──► logits f32[S, V]                       <- one CUDA graph per (S, P) on CUDA
    sample rows [0, n) (the eager sampler, reading the state's sampling columns on the
    device; uniforms from the state's seeds and steps) ──► penalty counts ──► state.advance

The same `static_forward` runs eagerly on CPU (tests prove it equals the packing path), so
every line a graph records is exercised without a GPU. Graphs share one memory pool, are
captured largest first (at warm-up, or on first use under --skip-warmup) and replayed: a
replay re-runs the recorded kernels on the tensors the capture saw (the state, the KV pools),
which is why the step's inputs live in persistent device tensors updated in place.

Compared with the packing path (runner._decode_batch), the static step has no shared-prefix
split (every row gathers its whole context) and pads contexts to the page bucket; on CPU the
packing path stays the default for that reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from sgl_tpu.config import RunnerConfig, pow2_buckets
from sgl_tpu.executor import step as step_contract
from sgl_tpu.executor.step import SeqStep, StepResult
from sgl_tpu.executor.torch import decode_state as ds
from sgl_tpu.executor.torch import sampler

logger = logging.getLogger(__name__)


def page_buckets(config: RunnerConfig) -> tuple[int, ...]:
    """Page-table widths of the static step: one KV tile's pages, doubling up to the widest
    page table (contexts are padded to one of these)."""
    tile_pages = max(1, config.kv_tile // config.page_size)
    return pow2_buckets(min(tile_pages, config.max_pages_per_seq), config.max_pages_per_seq)


class StaticDecode:
    """Decode steps of at most `config.static_decode_max_bs` sequences over `DecodeState`.

    `model`, `attn`, `kv_pools`, `token_counts` are the runner's (shared, updated in place)."""

    def __init__(self, config: RunnerConfig, model: Any, attn: Any,
                 kv_pools: list[tuple[torch.Tensor, torch.Tensor]], token_counts: torch.Tensor,
                 device: torch.device, dtype: torch.dtype, sliding_window: int | None) -> None:
        self.config = config
        self.model = model
        self.attn = attn
        self.kv_pools = kv_pools
        self.token_counts = token_counts
        self.device = device
        self.dtype = dtype
        self.window = sliding_window
        self.batch_buckets = tuple(b for b in config.seq_buckets
                                   if b <= config.static_decode_max_bs)
        self.page_buckets = page_buckets(config)
        ps = config.page_size
        max_rows = self.batch_buckets[-1] if self.batch_buckets else 1
        self.state = ds.DecodeState(max_rows, self.page_buckets[-1], ps, device)
        self._offsets = torch.arange(ps, dtype=torch.int64, device=device)  # [ps]
        self._key_pos = torch.arange(self.page_buckets[-1] * ps, device=device)  # [Pmax * ps]
        self._no_slots = torch.zeros(0, dtype=torch.int64, device=device)
        self.use_graphs = config.cuda_graph and device.type == "cuda"
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    # ---- which steps ------------------------------------------------------------------
    def accepts(self, steps: Sequence[SeqStep]) -> bool:
        """One new token per sequence, a batch within the largest bucket (else: packing path)."""
        return (bool(self.batch_buckets) and len(steps) <= self.batch_buckets[-1]
                and all(len(st.token_ids) == 1 for st in steps))

    def buckets(self, steps: Sequence[SeqStep]) -> tuple[int, int]:
        ps = self.config.page_size
        num_pages = max(ds.pages_needed(st, ps) for st in steps)
        return (step_contract.pick_bucket(self.batch_buckets, len(steps), "decode batch size"),
                step_contract.pick_bucket(self.page_buckets, num_pages, "decode context pages"))

    # ---- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, steps: Sequence[SeqStep]) -> StepResult:
        n = len(steps)
        num_rows, num_pages = self.buckets(steps)
        self.state.sync(steps, num_rows, num_pages)
        logits = self._logits(num_rows, num_pages)[:n]  # f32[n, V]
        token_ids, logprobs, top_ids, top_lp = self._sample(steps, logits)
        self.state.advance(token_ids)
        result = StepResult(
            token_ids=token_ids.to(torch.int32).cpu().numpy(),
            logprobs=logprobs.cpu().numpy(),
            top_ids=top_ids.to(torch.int32).cpu().numpy(),
            top_logprobs=top_lp.cpu().numpy(),
            hidden=None,
        )
        self.state.advance_mirror(result.token_ids)
        if self.config.check_decode_state:
            self.state.check(steps, result.token_ids, num_rows, num_pages)
        return result

    def _logits(self, num_rows: int, num_pages: int) -> torch.Tensor:
        if not self.use_graphs:
            return self.static_forward(num_rows, num_pages)
        key = (num_rows, num_pages)
        if key not in self._graphs:
            self._graphs[key] = self._capture(num_rows, num_pages)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def static_forward(self, num_rows: int, num_pages: int) -> torch.Tensor:
        """Rows [0, S) of the state, one token each -> logits f32[S, V]; K/V written.

        Reads only persistent device tensors and allocates only fixed-shape temporaries: the
        function a CUDA graph records."""
        ps = self.config.page_size
        st = self.state
        ints = st.ints[:num_rows]
        input_ids = ints[:, ds.IN].contiguous()  # i64[S]
        positions = ints[:, ds.POS].contiguous()  # i64[S]: the cached length = the new index
        table = st.pages[:num_rows, :num_pages]  # i64[S, P]
        out_slots = table.gather(1, (positions // ps)[:, None])[:, 0] * ps + positions % ps
        slots = (table[:, :, None] * ps + self._offsets).reshape(num_rows, num_pages * ps)
        own_len = positions + 1  # padding rows: position 0, length 1 (slot 0, never all-masked)
        key_pos = self._key_pos[: num_pages * ps][None, :]  # [1, P * ps]
        mask = key_pos < own_len[:, None]  # [S, P * ps]
        if self.window is not None:
            mask &= key_pos > (own_len - 1 - self.window)[:, None]
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        bias = bias.masked_fill_(~mask, float("-inf"))[:, None, :]  # [S, 1, P * ps]
        batch = self.attn.DecodeBatch(shared_slots=self._no_slots, slots=slots, bias=bias)
        attention = partial(self.attn.decode_attention, batch=batch, scale=self.model.scale)
        hidden = self.model.forward(input_ids, positions, out_slots, self.kv_pools, attention)
        return self.model.logits(hidden)

    def _sample(self, steps: Sequence[SeqStep], logits: torch.Tensor):
        """The eager sampler over rows [0, n), its per-row knobs read from the state."""
        n = logits.shape[0]
        ints, floats = self.state.ints[:n], self.state.floats[:n]
        rows = ints[:, ds.COUNTS_ROW]
        penalties = None
        if any(st.sampling.uses_penalties for st in steps):
            penalties = (self.token_counts.index_select(0, rows), floats[:, ds.FREQ],
                         floats[:, ds.PRES], floats[:, ds.REP])
        bitmask = None
        if any(st.bitmask is not None for st in steps):
            words = step_contract.mask_words(logits.shape[1])
            mask = np.full((n, words), -1, np.int32)
            for i, st in enumerate(steps):
                if st.bitmask is not None:
                    mask[i] = st.bitmask
            bitmask = torch.from_numpy(mask).to(self.device)
        token_ids, logprobs, top_ids, top_lp = sampler.sample(
            logits,
            temperature=floats[:, ds.TEMP], top_p=floats[:, ds.TOP_P], top_k=ints[:, ds.TOP_K],
            min_p=floats[:, ds.MIN_P],
            uniforms=ds.row_uniforms(ints[:, ds.SEED], ints[:, ds.STEP]),
            penalties=penalties, bitmask=bitmask,
            num_top_logprobs=self.config.max_top_logprobs,
            logprob_rows=ints[:, ds.RET_LP].bool())
        valid = ints[:, ds.VALID].to(torch.int32)
        self.token_counts.index_put_((rows, token_ids), valid, accumulate=True)
        return token_ids, logprobs, top_ids, top_lp

    # ---- CUDA graphs --------------------------------------------------------------------
    def _capture(self, num_rows: int, num_pages: int) -> tuple[Any, torch.Tensor]:
        """Record static_forward(S, P) into a CUDA graph: warm runs on a side stream first
        (compilation, cuBLAS workspaces, cached constants happen outside the capture)."""
        fn = partial(self.static_forward, num_rows, num_pages)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = fn()
        return graph, logits

    @torch.inference_mode()
    def warmup(self) -> float:
        """Capture every (batch bucket, page bucket) graph, largest first (so the smaller
        ones reuse the shared pool); nothing to do without graphs. Returns seconds spent."""
        if not self.use_graphs:
            return 0.0
        t0 = time.perf_counter()
        for num_rows in reversed(self.batch_buckets):
            for num_pages in reversed(self.page_buckets):
                if (num_rows, num_pages) not in self._graphs:
                    self._graphs[(num_rows, num_pages)] = self._capture(num_rows, num_pages)
        elapsed = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs of the decode step (batch buckets %s, page "
                    "buckets %s) in %.1f s", len(self._graphs), self.batch_buckets,
                    self.page_buckets, elapsed)
        return elapsed

    def num_graphs(self) -> int:
        return len(self._graphs)
