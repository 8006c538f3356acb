"""PEFT LoRA adapters for tests, made with `peft` itself (random non-zero B, so they change the
output), and their merged float references.

    make_adapter(out, base_dir, seed, rank)          -> a PEFT folder for the HF checkpoint
    make_default_model_adapter(out, seed, rank)      -> a PEFT folder shaped for the default
                                                        model (SmolLM2-135M), whose HF weights
                                                        the tests do not have: the adapter only
                                                        needs the projections' shapes
    merged_greedy(base_dir, adapter, ids, n)         -> transformers' greedy tokens of the base
                                                        model with the adapter merged in

torch, transformers and peft are imported inside the functions (conftest keeps the repo root,
whose `kernels` package transformers would probe, off sys.path).
"""

from __future__ import annotations

from pathlib import Path

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# SmolLM2-135M-Instruct's shape (the default model's GGUF metadata)
DEFAULT_MODEL_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, vocab_size=64)


def _randomize(model, seed: int, std: float) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def make_adapter(out: str | Path, base_dir: str, *, seed: int, rank: int,
                 modules: list[str] | None = None, alpha: int = 16, std: float = 0.1) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=modules or ALL_MODULES,
        init_lora_weights=False))
    _randomize(peft_model, seed, std)
    peft_model.save_pretrained(out)
    return str(out)


def make_default_model_adapter(out: str | Path, *, seed: int, rank: int,
                               modules: list[str] | None = None, std: float = 0.05) -> str:
    """An adapter for the default model's shapes; the base weights are never materialized
    with values (meta device, then empty storage), only the LoRA ones."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**DEFAULT_MODEL_SHAPE))
    peft_model = get_peft_model(model, LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=modules or ["q_proj", "v_proj"],
        init_lora_weights=False))
    peft_model.to_empty(device="cpu")
    _randomize(peft_model, seed, std)
    peft_model.save_pretrained(out)
    return str(out)


def merged_greedy(base_dir: str, adapter: str | None, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (n tokens) of `ids` on the base model with `adapter`
    merged into its float32 weights (peft's merge_and_unload); None: the base model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n)
    return out[0, len(ids):].tolist()
