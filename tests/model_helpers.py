"""Shared by the model-parity tests of both backends: the JAX model run over the paged KV pool
with the runner's real batch packing, and the transformers reference logits."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np

from sgl_tpu.backends.jax.forward_batch import build_forward_batch
from sgl_tpu.backends.jax.runner import JaxModelRunner
from sgl_tpu.config import ServerArgs
from sgl_tpu.executor.registry import runner_config
from sgl_tpu.executor.step import SeqStep
from sgl_tpu.models.registry import jax_model
from sgl_tpu.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class PagedModel:
    """Runs sequences through the architecture's JAX `forward` with the runner's real batch
    packing, and keeps each sequence's pages so later steps read the cached prefix from the
    pool."""

    def __init__(self, loaded, page_size: int = 4, **kw):
        args = ServerArgs(skip_warmup=True, backend="jax", page_size=page_size,
                          max_total_tokens=4096,
                          kv_tile=max(8, page_size), block_q=8, min_token_bucket=16,
                          chunked_prefill_size=256, max_running_requests=8, **kw)
        self.cfg = loaded.config
        self.runner = JaxModelRunner(loaded.config, loaded.params, runner_config(args, 4096))
        self.ps = page_size
        self.next_page = 1
        self._fwd = jax.jit(partial(self._logits, cfg=self.cfg, kv_tile=args.kv_tile),
                            static_argnames=("mode",))

    @staticmethod
    def _logits(params, pools, fb, *, cfg, mode, kv_tile):
        model = jax_model(cfg.arch)
        hidden, pools = model.forward(params, pools, fb, cfg, mode, kv_tile=kv_tile)
        return model.compute_logits(params, hidden, cfg), pools

    def new_pages(self, n_tokens: int) -> np.ndarray:
        n = -(-n_tokens // self.ps)
        pages = np.arange(self.next_page, self.next_page + n, dtype=np.int32)
        self.next_page += n
        return pages

    def run(self, mode, seqs):
        """seqs: list of (token_ids, prefix_len, pages) -> per-seq logits [n_i, V]."""
        steps = [SeqStep(token_ids=t, prefix_len=p, pages=pg, sampling=GREEDY, seed=0,
                         num_output_tokens=0) for t, p, pg in seqs]
        shape = self.runner.batch_shape(mode, steps)
        fb = build_forward_batch(steps, shape, self.ps)
        logits, self.runner.kv_pools = self._fwd(self.runner.params, self.runner.kv_pools, fb,
                                                 mode=mode)
        logits = np.asarray(logits)
        out, t = [], 0
        for toks, _, _ in seqs:
            out.append(logits[t : t + len(toks)])
            t += len(toks)
        return out


def hf_logits(model_dir: str, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].numpy()
