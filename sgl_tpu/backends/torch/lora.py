"""LoRA on the torch backend: every loaded adapter's weights stacked in slots, and one batched
delta per projection for a step whose tokens belong to different adapters (and the base model).

Slots (S = --max-loras-per-batch; slot 0 is the base model, all zeros), per layer and module m:

    A_m  f32[S + 1, R, in]     rows past an adapter's rank r stay zero (R = --max-lora-rank)
    B_m  f32[S + 1, R, out]    B.T of the adapter, scaling folded in (sgl_tpu/lora.py)

A step of T tokens whose highest slot is s (token t of adapter slot[t], 0: base) adds to the
base projection's output y [T, out] (quantized or dense; the delta stays in float, as
llama.cpp adds its LoRA):

    u     = x @ A_m[1 : s + 1].view(s R, in).T          [T, s R]   every used slot at once
    mask  = one_hot(slot[t])[:, 1:] repeated R times   [T, s R]   keeps each token's own slot
    y[:, cols_m] += (u * mask) @ B_m[1 : s + 1].view(s R, out)

Two GEMMs per module over the step's adapters (no pass per adapter, no per-token gather of
weights); the cost grows with s R, not with how the tokens mix. A step of base tokens only
gets no `LoraBatch` and runs the base model's own path untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sgl_tpu.lora import LORA_MODULES, LoraAdapter, module_shapes
from sgl_tpu.models.config import ModelConfig

# fused projection (backends/torch/models/llama.py LayerWeights) -> its modules, in column order
FUSED = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",),
         "w_gate_up": ("gate_proj", "up_proj"), "w_down": ("down_proj",)}


@dataclass(frozen=True)
class LoraBatch:
    """One step's adapter rows: `slots` i64[T] (0: base), `used` = the highest slot s, and
    the [T, s R] mask of each token's own slot."""

    used: int
    mask: torch.Tensor  # f32[T, s R]


class LoraStack:
    """The adapters loaded on this runner (their ids -> slots) and their stacked weights."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int,
                 target_modules: tuple[str, ...], device: torch.device) -> None:
        shapes = module_shapes(cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size)
        self.rank = max_rank
        self.num_slots = num_slots
        self.target_modules = tuple(m for m in LORA_MODULES if m in target_modules)
        self.device = device
        # (column offset in the fused output, width) of each module
        self.columns: dict[str, tuple[int, int]] = {}
        for modules in FUSED.values():
            offset = 0
            for m in modules:
                self.columns[m] = (offset, shapes[m][1])
                offset += shapes[m][1]
        # per layer: module -> (A [S+1, R, in], B [S+1, R, out])
        self.layers = [{m: (torch.zeros(num_slots + 1, max_rank, shapes[m][0], device=device),
                            torch.zeros(num_slots + 1, max_rank, shapes[m][1], device=device))
                        for m in self.target_modules} for _ in range(cfg.num_layers)]
        self.slot_of: dict[int, int] = {}  # lora id -> slot (1..S)

    def load(self, lora_id: int, adapter: LoraAdapter) -> int:
        """Copy `adapter` into a free slot; ValueError when every slot is taken."""
        free = sorted(set(range(1, self.num_slots + 1)) - set(self.slot_of.values()))
        if not free:
            raise ValueError(f"all {self.num_slots} adapter slots are in use "
                             f"(--max-loras-per-batch); unload one first")
        slot = free[0]
        r = adapter.rank
        for layer, weights in zip(self.layers, adapter.layers, strict=True):
            for m, (a_stack, b_stack) in layer.items():
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                if m in weights:
                    a, b = weights[m]  # [r, in], [out, r]
                    a_stack[slot, :r] = torch.from_numpy(a)
                    b_stack[slot, :r] = torch.from_numpy(np.ascontiguousarray(b.T))
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
        return LoraBatch(used=used, mask=one_hot.repeat_interleave(self.rank, dim=1))

    def add_delta(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor,
                  batch: LoraBatch) -> torch.Tensor:
        """y [T, out] of fused projection `fused` of `layer` on x [T, in], plus the adapters'
        deltas of its modules."""
        s, r = batch.used, self.rank
        xf = x.float()
        for m in FUSED[fused]:
            stacks = self.layers[layer].get(m)
            if stacks is None:
                continue
            a, b = stacks
            u = xf @ a[1 : s + 1].reshape(s * r, -1).T  # [T, s R]
            delta = (u * batch.mask) @ b[1 : s + 1].reshape(s * r, -1)  # [T, out_m]
            lo, width = self.columns[m]
            if width == y.shape[1]:
                y = y + delta.to(y.dtype)
            else:
                y[:, lo : lo + width] += delta.to(y.dtype)
        return y

    def linear_for(self, layer: int, weights, linear, batch: LoraBatch):
        """`linear(x, w, b)` of `layer` (LayerWeights `weights`) with the adapters' deltas added
        to whichever of its fused projections `w` is."""
        names = {id(getattr(weights, f)): f for f in FUSED}

        def lora_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
            y = linear(x, w, b)
            fused = names.get(id(w))
            return y if fused is None else self.add_delta(layer, fused, x, y, batch)

        return lora_linear
