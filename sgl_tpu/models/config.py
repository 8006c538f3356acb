"""Architecture description of a decoder-only transformer, read from GGUF metadata or an HF config.

One frozen dataclass covers the families we serve (Llama incl. Llama-3 rope scaling, Qwen2/2.5
with qkv bias, Qwen3 with q/k RMSNorm). The model implementations (`models/registry.py`) read
only this; loaders produce it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_tpu.models.registry import MODELS

SUPPORTED_ARCHS = tuple(MODELS)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class GemmaConfig:
    """What Gemma 2 and Gemma 3 add to a Llama-shaped decoder (models/gemma*.py read it).

    Every layer has four (1 + w) RMSNorms (before and after attention and the MLP), a GeGLU MLP
    (tanh GELU), embeddings scaled by sqrt(hidden); layers are either sliding-window ("local")
    or full ("global"). Gemma 3 adds q/k RMSNorm (ModelConfig.qk_norm) and a RoPE base of its
    own for local layers; Gemma 2 soft-caps attention scores and final logits.
    """

    sliding_window: int  # a local layer's query at p sees keys p - window + 1 .. p
    sliding_layers: tuple[bool, ...]  # per layer: True = local (windowed), False = global
    rope_local_theta: float  # RoPE base of local layers (global layers: ModelConfig.rope_theta)
    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)

    def __post_init__(self) -> None:
        if self.sliding_window <= 0 or self.query_pre_attn_scalar <= 0:
            raise ValueError("gemma config: sliding_window and query_pre_attn_scalar must be "
                             f"positive, got {self.sliding_window}, {self.query_pre_attn_scalar}")
        for name in ("attn_logit_softcap", "final_logit_softcap"):
            cap = getattr(self, name)
            if cap is not None and cap <= 0:
                raise ValueError(f"gemma config: {name} must be positive or None, got {cap}")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # one of SUPPORTED_ARCHS
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_len: int  # max positions the model supports
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    gemma: GemmaConfig | None = None  # Gemma 2/3 layer structure (sliding windows, norms)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "context_len"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.gemma is not None and len(self.gemma.sliding_layers) != self.num_layers:
            raise ValueError(f"model config: {len(self.gemma.sliding_layers)} layer kinds for "
                             f"{self.num_layers} layers")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
