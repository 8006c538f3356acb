"""The step profiler's attribution: named scopes -> parts, HLO instructions without metadata
placed by the weight they read, and a real jax.profiler trace of a small scoped program split
into those parts by self time."""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
from jax import lax
from tool_scripts import load_tool

jax_step_profile = load_tool("jax_step_profile")
hlo_parts, part_of, trace_parts = (jax_step_profile.hlo_parts, jax_step_profile.part_of,
                                   jax_step_profile.trace_parts)


def test_part_of_scopes():
    assert part_of("jit(_step_impl)/layers/attention/while/body/dot_general") == (
        "layers/attention")
    assert part_of("jit(_step_impl)/layers/qkv_proj/mul") == "layers/qkv_proj"
    assert part_of("jit(_step_impl)/layers/add") == "layers/other"
    assert part_of("jit(_step_impl)/sampler/cond/branch_1_fun/top_k_top_p/cond/bisect/x") == (
        "sampler/bisect")
    assert part_of("jit(_step_impl)/sampler/cond/select_n") == "sampler/other"
    assert part_of("jit(_step_impl)/logits/dot_general") == "logits"
    assert part_of("jit(_step_impl)/penalty_counts/scatter-add") == "penalty_counts"
    assert part_of("jit(_step_impl)/mul") == part_of(None) == "other"


def test_hlo_parts_fusions_and_weights():
    hlo = """HloModule jit__step_impl

%fused_computation.1 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %exp.1 = f32[4]{0} exponential(%param_0), metadata={op_name="jit(f)/sampler/draw/exp"}
}

ENTRY %main.9 (params__layers___3___wq__.1: f32[4,4], params__embed__.1: f32[8,4]) -> f32[4] {
  %params__layers___3___wq__.1 = f32[4,4]{1,0} parameter(0), WQ_METADATA
  %params__embed__.1 = f32[8,4]{1,0} parameter(1), metadata={op_name="params[\\'embed\\']"}
  %dot.2 = f32[4]{0} dot(%x.1, %params__layers___3___wq__.1), lhs_contracting_dims={0}
  %dot.3 = f32[8]{0} dot(%params__embed__.1, %dot.2), lhs_contracting_dims={1}
  %fusion.4 = f32[4]{0} fusion(%dot.2), kind=kLoop, calls=%fused_computation.1
  ROOT %add.5 = f32[4]{0} add(%fusion.4, %fusion.4)
}
"""
    # XLA's text escapes the quotes of a parameter's op_name
    parts = hlo_parts(hlo.replace("WQ_METADATA",
                                  "metadata={op_name=\"params[\\'layers\\'][3][\\'wq\\']\"}"))
    assert parts["dot.2"] == "layers/qkv_proj"
    assert parts["dot.3"] == "logits"
    assert parts["fusion.4"] == "sampler/draw"
    assert parts["add.5"] == "other"


def test_trace_splits_a_scoped_program():
    def f(x, w):
        with jax.named_scope("layers"):
            with jax.named_scope("attention"):  # a loop: its body's ops are nested events
                x = lax.fori_loop(0, x.shape[0] // 64, lambda i, c: jnp.tanh(c @ w), x)
            with jax.named_scope("mlp"):
                x = jax.nn.silu(x @ w) @ w
        with jax.named_scope("sampler"):
            with jax.named_scope("argmax"):
                return jnp.argmax(x, axis=-1)

    x, w = jnp.ones((256, 256)), jnp.full((256, 256), 0.01)
    step = jax.jit(f)
    parts = hlo_parts(step.lower(x, w).compile().as_text())
    step(x, w).block_until_ready()
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(3):
                step(x, w).block_until_ready()
        us = trace_parts(tmp, "jit_f", parts)
    assert us["layers/attention"] > 0 and us["layers/mlp"] > 0 and us["sampler/argmax"] > 0
    scoped = us["layers/attention"] + us["layers/mlp"] + us["sampler/argmax"]
    assert us.get("other", 0.0) < 0.5 * scoped, us
