"""Offline, in-process `Engine` shaped like SGLang's (`sgl.Engine`): no HTTP, no sockets.

    Engine.generate ──TokenizedGenerateReq──► Scheduler.step() loop ──ReqOutput──►
        DetokenizerState ──ReqStrOut──► ResponseAccumulator ──► dict(s) / stream of dicts

The scheduler, radix cache, model runner and detokenization are the very objects the server
processes use; here they run in the caller's thread, one `step()` at a time, until every
request of the call is done. Prefixes cached by one call are reused by the next.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np

from sgl_tpu.choices import check_registry_names
from sgl_tpu.config import ServerArgs
from sgl_tpu.constrained import GrammarManager, create_backend
from sgl_tpu.detokenize import DetokenizerState
from sgl_tpu.executor import omp_wait
from sgl_tpu.executor.registry import (
    explain_speculation,
    resolve_backend,
    resolve_overlap_schedule,
    resolve_speculation,
    runner_config,
)
from sgl_tpu.loader import load_model
from sgl_tpu.loader.chat_templates import with_chat_template
from sgl_tpu.loader.loaded import LoadedModel
from sgl_tpu.lora import LoraError, parse_lora_paths
from sgl_tpu.mem_cache.disk_folder import storage_dir
from sgl_tpu.mem_cache.disk_tier import DiskTier
from sgl_tpu.mem_cache.host_tier import HostTier
from sgl_tpu.mem_cache.load_cost import LoadCost
from sgl_tpu.mem_cache.radix_cache import RadixCache
from sgl_tpu.mem_cache.tiers import TieredCache, model_fingerprint
from sgl_tpu.messages import TokenizedGenerateReq
from sgl_tpu.parallel.runner_factory import close_runner, create_runner, join_group
from sgl_tpu.response import ResponseAccumulator, embedding_vector, error_status
from sgl_tpu.sampling_params import SamplingParams, expand_n
from sgl_tpu.scheduler.lora_registry import LoraRegistry
from sgl_tpu.scheduler.scheduler import Scheduler
from sgl_tpu.scheduler.stats import server_info
from sgl_tpu.validation import check_dimensions

logger = logging.getLogger(__name__)


class GenerationError(ValueError):
    """A request the engine refused (bad input); the message names the problem."""


def build_scheduler(args: ServerArgs) -> tuple[Scheduler, Any]:
    """Load the model, build and warm the runner, and wrap it in a scheduler."""
    check_registry_names(args)
    backend = resolve_backend(args.backend)
    omp = omp_wait.configure(args.omp_spin_count)  # before anything loads torch
    if backend == "torch":
        logger.info("OpenMP waiting: %s", omp)
    group = join_group(args, backend)  # multi-host JAX: before the model loads
    loaded = load_model(args.model_path)
    runner_cfg = runner_config(args, loaded.config.context_len,
                               num_experts=loaded.config.num_experts, gemma=loaded.config.gemma)
    runner = create_runner(args, loaded, runner_cfg, group)  # tp_size > 1: rank 0 of a group
    logger.info("executor backend: %s (%s)", runner_cfg.backend, runner_cfg.dtype)
    if runner_cfg.warmup:
        try:
            runner.warmup()
        except BaseException:
            close_runner(runner)
            raise
    eos = tuple(loaded.config.eos_token_ids) or tuple(loaded.tokenizer.eos_token_ids)
    grammar = None
    if args.grammar_backend != "none":
        backend = create_backend(args.grammar_backend, loaded.tokenizer, loaded.config.vocab_size)
        grammar = GrammarManager(backend)
    overlap = resolve_overlap_schedule(args, runner_cfg.backend)
    spec_algorithm, spec_max_batch = resolve_speculation(args, runner_cfg.backend, overlap)
    spec_why = explain_speculation(args, runner_cfg.backend, overlap)
    logger.info("speculative decoding: %s", spec_why)
    sched_cfg = args.scheduler_config(  # (the runner's config: what it runs, resolved)
        runner.config, overlap_schedule=overlap, speculative_algorithm=spec_algorithm,
        speculative_max_batch=spec_max_batch,
        speculative_gate=spec_algorithm is not None and args.speculative_algorithm == "auto",
        speculative_resolution=spec_why)
    scheduler = Scheduler(
        sched_cfg, runner, num_pages=runner_cfg.num_pages,
        decode=loaded.tokenizer.decode, eos_token_ids=eos,
        vocab_size=loaded.config.vocab_size, grammar=grammar,
        disable_jump_forward=args.disable_jump_forward,
        tiers=tier_factory(args, loaded, runner, runner_cfg.num_pages),
        lora=LoraRegistry(runner, loaded.config) if runner_cfg.max_loras else None)
    for name, path in parse_lora_paths(args.lora_paths):  # --lora-paths
        try:
            scheduler.lora.load(name, path)
        except LoraError as e:
            close_runner(runner)
            raise ValueError(f"--lora-paths {name}: {e}") from None
    return scheduler, loaded


def tier_factory(args: ServerArgs, loaded: LoadedModel, runner: Any, num_pages: int
                 ) -> Callable[[RadixCache], TieredCache] | None:
    """What builds the host (and disk) tiers over the scheduler's tree, sized from the flags;
    None without --enable-hierarchical-cache."""
    if not args.enable_hierarchical_cache:
        return None
    row = runner.read_kv_pages(np.zeros(1, dtype=np.int32))  # the padding page: its shape
    row_bytes = row.shape[1] * row.itemsize
    host_pages = (int(args.hicache_size * 2**30 // row_bytes) if args.hicache_size
                  else int(args.hicache_ratio * num_pages))
    host = HostTier(host_pages, row.shape[1], row.dtype)
    disk = None
    if args.hicache_storage_backend == "file":
        folder = storage_dir(args.hicache_storage_dir)
        fingerprint = model_fingerprint(repr(loaded.config), loaded.params,
                                        runner.kv_page_layout())
        try:  # an unsafe folder (StorageDirError) is fatal, one that cannot be made is not
            disk = DiskTier(folder, fingerprint, args.page_size, row.shape[1], row.dtype,
                            max_bytes=args.hicache_storage_max_bytes,
                            durability=args.hicache_storage_durability,
                            is_default_dir=args.hicache_storage_dir is None)
        except OSError as e:
            logger.warning("KV disk tier: cannot use %s (%s); host tier only", folder, e)
    logger.info("KV tiers: host %d pages (%.2f GB, %s)%s", host_pages,
                host_pages * row_bytes / 2**30, args.hicache_write_policy,
                "" if disk is None else f", disk {disk.dir} ({len(disk)} pages found, at "
                f"most {disk.max_bytes / 2**30:.2f} GB, durability {disk.durability})")
    return partial(TieredCache, runner, host=host, disk=disk,
                   write_policy=args.hicache_write_policy,
                   load_cost=LoadCost(args.hicache_min_load_tokens))


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        if self.server_args.dp_size > 1:
            raise ValueError("dp_size > 1 runs replicas behind the sglang-router: use "
                             "python -m sgl_tpu.launch_server --dp-size N")
        self.scheduler, self.loaded = build_scheduler(self.server_args)
        self.tokenizer = with_chat_template(self.loaded.tokenizer, self.server_args.chat_template)
        self.model_config = self.loaded.config
        self._rids = itertools.count()
        self._pending: dict[str, ResponseAccumulator] = {}
        self._detok = DetokenizerState(self.tokenizer.decode)

    # ---- public API ----------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        lora_path: str | Sequence[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict back) or a batch (a list of dicts, in order).

        With `stream=True` (single prompt only) returns an iterator of cumulative dicts: once
        the request has a token, then once `stream_interval` more arrived (its sampling
        parameter, else the server argument), and the final one.
        `lora_path`: a loaded LoRA adapter's name for every prompt, or one per prompt (None:
        the base model). Raises `GenerationError` for bad input.
        """
        batch_ids, single = self._tokenize(prompt, input_ids)
        names = (list(lora_path) if isinstance(lora_path, list | tuple)
                 else [lora_path] * len(batch_ids))
        if len(names) != len(batch_ids):
            raise GenerationError("lora_path list must match the number of prompts")
        lora_ids = [self._lora_id(name) for name in names]
        params = (list(sampling_params) if isinstance(sampling_params, list | tuple)
                  else [sampling_params] * len(batch_ids))
        if len(params) != len(batch_ids):
            raise GenerationError("sampling_params list must match the number of prompts")
        reqs = []
        for ids, sp, lora in zip(batch_ids, params, lora_ids, strict=True):
            try:  # the one parse in this process: the scheduler takes the parsed params
                parsed = SamplingParams.from_dict(sp)
            except ValueError as e:
                raise GenerationError(str(e)) from None
            reqs += [(ids, d, sample, lora) for d, sample in
                     zip(expand_n(sp or {}, parsed.n), parsed.samples(), strict=True)]
        accs = [self._submit(ids, sp, sampling, return_logprob, logprob_start_len,
                             top_logprobs_num, return_text_in_logprobs, lora_id=lora)
                for ids, sp, sampling, lora in reqs]
        if stream:
            if not single or len(accs) != 1:
                raise GenerationError("stream=True takes a single prompt with n=1")
            return self._stream(accs[0], parsed.stream_interval
                                or self.server_args.stream_interval)
        self._run_until_done(accs)
        results = [a.to_dict() for a in accs]
        return results[0] if single and len(results) == 1 else results

    def encode(self, prompt: str | Sequence[str] | None = None,
               input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
               dimensions: int | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """Embeddings, as SGLang's `Engine.encode` and `/encode` give them: each prompt's
        hidden states pooled by the `pooling` argument, the first `dimensions` values (all:
        None), L2-normalized; `{"embedding", "meta_info"}` for one prompt, a list in order for
        a batch. Raises `GenerationError` for bad input."""
        if (error := check_dimensions(dimensions, self.model_config.hidden_size)) is not None:
            raise GenerationError(error)
        batch_ids, single = self._tokenize(prompt, input_ids)
        sp = {"max_new_tokens": 0}
        accs = [self._submit(ids, sp, SamplingParams.from_dict(sp), False, -1, 0, False,
                             embed=True) for ids in batch_ids]
        self._run_until_done(accs)
        results = [a.to_dict() for a in accs]
        for r in results:
            r["embedding"] = embedding_vector(r["embedding"], dimensions).tolist()
        return results[0] if single else results

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load a PEFT LoRA folder as `lora_name` (GenerationError naming why not)."""
        try:
            self._lora().load(lora_name, lora_path)
        except LoraError as e:
            raise GenerationError(str(e)) from None

    def unload_lora_adapter(self, lora_name: str) -> None:
        try:
            self.scheduler.unload_lora(lora_name)
        except LoraError as e:
            raise GenerationError(str(e)) from None

    def _lora(self) -> LoraRegistry:
        if self.scheduler.lora is None:
            raise GenerationError("LoRA is not enabled (enable_lora=True)")
        return self.scheduler.lora

    def _lora_id(self, name: str | None) -> int:
        if name is None:
            return 0
        lora_id = self._lora().ids.get(name)
        if lora_id is None:
            raise GenerationError(f"LoRA adapter {name!r} is not loaded")
        return lora_id

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return server_info(self.scheduler)

    def shutdown(self) -> None:
        """Stop the grammar compiler threads, end tensor-parallel follower ranks and drop device
        state; the engine cannot be used afterwards."""
        if self.scheduler is not None and self.scheduler.grammar is not None:
            self.scheduler.grammar.shutdown()
        if self.scheduler is not None:
            if self.scheduler.tiers is not None:
                self.scheduler.tiers.close()  # the disk tier writes what is queued
            close_runner(self.scheduler.runner)
        self.scheduler = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------
    def _tokenize(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise GenerationError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            if isinstance(prompt, str):
                return [self.tokenizer.encode(prompt)], True
            return [self.tokenizer.encode(p) for p in prompt], False
        if not input_ids or isinstance(input_ids[0], int):
            return [list(input_ids)], True
        return [list(x) for x in input_ids], False

    def _submit(self, ids, sp, sampling: SamplingParams, return_logprob, logprob_start_len,
                top_logprobs_num, with_text, embed: bool = False, lora_id: int = 0
                ) -> ResponseAccumulator:
        rid = f"engine-{next(self._rids)}"
        acc = ResponseAccumulator(rid, return_logprob=return_logprob,
                                  return_text_in_logprobs=with_text,
                                  decode_token=lambda t: self.tokenizer.decode([t], False))
        msg = TokenizedGenerateReq(rid=rid, input_ids=list(ids), sampling=dict(sp or {}),
                                   return_logprob=return_logprob,
                                   logprob_start_len=logprob_start_len,
                                   top_logprobs_num=top_logprobs_num, embed=embed,
                                   lora_id=lora_id)
        if any(not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size for t in ids):
            raise GenerationError(f"input_ids must be token ids in [0, "
                                  f"{self.model_config.vocab_size})")
        error = self.scheduler.add_request(msg, sampling)
        if error is not None:
            raise GenerationError(error.finish_reason["message"])
        self._pending[rid] = acc
        return acc

    def _pump(self) -> None:
        for out in self._detok.process(self.scheduler.step()):
            acc = self._pending.get(out.rid)
            if acc is None:
                continue
            acc.update(out)
            if out.finished:
                del self._pending[out.rid]
                status = error_status(out)
                if status is not None:
                    raise GenerationError(status[1])

    def _run_until_done(self, accs: Sequence[ResponseAccumulator]) -> None:
        while not all(a.finished for a in accs):
            self._pump()

    def _stream(self, acc: ResponseAccumulator, interval: int) -> Iterator[dict[str, Any]]:
        wake_at = 1  # completion tokens at which the next dict is due
        while not acc.finished:
            self._pump()
            if acc.last is not None and (acc.finished
                                         or acc.last.completion_tokens >= wake_at):
                wake_at = acc.last.completion_tokens + interval
                yield acc.to_dict()
