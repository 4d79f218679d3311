"""Gated DeltaNet (models/deltanet.py): the chunked scan equals the token-by-token recurrence
(outputs, final state, gradients), transformers' pure-torch chunked kernel (tests/fixtures/
gated_delta_rule.npz, made by tests/fixtures/make_hf_fixtures.py), generation's recurrent step
after a chunked prefill, and itself sharded over heads on a 2x2x2 mesh; Qwen3-Next's whole linear
attention layer (`linear_attention`) equals transformers' Qwen3NextGatedDeltaNet (tests/fixtures/
gated_deltanet_layer.npz), on one device and sharded over heads on 2x2x2, and continues a sequence
from its conv and recurrent states."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import deltanet
from shardtrain import config
from shardtrain.hf.layout import grouped_to_hf, grouped_to_ours
from shardtrain.parallel import mesh as mesh_lib, sharding

FIXTURE = Path(__file__).parent.parent / "fixtures" / "gated_delta_rule.npz"
LAYER = Path(__file__).parent.parent / "fixtures" / "gated_deltanet_layer.npz"


def l2norm(x):
    return x * jax.lax.rsqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def inputs(seed=0, b=2, t=40, h=4, k=16, v=8):
    keys = jax.random.split(jax.random.key(seed), 6)
    return (l2norm(jax.random.normal(keys[0], (b, t, h, k))), l2norm(jax.random.normal(keys[1], (b, t, h, k))),
            jax.random.normal(keys[2], (b, t, h, v)), -jax.random.uniform(keys[3], (b, t, h)),
            jax.random.uniform(keys[4], (b, t, h)), jax.random.normal(keys[5], (b, h, k, v)))


def recurrence(q, k, v, g, beta, state):
    """The definition, one token at a time."""
    def step(s, x):
        o, s = deltanet.gated_delta_step(*x, s)
        return s, o
    state, o_tbhv = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(o_tbhv, 0, 1), state


def test_chunked_scan_equals_the_recurrence_with_gradients():
    """40 tokens in chunks of 16 (the last one padded), from a random state."""
    q, k, v, g, beta, s0 = inputs()

    def loss(fn, *a):
        o, s = fn(*a)
        return (o ** 2).sum() + (s ** 2).sum(), (o, s)
    chunked = jax.jit(jax.value_and_grad(lambda *a: loss(lambda *x: deltanet.gated_delta_rule(
        *x[:5], chunk=16, state_bhkv=x[5]), *a), argnums=range(6), has_aux=True))
    reference = jax.jit(jax.value_and_grad(lambda *a: loss(recurrence, *a), argnums=range(6), has_aux=True))
    (_, (o, s)), grads = chunked(q, k, v, g, beta, s0)
    (_, (o_ref, s_ref)), grads_ref = reference(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, s_ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_equals_transformers_torch_chunked_kernel():
    """Qwen3-Next's grouping: 2 query/key heads, each serving 2 consecutive value heads."""
    x = np.load(FIXTURE)
    q, k = (jnp.repeat(l2norm(jnp.asarray(x[n])), 2, axis=2) for n in ("q", "k"))
    o, state = deltanet.gated_delta_rule(q, k, x["v"], x["g"], x["beta"], chunk=16, state_bhkv=x["state"])
    np.testing.assert_allclose(o, x["o"], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(state, x["final_state"], atol=1e-5, rtol=1e-5)


def test_recurrent_steps_after_a_chunked_prefill_continue_the_sequence():
    q, k, v, g, beta, s0 = inputs(1)
    o_all, s_all = deltanet.gated_delta_rule(q, k, v, g, beta, chunk=16, state_bhkv=s0)
    o_pre, s = deltanet.gated_delta_rule(*(x[:, :30] for x in (q, k, v, g, beta)), chunk=16, state_bhkv=s0)
    outs, step = [o_pre], jax.jit(deltanet.gated_delta_step)
    for t in range(30, 40):
        o_t, s = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(o_t[:, None])
    np.testing.assert_allclose(jnp.concatenate(outs, 1), o_all, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s, s_all, atol=1e-5, rtol=1e-5)


def test_sharded_over_heads_equals_unsharded():
    """data=2 x fsdp=2 x tensor=2: the batch over data x fsdp, the 4 heads over tensor, each device
    scanning its own heads' states."""
    cfg = config.load(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    c = sharding.Constrain(cfg.rules, mesh_lib.make_mesh(cfg.mesh))
    q, k, v, g, beta, s0 = inputs(2, b=4, t=64)
    want = deltanet.gated_delta_rule(q, k, v, g, beta, chunk=16, state_bhkv=s0)
    with jax.set_mesh(c.mesh):
        got = jax.jit(lambda *a: deltanet.gated_delta_rule(*a[:5], chunk=16, state_bhkv=a[5], constrain=c))(
            q, k, v, g, beta, s0)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def layer_params(t) -> dict:
    """The fixture's Qwen3NextGatedDeltaNet tensors (2 key heads of 16, 4 value heads of 8) as ours."""
    qkvz, ba = (16, 16, 2 * 8, 2 * 8), (2, 2)  # per key head: q, k, its 2 value heads' v, z; b, a
    return {"w_qkvz_dc": grouped_to_ours(t["in_proj_qkvz.weight"], 2, qkvz),
            "w_ba_dh2": grouped_to_ours(t["in_proj_ba.weight"], 2, ba), "conv_wc": t["conv1d.weight"][:, 0].T,
            "a_log_h": t["A_log"], "dt_bias_h": t["dt_bias"], "norm_v": t["norm.weight"],
            "wo_vd": t["out_proj.weight"].T}


def test_linear_attention_layer_equals_transformers_and_its_layout_round_trips():
    """Projections regrouped from transformers' per-key-head layout (and back, bit for bit), the causal
    conv, the decay and write gates, the grouped heads, the gated RMSNorm: 2 x 40 tokens in chunks of 16."""
    t = np.load(LAYER)
    p = layer_params(t)
    for name, parts in [("in_proj_qkvz.weight", (16, 16, 16, 16)), ("in_proj_ba.weight", (2, 2))]:
        np.testing.assert_array_equal(grouped_to_hf(grouped_to_ours(t[name], 2, parts), 2, parts), t[name])
    out, _ = deltanet.linear_attention(p, jnp.asarray(t["x"]), n_key_heads=2, chunk=16)
    np.testing.assert_allclose(out, t["out"], atol=1e-5, rtol=1e-5)


def test_linear_attention_continues_from_its_states_token_by_token():
    """Generation: a 30-token prefill, then 10 single tokens through the conv window and the recurrent
    step, equal the 40 tokens at once."""
    t = np.load(LAYER)
    p, x = layer_params(t), jnp.asarray(t["x"])
    want, (conv_all, state_all) = deltanet.linear_attention(p, x, n_key_heads=2, chunk=16)
    out, states = deltanet.linear_attention(p, x[:, :30], n_key_heads=2, chunk=16)
    outs, step = [out], jax.jit(lambda x, c, s: deltanet.linear_attention(
        p, x, n_key_heads=2, conv_state_bwc=c, state_bhkv=s))
    for i in range(30, 40):
        o, states = step(x[:, i:i + 1], *states)
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(states[0], conv_all)
    np.testing.assert_allclose(states[1], state_all, atol=1e-5, rtol=1e-5)


def test_linear_attention_layer_sharded_over_heads_equals_unsharded():
    """The whole layer on data=2 x fsdp=2 x tensor=2: its 4 value heads' scans over tensor."""
    cfg = config.load(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    c = sharding.Constrain(cfg.rules, mesh_lib.make_mesh(cfg.mesh))
    t = np.load(LAYER)
    p, x = layer_params(t), jnp.tile(jnp.asarray(t["x"]), (2, 1, 1))
    with jax.set_mesh(c.mesh):
        got, _ = jax.jit(lambda p, x: deltanet.linear_attention(p, x, n_key_heads=2, chunk=16, constrain=c))(p, x)
    np.testing.assert_allclose(got, jnp.tile(jnp.asarray(t["out"]), (2, 1, 1)), atol=1e-5, rtol=1e-5)


def test_packed_documents_each_run_as_if_alone():
    """Three documents packed in a row of 40 (boundaries mid-chunk and on a chunk's edge, chunks of 8):
    each document's output equals the layer run on it alone (conv window and state reset at its start)."""
    t = np.load(LAYER)
    p, x = layer_params(t), jnp.asarray(t["x"])
    bounds = [0, 13, 24, 40]
    seg_bt = jnp.asarray(np.repeat(np.arange(3), np.diff(bounds))[None].repeat(2, 0), jnp.int32)
    packed, _ = deltanet.linear_attention(p, x, n_key_heads=2, chunk=8, segment_ids_bt=seg_bt)
    for start, stop in zip(bounds, bounds[1:]):
        alone, _ = deltanet.linear_attention(p, x[:, start:stop], n_key_heads=2, chunk=8)
        np.testing.assert_allclose(packed[:, start:stop], alone, atol=1e-5, rtol=1e-5)
    whole, _ = deltanet.linear_attention(p, x, n_key_heads=2, chunk=8)
    assert np.abs(packed[:, 13:] - whole[:, 13:]).max() > 1e-2  # the documents do differ from one sequence
