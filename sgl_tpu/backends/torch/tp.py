"""Tensor parallelism for `--backend torch`: one rank's runner over torch.distributed.

Every rank runs the Llama decoder of backends/torch/models/llama.py on its slice of the weights
(parallel/shard_params.py) with three kinds of collective per step:

    embed   ids i64[T] ─local rows, zeros elsewhere─► [T, D] ─all_reduce─► h    vocab-parallel
    layer   pre: RMSNorm, qkv (column-parallel: the rank's q and KV heads), RoPE
            write_kv + attention on the rank's own KV pool [slots, kvh/tp, d] (no collective)
            post: o-proj (row-parallel) ─all_reduce─► + h ; RMSNorm ; gate/up (column-
                  parallel) ; down (row-parallel) ─all_reduce─► + h
    logits  hidden [N, D] ─local head─► [N, V/tp] ─all_gather─► [N, V] on every rank

so the residual stream and the sampled logits are identical on every rank, and sampling (a
deterministic function of the logits and the per-request seed) needs no further exchange.
Per step: 2 all-reduces of [T, D] per layer, one for the embedding, one all-gather of the
sampled rows' logits.

The process group uses the c10d backend of the device (`TP_DIST_BACKENDS`; the TorchTPU
wheel registers `tpu_dist`). Layers run eagerly: the runner never compiles under TP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sgl_tpu.backends.torch.models import llama as llama_torch
from sgl_tpu.backends.torch.runner import TorchModelRunner
from sgl_tpu.config import RunnerConfig
from sgl_tpu.models.config import ModelConfig
from sgl_tpu.models.registry import get_model_spec
from sgl_tpu.parallel.head_split import check_tp_size
from sgl_tpu.parallel.shard_params import shard_params

logger = logging.getLogger(__name__)

# torch device type -> c10d backend of its collectives.
TP_DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "tpu": "tpu_dist"}
DEFAULT_TIMEOUT_S = 300.0  # a rank that never joins (or a collective that never completes)


@dataclass(frozen=True)
class TPRank:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    init_method: str  # where the ranks meet: "tcp://host:port"
    local_rank: int = 0  # device index on this host (cuda / tpu)
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")


def dist_backend(device_type: str) -> str:
    backend = TP_DIST_BACKENDS.get(device_type)
    if backend is None:
        raise ValueError(f"tensor parallelism has no collective backend for device "
                         f"{device_type!r}; supported: {', '.join(TP_DIST_BACKENDS)}")
    return backend


def init_tp_group(device: torch.device, tp: TPRank) -> None:
    """Join the default process group (blocks until every rank has joined)."""
    if dist.is_initialized():
        if dist.get_world_size() != tp.world_size or dist.get_rank() != tp.rank:
            raise RuntimeError(f"a process group of {dist.get_world_size()} ranks already "
                               f"exists here (rank {dist.get_rank()})")
        return
    backend = dist_backend(device.type)
    logger.info("rank %d/%d joining the %s group at %s", tp.rank, tp.world_size, backend,
                tp.init_method)
    dist.init_process_group(backend, init_method=tp.init_method, rank=tp.rank,
                            world_size=tp.world_size, timeout=timedelta(seconds=tp.timeout_s))


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


class LlamaTorchTP(llama_torch.LlamaTorch):
    """The decoder on one rank's slice (cfg: the slice's ModelConfig), with the collectives of
    the module docstring."""

    fused_layers = False  # all-reduces between the projections and the residual adds

    def __init__(self, cfg: ModelConfig, weights: llama_torch.Weights,
                 write_kv: llama_torch.WriteKV, *, vocab_size: int, rank: int,
                 world_size: int) -> None:
        super().__init__(cfg, weights, write_kv, compile_fn=None)
        self.vocab_size = vocab_size  # the model's, before padding to a multiple of tp
        self.vocab_start = rank * cfg.vocab_size  # first vocabulary row of this rank
        self.world_size = world_size
        linear = weights.linear

        def post(h, o, w):
            return llama_torch.layer_post(h, o, w, cfg, linear, all_reduce=_all_reduce)

        self.post = post

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.w.embed.shape[0]
        local = input_ids - self.vocab_start  # [T]
        mine = (local >= 0) & (local < rows)
        h = self.w.embed.index_select(0, local.clamp(0, rows - 1))  # [T, D]
        return _all_reduce(h * mine[:, None].to(h.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # bfloat16: each rank refines its own top candidates (a superset of the global top
        # ones ends up refined), then the slices are gathered.
        local = super().logits(hidden).contiguous()  # f32[N, V/tp]
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=1)[:, : self.vocab_size]  # f32[N, V]


class TorchTPModelRunner(TorchModelRunner):
    """`TorchModelRunner` of one rank: joins the group, holds its slice of the weights and a KV
    pool of its KV heads; steps, sampling and warm-up are the single-device runner's."""

    def __init__(self, model_config: ModelConfig, params: dict, config: RunnerConfig,
                 tp: TPRank) -> None:
        if get_model_spec(model_config.arch).torch_module != llama_torch.__name__:
            raise ValueError(f"tensor parallelism (torch) implements the Llama-family model; "
                             f"{model_config.arch!r} uses another")
        if config.compile:
            raise ValueError("tensor parallelism (torch) runs eagerly: use --torch-compile off")
        if config.quantization != "none":
            raise ValueError(f"--quantization {config.quantization} with --tp-size > 1 is not "
                             f"supported (ranks slice dense weights): use --quantization none")
        self.tp = tp
        self.split = check_tp_size(model_config, tp.world_size)
        super().__init__(model_config, params, config)

    def _build_model(self, params: dict, model_config: ModelConfig, prepack: bool, compile_fn):
        init_tp_group(self.device, self.tp)
        local_params, local_cfg = shard_params(params, model_config, self.split, self.tp.rank)
        weights = llama_torch.convert_weights(local_params, local_cfg, self.dtype, self.device,
                                              prepack)
        logger.info("rank %d: %d query / %d KV heads, %d MLP columns, %d vocabulary rows",
                    self.tp.rank, local_cfg.num_heads, local_cfg.num_kv_heads,
                    local_cfg.intermediate_size, local_cfg.vocab_size)
        return LlamaTorchTP(local_cfg, weights, self.attn.write_kv,
                            vocab_size=model_config.vocab_size, rank=self.tp.rank,
                            world_size=self.tp.world_size)
