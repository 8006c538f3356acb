"""The LoRA adapters loaded in the scheduler process: names -> ids -> the runner's slots.

    load(name, path) ──read_adapter (sgl_tpu/lora.py)──► runner.load_lora(id, adapter)
    unload(name)     ──refused while a request holds it──► runner.unload_lora(id)

Ids are never reused, so a request that named an adapter unloaded (and perhaps loaded again
under its name) before it arrived is refused rather than run with other weights. A request's
radix-cache namespace is its adapter's digest: the same folder loaded again shares its cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from sgl_tpu.lora import LoraAdapter, LoraError, module_shapes, read_adapter
from sgl_tpu.models.config import ModelConfig


class LoraRegistry:
    def __init__(self, runner: Any, model_config: ModelConfig) -> None:
        """`runner`: a ModelRunner with `load_lora`/`unload_lora` and its RunnerConfig's LoRA
        fields (max_loras 0: LoRA is off, every load refused)."""
        self.runner = runner
        self.config = runner.config
        self.model_config = model_config
        self.by_id: dict[int, LoraAdapter] = {}
        self.ids: dict[str, int] = {}
        self._next_id = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.config, "max_loras", 0))

    def load(self, name: str, path: str) -> int:
        """Load the PEFT folder `path` as `name`; its id. LoraError naming the problem."""
        if not self.enabled:
            raise LoraError("LoRA is not enabled on this server (start it with --enable-lora)")
        if name in self.ids:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded")
        if len(self.by_id) >= self.config.max_loras:
            raise LoraError(f"{len(self.by_id)} adapters are loaded, the most "
                            f"--max-loras-per-batch allows; unload one first")
        cfg = self.model_config
        adapter = read_adapter(
            name, path, num_layers=cfg.num_layers,
            shapes=module_shapes(cfg.hidden_size, cfg.intermediate_size, cfg.q_size,
                                 cfg.kv_size),
            max_rank=self.config.max_lora_rank, target_modules=self.config.lora_target_modules)
        lora_id = next(self._next_id)
        self.runner.load_lora(lora_id, adapter)
        self.by_id[lora_id] = adapter
        self.ids[name] = lora_id
        return lora_id

    def unload(self, name: str, holders: Iterable[int]) -> None:
        """Unload `name`; LoraError when it is not loaded, or when requests still use it
        (`holders`: the lora ids of every request waiting or running)."""
        lora_id = self.ids.get(name)
        if lora_id is None:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded")
        if users := sum(1 for h in holders if h == lora_id):
            raise LoraError(f"LoRA adapter {name!r} is in use by {users} request(s); unload it "
                            f"after they finish")
        self.runner.unload_lora(lora_id)
        del self.ids[name], self.by_id[lora_id]

    def namespace(self, lora_id: int) -> str | None:
        """The radix-cache namespace of adapter `lora_id` (0: the base model's, None);
        KeyError when it is not loaded."""
        return None if lora_id == 0 else self.by_id[lora_id].digest

    def info(self) -> dict[str, dict[str, Any]]:
        """name -> {id, path, rank}, for the HTTP side (listings, name resolution)."""
        return {a.name: {"id": i, "path": a.path, "rank": a.rank} for i, a in self.by_id.items()}
