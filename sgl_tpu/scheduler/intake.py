"""Intake: a `TokenizedGenerateReq` from another process -> a queued `Req`, or a 400 output.

The scheduler trusts nothing it receives: the sampling parameters are parsed and bounded again
(unless a caller in this process, the in-process Engine, hands over the ones it parsed), ids
must lie in the vocabulary, the prompt plus its output must fit the context and the KV pool,
and a grammar needs a grammar backend. A request without a seed gets a random one here, so
its samples are reproducible in whatever batch it lands.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence

from sgl_tpu.config import SchedulerConfig
from sgl_tpu.constrained.grammar_manager import GrammarManager
from sgl_tpu.detokenize import IncrementalDecoder
from sgl_tpu.messages import ReqOutput, TokenizedGenerateReq
from sgl_tpu.sampling_params import SamplingParams
from sgl_tpu.scheduler.grammar_steps import GRAMMAR_COMPILE_BUDGET_S
from sgl_tpu.scheduler.lora_registry import LoraRegistry
from sgl_tpu.scheduler.output import error_output
from sgl_tpu.scheduler.pooling import POOLING_METHODS
from sgl_tpu.scheduler.priority import req_priority
from sgl_tpu.scheduler.req import Req
from sgl_tpu.validation import check_generate_fields, check_request, check_token_ids

# The message's fields a `Req` holds as they are (it declares them by the same names); the rest
# it parses (`sampling`), bounds (`top_logprobs_num`, `priority`) or does not keep.
COPIED_FIELDS = tuple(name for name in TokenizedGenerateReq.__struct_fields__
                      if name in {f.name for f in dataclasses.fields(Req)}
                      and name not in ("sampling", "top_logprobs_num", "priority"))


class Intake:
    def __init__(self, config: SchedulerConfig, *, vocab_size: int, capacity_tokens: int,
                 grammar: GrammarManager | None,
                 decode: Callable[[Sequence[int], bool], str],
                 lora: LoraRegistry | None = None) -> None:
        self.config = config
        self.lora = lora
        self.vocab_size = vocab_size
        self.capacity_tokens = capacity_tokens
        self.grammar = grammar
        self.decode = decode
        self._seed_rng = random.Random(0x5C1)

    def new_req(self, msg: TokenizedGenerateReq, sampling: SamplingParams | None = None
                ) -> Req | ReqOutput:
        """`sampling`: `msg.sampling` already parsed in this process; None: parse it here."""
        if sampling is None:
            try:
                sampling = SamplingParams.from_dict(msg.sampling)
            except ValueError as e:
                return error_output(msg.rid, len(msg.input_ids), str(e))
        error = check_token_ids("input_ids", msg.input_ids, self.vocab_size) or check_request(
            len(msg.input_ids), sampling, context_len=self.config.context_len,
            capacity_tokens=self.capacity_tokens, grammar_supported=self.grammar is not None,
            vocab_size=self.vocab_size)
        error = error or check_generate_fields(msg, self.config.max_retention_s)
        if msg.embed and sampling.max_new_tokens != 0:
            error = error or "an embedding request generates no tokens (max_new_tokens 0)"
        namespace = None
        if msg.lora_id:
            try:
                namespace = None if self.lora is None else self.lora.namespace(msg.lora_id)
            except KeyError:
                namespace = None
            error = error or (None if namespace else f"LoRA adapter id {msg.lora_id} is not "
                              f"loaded (unloaded after the request named it)")
        if error is not None:
            return error_output(msg.rid, len(msg.input_ids), error)
        seed = sampling.seed if sampling.seed is not None else self._seed_rng.getrandbits(32)
        pooling = self.config.pooling if msg.embed else None
        req = Req(**{name: getattr(msg, name) for name in COPIED_FIELDS},
                  origin_input_ids=list(msg.input_ids), sampling=sampling, seed=seed,
                  top_logprobs_num=min(msg.top_logprobs_num, self.config.max_top_logprobs),
                  priority=req_priority(msg.priority, self.config), pooling=pooling,
                  needs_prefix_rows=pooling is not None
                  and POOLING_METHODS[pooling].needs_prefix_rows, cache_namespace=namespace)
        if sampling.stop or sampling.stop_regex:
            req.decoder = IncrementalDecoder(self.decode, sampling.skip_special_tokens)
        if sampling.grammar is not None and self.grammar is not None:
            req.grammar_future = self.grammar.request(*sampling.grammar)
            req.grammar_deadline = time.monotonic() + GRAMMAR_COMPILE_BUDGET_S
        return req
