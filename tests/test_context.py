"""Context parallelism: ring attention against plain masked attention, a 4k-token model's loss and
gradients on a context-parallel mesh against one device's (the compiled program's collectives:
test_moe.py's expert x context step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models.attention import load_balanced_order
from shardtrain import config, step as step_lib
from shardtrain.parallel import mesh as mesh_lib, sharding


def reference(q, k, v, pos_bt, seg_bt, window=None, softcap=None):
    mask = (pos_bt[:, :, None] >= pos_bt[:, None, :]) & (seg_bt[:, :, None] == seg_bt[:, None, :])
    if window is not None:  # sliding window: keys fewer than `window` positions back
        mask &= pos_bt[:, :, None] - pos_bt[:, None, :] < window
    if softcap is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))  # Gemma 2: scores scaled by 1/3, capped
    s = jnp.tanh(jnp.einsum("bqhe,bkhe->bhqk", q, k) / 3 / softcap) * softcap
    return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1), v)


def test_load_balanced_order_gives_device_i_chunks_i_and_its_mirror():
    order = load_balanced_order(16, 2)  # 4 chunks of 4: device 0 holds 0 and 3, device 1 holds 1 and 2
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("chunk, window, softcap", [(8, None, None), (4, 10, None), (4, 10, 2.0), (None, 10, 2.0)])
def test_ring_attention_over_four_devices_equals_masked_attention_with_packed_documents(chunk, window, softcap):
    b, t, h, kh, e = 2, 64, 4, 2, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (b, t, n, e)) for i, n in enumerate((h, kh, kh)))
    order = jnp.asarray(load_balanced_order(t, 4))
    pos_bt = jnp.broadcast_to(order, (b, t))
    seg_bt = (pos_bt >= jnp.array([[20], [41]])).astype(jnp.int32)  # two documents per row
    cfg = config.load(None, ["mesh.data=2", "mesh.context=4"])
    c = sharding.Constrain(cfg.rules, mesh_lib.make_mesh(cfg.mesh))

    def loss(fn, q, k, v):
        o = fn(q, k, v)
        return jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape))), o

    def run_ring(q, k, v):
        extra = {} if softcap is None else dict(scale=1 / 3, softcap=softcap)
        return attention.ring(q, k, v, pos_bt, seg_bt, constrain=c, chunk=chunk, window=window, **extra)
    ring = jax.jit(jax.value_and_grad(lambda *a: loss(run_ring, *a),
                                      argnums=(0, 1, 2), has_aux=True))

    def run_reference(q, k, v):
        return reference(q, k, v, pos_bt, seg_bt, window, softcap)
    ref = jax.jit(jax.value_and_grad(lambda *a: loss(run_reference, *a), argnums=(0, 1, 2), has_aux=True))
    (_, o_ring), g_ring = ring(q, k, v)
    (_, o_ref), g_ref = ref(q, k, v)
    np.testing.assert_allclose(np.asarray(o_ring), np.asarray(o_ref), atol=1e-5)
    for a, b_ in zip(g_ring, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=1e-5)


LONG = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64", "model.n_layers=1",
        "data.seq_len=4096", "train.global_batch_size=2", "data.source=synthetic", "model.attention=chunked"]


def program(*overrides, devices=None):
    cfg = config.load(None, [*LONG, *overrides])
    return step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))


@pytest.mark.slow
def test_context_parallel_4k_packed_documents_losses_and_gradients_equal_one_devices():
    """4096 tokens per row, 2-3 documents each (segment ids, per-document positions), chunked
    attention: data x context x tensor = one device."""
    from test_moe import assert_same_losses_and_grads
    starts = np.array([[0, 1000, 3000], [0, 2049, 4096]])
    segment_ids = (np.arange(4097)[None, :, None] >= starts[:, None, 1:]).sum(-1).astype(np.int32)
    positions = (np.arange(4097)[None] - np.take_along_axis(starts, segment_ids, 1)).astype(np.int32)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 4097)).astype(np.int32)
    batch = {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}
    assert_same_losses_and_grads(program(devices=jax.devices()[:1]),
                                 program("mesh.data=2", "mesh.context=2", "mesh.tensor=2"), batch)
