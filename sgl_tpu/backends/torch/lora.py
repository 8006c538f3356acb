"""LoRA on the torch backend: every loaded adapter's weights stacked in slots, and one batched
delta per projection for a step whose tokens belong to different adapters (and the base model).

Slots (S = --max-loras-per-batch; slot 0 is the base model, all zeros), per layer and fused
projection p (wqkv, wo, w_gate_up, w_down) whose n modules are adapted (R = --max-lora-rank):

    A_p  f32[S + 1, n R, in]     module j's lora_A in rows [j R, j R + r), the rest zero
    B_p  f32[S + 1, n R, out]    module j's lora_B.T (scaling folded in) in rows [j R, j R + r)
                                 and its own columns of the fused output, the rest zero

A step of T tokens whose highest slot is s (token t of adapter slot[t], 0: base) adds to the
base projection's output y [T, out] (quantized or dense; the delta stays in float, as
llama.cpp adds its LoRA):

    u     = x @ A_p[1 : s + 1].view(s n R, in).T           [T, s n R]  every used slot at once
    u    *= one_hot(slot[t])[:, 1:] repeated n R times     keeps each token's own slot
    y    += u @ B_p[1 : s + 1].view(s n R, out)             [T, out]

Three calls per projection over the step's adapters (no pass per adapter, no per-token gather
of weights): the cost grows with s n R, not with how the tokens mix. A step of base tokens only
gets no `LoraBatch` and runs the base model's own path untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sgl_tpu.lora import LoraAdapter, module_shapes
from sgl_tpu.models.config import ModelConfig

# fused projection (backends/torch/models/llama.py LayerWeights) -> its modules, in column order
FUSED = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",),
         "w_gate_up": ("gate_proj", "up_proj"), "w_down": ("down_proj",)}


@dataclass(frozen=True)
class LoraBatch:
    """One step's adapter rows: `used` = the highest slot s, and per adapted-module count n
    the [T, s n R] mask of each token's own slot."""

    used: int
    masks: dict[int, torch.Tensor]  # n -> f32[T, s n R]


class LoraStack:
    """The adapters loaded on this runner (their ids -> slots) and their stacked weights."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int,
                 target_modules: tuple[str, ...], device: torch.device) -> None:
        shapes = module_shapes(cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size)
        self.rank = max_rank
        self.num_slots = num_slots
        self.device = device
        # fused projection -> its adapted modules: (name, column offset, width)
        self.modules: dict[str, list[tuple[str, int, int]]] = {}
        self.widths: dict[str, tuple[int, int]] = {}  # fused projection -> (in, out)
        for fused, names in FUSED.items():
            offset, adapted = 0, []
            for m in names:
                if m in target_modules:
                    adapted.append((m, offset, shapes[m][1]))
                offset += shapes[m][1]
            if adapted:
                self.modules[fused] = adapted
                self.widths[fused] = (shapes[names[0]][0], offset)
        # per layer: fused projection -> (A [S+1, n R, in], B [S+1, n R, out])
        self.layers = [{f: (torch.zeros(num_slots + 1, len(ms) * max_rank, self.widths[f][0],
                                        device=device),
                            torch.zeros(num_slots + 1, len(ms) * max_rank, self.widths[f][1],
                                        device=device))
                        for f, ms in self.modules.items()} for _ in range(cfg.num_layers)]
        self.slot_of: dict[int, int] = {}  # lora id -> slot (1..S)

    def load(self, lora_id: int, adapter: LoraAdapter) -> int:
        """Copy `adapter` into a free slot; ValueError when every slot is taken."""
        free = sorted(set(range(1, self.num_slots + 1)) - set(self.slot_of.values()))
        if not free:
            raise ValueError(f"all {self.num_slots} adapter slots are in use "
                             f"(--max-loras-per-batch); unload one first")
        slot, r, rank = free[0], adapter.rank, self.rank
        for layer, weights in zip(self.layers, adapter.layers, strict=True):
            for fused, (a_stack, b_stack) in layer.items():
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                for j, (m, lo, width) in enumerate(self.modules[fused]):
                    if m in weights:
                        a, b = weights[m]  # [r, in], [out_m, r]
                        a_stack[slot, j * rank : j * rank + r] = torch.from_numpy(a)
                        b_stack[slot, j * rank : j * rank + r, lo : lo + width] = (
                            torch.from_numpy(np.ascontiguousarray(b.T)))
        self.slot_of[lora_id] = slot
        return slot

    def unload(self, lora_id: int) -> None:
        self.slot_of.pop(lora_id)

    def batch(self, token_lora_ids: np.ndarray) -> LoraBatch | None:
        """The step's LoraBatch from each token row's lora id (0: base); None when no row has
        an adapter."""
        if not token_lora_ids.any():
            return None
        slots = np.zeros(len(token_lora_ids), np.int64)
        for lora_id in np.unique(token_lora_ids):
            if lora_id:
                slots[token_lora_ids == lora_id] = self.slot_of[int(lora_id)]
        used = int(slots.max())
        one_hot = torch.from_numpy(slots[:, None] == np.arange(1, used + 1)).to(
            self.device, torch.float32)  # [T, s]
        counts = {len(ms) for ms in self.modules.values()}
        return LoraBatch(used=used, masks={n: one_hot.repeat_interleave(n * self.rank, dim=1)
                                           for n in counts})

    def add_delta(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor,
                  batch: LoraBatch) -> torch.Tensor:
        """y [T, out] of fused projection `fused` of `layer` on x [T, in], plus the adapters'
        deltas of its modules."""
        stacks = self.layers[layer].get(fused)
        if stacks is None:
            return y
        a, b = stacks
        s, n_in, n_out = batch.used, *self.widths[fused]
        u = x.float() @ a[1 : s + 1].view(-1, n_in).T  # [T, s n R]
        u.mul_(batch.masks[len(self.modules[fused])])
        if y.dtype == torch.float32:
            return y.addmm_(u, b[1 : s + 1].view(-1, n_out))
        return y + (u @ b[1 : s + 1].view(-1, n_out)).to(y.dtype)

    def linear_for(self, layer: int, weights, linear, batch: LoraBatch):
        """`linear(x, w, b)` of `layer` (LayerWeights `weights`) with the adapters' deltas added
        to whichever of its fused projections `w` is."""
        names = {id(getattr(weights, f)): f for f in FUSED}

        def lora_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
            y = linear(x, w, b)
            fused = names.get(id(w))
            return y if fused is None else self.add_delta(layer, fused, x, y, batch)

        return lora_linear
