"""Architecture description of a decoder-only transformer, read from GGUF metadata or an HF config.

One frozen dataclass covers the families we serve (Llama incl. Llama-3 rope scaling, Qwen2/2.5
with qkv bias, Qwen3 with q/k RMSNorm, Mistral's sliding window, Phi-3's LongRoPE, and the
mixture-of-experts MLPs of Qwen3-MoE and Mixtral). The model implementations
(`models/registry.py`) read only this; loaders produce it.
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
class LongRope:
    """Phi-3 LongRoPE (`rope_type == "longrope"`): per-frequency divisors of the inverse
    frequencies, `short_factor` for positions inside the pretrained context and `long_factor`
    beyond it, and a constant `attention_factor` on cos/sin (so on q.k squared)."""

    short_factor: tuple[float, ...]  # [d/2]
    long_factor: tuple[float, ...]  # [d/2]
    original_max_position_embeddings: int
    attention_factor: float

    def __post_init__(self) -> None:
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError("longrope: short_factor and long_factor differ in length")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("longrope: original_max_position_embeddings must be positive")


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
    # Mixture of experts (Qwen3-MoE, Mixtral; backends/jax/models/moe.py): every layer's MLP is
    # `num_experts` SwiGLU experts of width `moe_intermediate_size`, each token routed to the
    # top `num_experts_per_tok` by softmax router probability (renormalised to sum 1 when
    # `norm_topk_prob`). 0 experts: the dense MLP of width `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Qwen2-MoE: one always-on shared expert of this width beside the routed ones, its output
    # scaled by sigmoid(x @ shexp_gate) (0: none)
    shared_expert_intermediate_size: int = 0
    sliding_window: int | None = None  # Mistral/Phi-3: each query sees its last N keys
    long_rope: LongRope | None = None  # Phi-3 LongRoPE (instead of rope_scaling)

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
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ValueError(
                f"model config: MoE needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) "
                f"<= num_experts ({self.num_experts}) and a positive moe_intermediate_size "
                f"({self.moe_intermediate_size})")
        if self.shared_expert_intermediate_size and not self.num_experts:
            raise ValueError("model config: a shared expert needs num_experts > 0")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"model config: sliding_window must be positive, got {self.sliding_window}")
        if self.long_rope is not None and len(self.long_rope.short_factor) != self.head_dim // 2:
            raise ValueError(
                f"model config: longrope factors have {len(self.long_rope.short_factor)} "
                f"entries, expected head_dim / 2 = {self.head_dim // 2}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
