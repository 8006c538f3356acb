"""The torch backend's static-shape decode step, captured as CUDA graphs on CUDA.

    SeqSteps (n, one token each) ──DecodeState.sync──► device rows [0, S), pages [:, 0:P)
        S = the smallest batch bucket >= n, P = the smallest page bucket >= every context
    static_forward(S, P)   fixed shapes, no host values, no data-dependent Python:
        positions = rows' cached lengths; KV slots from the page table (gather)
        K/V write (index_copy_) and paged decode attention (the backend's decode_attention
        over [S, P * page_size] gathered keys, masked by length) inside every layer
        ──► logits f32[S, V] (a persistent buffer)  <- one CUDA graph per (S, P) on CUDA
    then, every row greedy with no penalty and no grammar mask (the common case):
    greedy_tail(S)  argmax, log-probs, penalty counts, state.advance  <- one graph per S
    else, no grammar mask (sampling, penalties, greedy rows among them):
    sample_tail(S)  sampler.sample_static: tokens, log-probs (every truncation, exact
                    thresholds included), penalty counts, state.advance  <- one graph per S
    else (a grammar mask: host data of this step): the rows' masks copied into a persistent
    mask buffer, then
    sample_tail(S, masked)  the same over the masked logits        <- one graph per S

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

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from sgl_tpu.backends.torch import decode_state as ds
from sgl_tpu.backends.torch import sampler
from sgl_tpu.config import RunnerConfig, pow2_buckets
from sgl_tpu.executor import step as step_contract
from sgl_tpu.executor.step import SeqStep, StepResult

logger = logging.getLogger(__name__)


def page_buckets(config: RunnerConfig) -> tuple[int, ...]:
    """Page-table widths of the static step: one KV tile's pages, doubling up to the widest
    page table a sequence can fill (contexts are padded to one of these): the model's
    context, or the KV pool's usable pages where the pool is smaller (each width's graph holds
    the gathered keys and values of that width for every row, so a width no sequence can
    reach would only reserve device memory)."""
    widest = max(1, min(config.max_pages_per_seq, config.num_pages - 1))
    tile_pages = max(1, config.kv_tile // config.page_size)
    return pow2_buckets(min(tile_pages, widest), widest)


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
        self._logits = torch.zeros((max_rows, model.cfg.vocab_size), dtype=torch.float32,
                                   device=device)  # [Smax, V] written by static_forward
        self._masks = torch.full((max_rows, step_contract.mask_words(model.cfg.vocab_size)), -1,
                                 dtype=torch.int32, device=device)  # [Smax, W] of masked steps
        self.use_graphs = config.cuda_graph and device.type == "cuda"
        # (S, P): static_forward; (S, "greedy" | "sample" | "masked"): a tail
        self._graphs: dict[tuple[int, int | str], tuple[Any, Any]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.tails: Counter[str] = Counter()  # steps per tail taken: greedy, sample, masked

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
    def _on_device(self):
        """The runner's CUDA device made current (a thread starts on device 0: captures,
        replays and events follow the current device's stream); nothing on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    @torch.inference_mode()
    def launch(self, steps: Sequence[SeqStep], prev_token_ids: torch.Tensor | None
               ) -> PendingStatic:
        """Enqueue the step: rows synced (placeholder inputs resolved on the device from
        `prev_token_ids` i64[n_prev], the last step's tokens there), forward, a tail, and
        the copies of its results to the host. On CUDA nothing here waits for the device, so
        the next step can be launched behind this one."""
        with self._on_device():
            return self._launch(steps, prev_token_ids)

    def _launch(self, steps: Sequence[SeqStep], prev_token_ids: torch.Tensor | None
                ) -> PendingStatic:
        n = len(steps)
        num_rows, num_pages = self.buckets(steps)
        self.state.sync(steps, num_rows, num_pages, prev_token_ids)
        self._replay((num_rows, num_pages), partial(self.static_forward, num_rows, num_pages))
        if _plain_greedy(steps):
            self.tails["greedy"] += 1
            out = self._replay((num_rows, "greedy"), partial(self.greedy_tail, num_rows))
        elif all(st.bitmask is None for st in steps):
            self.tails["sample"] += 1
            out = self._replay((num_rows, "sample"), partial(self.sample_tail, num_rows))
        else:
            self.tails["masked"] += 1
            self._load_masks(steps, num_rows)
            out = self._replay((num_rows, "masked"),
                               partial(self.sample_tail, num_rows, masked=True))
        out = tuple(t[:n] for t in out)  # token ids, log-probs, top ids, top log-probs
        serial = self.state.mirror.dispatched(n)
        pending = PendingStatic(self.state, serial, out[0], *_to_host(out))
        if self.config.check_decode_state:
            token_ids = out[0].cpu().numpy()
            self.state.check(steps, token_ids, num_rows, num_pages)
        return pending

    def _replay(self, key: tuple[int, int], fn):
        """fn() eagerly, or on CUDA the replay of its graph (captured on first use); returns
        fn's outputs (the graph's static output tensors)."""
        if not self.use_graphs:
            return fn()
        if key not in self._graphs:
            self._graphs[key] = self._capture(fn)
        graph, out = self._graphs[key]
        graph.replay()
        return out

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
        return self._logits[:num_rows].copy_(self.model.logits(hidden))

    def greedy_tail(self, num_rows: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sampler's greedy path over all S rows of the logits buffer, fixed shapes:
        argmax, raw log-probs (zeros on rows that did not ask, as the sampler gives), penalty
        counts of valid rows, state advance; -> token ids i64[S], log-probs f32[S], top ids
        i64[S, K], top log-probs f32[S, K]."""
        logits = self._logits[:num_rows]
        token_ids = logits.argmax(dim=-1)  # [S]
        want = self.state.ints[:num_rows, ds.RET_LP].bool()
        out = sampler.logprobs_static(logits, token_ids, want, self.config.max_top_logprobs)
        self.commit(token_ids)
        return token_ids, *out

    def sample_tail(self, num_rows: int, masked: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """sampler.sample_static over all S rows of the logits buffer, every knob from the
        state's columns (penalty counts from its counts rows; `masked`: the mask buffer's
        rows), then the commit -> token ids i64[S], log-probs f32[S], top ids i64[S, K], top
        log-probs f32[S, K]."""
        ints, floats = self.state.ints[:num_rows], self.state.floats[:num_rows]
        penalties = (self.token_counts.index_select(0, ints[:, ds.COUNTS_ROW]),
                     floats[:, ds.FREQ], floats[:, ds.PRES], floats[:, ds.REP])
        out = sampler.sample_static(
            self._logits[:num_rows],
            temperature=floats[:, ds.TEMP], top_p=floats[:, ds.TOP_P], top_k=ints[:, ds.TOP_K],
            min_p=floats[:, ds.MIN_P], uniforms=ds.row_uniforms(ints[:, ds.SEED],
                                                               ints[:, ds.STEP]),
            penalties=penalties, num_top_logprobs=self.config.max_top_logprobs,
            logprob_rows=ints[:, ds.RET_LP].bool(),
            bitmask=self._masks[:num_rows] if masked else None)
        self.commit(out[0])
        return out

    def _load_masks(self, steps: Sequence[SeqStep], num_rows: int) -> None:
        """The steps' grammar masks into rows [0, S) of the mask buffer (every token allowed
        in the other rows): one host-to-device copy, enqueued before the tail's replay."""
        masks = np.full((num_rows, self._masks.shape[1]), -1, np.int32)  # [S, W]
        for i, st in enumerate(steps):
            if st.bitmask is not None:
                masks[i] = st.bitmask
        self._masks[:num_rows].copy_(ds.upload(masks, self.device))

    def commit(self, token_ids: torch.Tensor) -> None:
        """The chosen tokens i64[S] into the penalty counts of valid rows, and the state one
        token further; fixed shapes."""
        ints = self.state.ints[: token_ids.shape[0]]
        valid = (ints[:, ds.VALID] * ints[:, ds.ACTIVE]).to(torch.int32)
        cells = ints[:, ds.COUNTS_ROW] * self.token_counts.shape[1] + token_ids  # [S]
        self.token_counts.view(-1).scatter_add_(0, cells, valid)  # a plain kernel: capturable
        self.state.advance(token_ids)

    # ---- CUDA graphs --------------------------------------------------------------------
    def _capture(self, fn) -> tuple[Any, Any]:
        """Record fn() into a CUDA graph; -> (graph, fn's output tensors). One warm run on a
        side stream first (compilation, cuBLAS workspaces, cached constants happen outside
        the capture). The warm run of the tail advances the state as a step would, so the
        tail is captured with the state saved and restored around it."""
        saved = self.state.ints.clone()
        counts = self.token_counts.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: under overlap scheduling the scheduler thread waits on the last step's
        # copy event while this (the worker) thread captures a bucket first met mid-traffic
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn()
        self.state.ints.copy_(saved)
        self.token_counts.copy_(counts)
        return graph, out

    @torch.inference_mode()
    def warmup(self) -> float:
        """Capture every (batch bucket, page bucket) forward graph and each batch bucket's
        three tails, largest first (so the smaller ones reuse the shared pool); nothing to do
        without graphs. The replays that follow each capture find an all-padding state (no
        active row): they change nothing. Returns seconds spent."""
        if not self.use_graphs:
            return 0.0
        with self._on_device():
            return self._warmup()

    def _warmup(self) -> float:
        t0 = time.perf_counter()
        for num_rows in reversed(self.batch_buckets):
            for num_pages in reversed(self.page_buckets):
                self._replay((num_rows, num_pages),
                             partial(self.static_forward, num_rows, num_pages))
            self._replay((num_rows, "greedy"), partial(self.greedy_tail, num_rows))
            self._replay((num_rows, "sample"), partial(self.sample_tail, num_rows))
            self._replay((num_rows, "masked"), partial(self.sample_tail, num_rows, masked=True))
        elapsed = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs of the decode step (batch buckets %s, page "
                    "buckets %s) in %.1f s", len(self._graphs), self.batch_buckets,
                    self.page_buckets, elapsed)
        return elapsed

    def num_graphs(self) -> int:
        return len(self._graphs)


@dataclass(frozen=True)
class PendingStatic:
    """A launched static step; `result()` waits for its host copies and queues its tokens
    for the mirror (DecodeState.resolved)."""

    state: ds.DecodeState
    serial: int  # the mirror's serial of this step
    device_token_ids: torch.Tensor  # i64[n] on the device: the next step's placeholders
    host: tuple[torch.Tensor, ...]  # token ids, log-probs, top ids, top log-probs, [n, ...]
    done: Any  # torch.cuda.Event once the copies landed; None on CPU (already there)

    def result(self) -> StepResult:
        if self.done is not None:
            self.done.synchronize()
        token_ids, logprobs, top_ids, top_lp = (t.numpy() for t in self.host)
        token_ids = token_ids.astype(np.int32)
        self.state.resolved(self.serial, token_ids)
        return StepResult(token_ids=token_ids, logprobs=logprobs,
                          top_ids=top_ids.astype(np.int32), top_logprobs=top_lp, hidden=None)


def _to_host(tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Host copies of device tensors: on CUDA non-blocking copies into pinned memory and the
    event that marks them done (a graph's outputs are overwritten by its next replay, so the
    copies are enqueued now); on CPU the tensors themselves (fresh outputs of eager code)."""
    if tensors[0].device.type != "cuda":
        return tuple(tensors), None
    host = []
    for t in tensors:
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        host.append(h)
    done = torch.cuda.Event()
    done.record()
    return tuple(host), done


def _plain_greedy(steps: Sequence[SeqStep]) -> bool:
    """Every row greedy (the sampler's rule), no penalty, no grammar mask: greedy_tail."""
    return all((st.sampling.temperature < step_contract.GREEDY_TEMPERATURE_EPS
                or st.sampling.top_k == 1) and not st.sampling.uses_penalties
               and st.bitmask is None for st in steps)
