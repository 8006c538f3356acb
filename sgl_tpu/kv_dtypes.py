"""The KV cache's element types: one table that the flag, the config checks, the backends' pools,
the tiers' page rows and the benchmarks all read. A leaf module (no project or framework import).

A pool stores each (token, KV head) vector of `head_dim` values as one *head row*:

    unscaled  [ head_dim x element ]                          float32, bfloat16, fp8 e5m2
    scaled    [ head_dim x int8 | scale: bfloat16 ]           int8: x ~= q * scale

so a page row (what the host and disk tiers keep) carries its scales with it, and every copy of
pool rows (tiers, sliding-window pool, prefix reuse) moves them alike. The scale of a scaled row
is max |x| / 127 over the vector, rounded up to bfloat16 (then |x| / scale <= 127 exactly).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVDtype:
    name: str  # the pool's element type as RunnerConfig.kv_dtype names it
    flags: tuple[str, ...]  # its --kv-cache-dtype spellings (none: reached through auto only)
    element_bytes: int  # one stored value
    scale_bytes: int  # per head row (0: unscaled)
    backends: tuple[str, ...]  # executor backends that store it (chosen by flag)
    # the torch backend's compiled CPU attention (torch-cpu-fused) reads it; else that backend
    # runs torch-sdpa's path, rows gathered and widened to the queries' dtype
    fused_attention: bool
    # the compiled layer ops' K/V write (rope_write_kv) stores it; else the fused layer ops are
    # off and the model writes K/V through `write_kv`
    fused_write: bool
    summary: str

    @property
    def scaled(self) -> bool:
        return self.scale_bytes > 0

    def head_row_bytes(self, head_dim: int) -> int:
        return head_dim * self.element_bytes + self.scale_bytes

    def token_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one token over `num_layers` layers."""
        return 2 * num_layers * num_kv_heads * self.head_row_bytes(head_dim)


KV_DTYPES: dict[str, KVDtype] = {d.name: d for d in (
    KVDtype("float32", (), 4, 0, ("torch", "jax"), True, True, "a float32 model's own K/V"),
    KVDtype("bfloat16", ("bfloat16", "bf16"), 2, 0, ("torch",), True, True,
            "K/V rounded to bfloat16: half a float32 model's KV bytes"),
    KVDtype("float8_e5m2", ("fp8_e5m2",), 1, 0, ("torch",), True, True,
            "K/V rounded to 8-bit floats, unscaled (SGLang's fp8_e5m2)"),
    KVDtype("int8", ("int8",), 1, 2, ("torch",), True, True,
            "K/V as int8 with a bfloat16 scale per token and KV head (llama.cpp's q8_0 with one "
            "block per head vector): about half of bfloat16's bytes"),
)}
# --kv-cache-dtype spelling -> pool element type
KV_FLAG_DTYPES: dict[str, str] = {f: d.name for d in KV_DTYPES.values() for f in d.flags}
# SGLang's spellings this server refuses by name
UNSUPPORTED_KV_FLAGS = ("fp8_e4m3", "fp4_e2m1")


def kv_dtype(name: str) -> KVDtype:
    """The table entry of a pool element type (RunnerConfig.kv_dtype)."""
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV element type {name!r}; one of {tuple(KV_DTYPES)}") from None


def backend_refusal(flag: str, backend: str) -> str | None:
    """Why `--kv-cache-dtype flag` cannot run on executor `backend` (None: it can)."""
    backends = KV_DTYPES[KV_FLAG_DTYPES[flag]].backends
    if backend in backends:
        return None
    return (f"--kv-cache-dtype {flag} needs the {' or '.join(backends)} backend; the {backend} "
            f"backend stores the KV cache in the model's dtype (--kv-cache-dtype auto)")
