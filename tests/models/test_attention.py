"""Every attention implementation against the XLA reference (fp32), with packed documents,
sharded over a 2x2x2 mesh; splash in the Pallas interpreter and compiled for a TPU topology."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from shardtrain import config
from shardtrain.config import MESH_AXES, MeshConfig, RulesConfig
from shardtrain.parallel import mesh as mesh_lib, sharding
from shardtrain.plan import planner

B, T, H, K, E = 4, 256, 4, 2, 32


def qkv(seed=0, t=T):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, t, H, E)), jax.random.normal(kk, (B, t, K, E)),
            jax.random.normal(kv, (B, t, K, E)))


def packed_segments(t=T):
    """Rows of 1, 2 and 3 documents (ids rising along the row), and one row padded with 0s."""
    seg = np.zeros((B, t), np.int32)
    seg[1, t // 3:] = 1
    seg[2, t // 4:] = 1
    seg[2, t // 2 + 5:] = 2
    seg[3, : t - 40] = 1
    return jnp.asarray(seg)


def reference(q, k, v, seg=None, window=None, scale=E ** -0.5, softcap=None, sinks=None):
    """Explicit softmax over a causal (+ window) + same-document mask, k/v repeated to H heads;
    scores times `scale`, soft-capped to softcap * tanh(s / softcap); with `sinks` (H,), each head's
    sink logit joins the softmax as one more column, dropped after it (gpt-oss)."""
    rep = H // K
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhe,bkhe->bhqk", q, k) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    if window is not None:
        mask = mask & ~jnp.tril(jnp.ones((t, t), bool), -window)[None, None]
    if seg is not None:
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    if sinks is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))], -1)
    p = jax.nn.softmax(s, axis=-1)[..., :t]
    return jnp.einsum("bhqk,bkhe->bqhe", p, v)


@pytest.mark.parametrize("impl", ["xla", "chunked", "splash"])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_reference_unsharded(impl, packed):
    q, k, v = qkv()
    seg = packed_segments() if packed else None
    out = attention.attend(q, k, v, segment_ids_bt=seg, impl=impl)
    np.testing.assert_allclose(out, reference(q, k, v, seg), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "chunked", "splash"])
@pytest.mark.parametrize("gemma", [False, True], ids=["window", "window_scale_softcap"])
def test_sliding_window_matches_reference(impl, gemma):
    """A 50-token window over packed documents: chunked (chunks of 32) reads 3 of its 4 key chunks
    per query chunk, and its own backward pass is checked too (xla and splash differentiate masks
    that jax / Pallas apply). `gemma`: also Gemma 2's scale (query_pre_attn_scalar 24, not E = 32)
    and a soft cap of 5, which bends most scores (xla then runs the whole-block online softmax)."""
    q, k, v = qkv(3, t=128)
    seg = packed_segments(t=128)
    extra = dict(scale=24 ** -0.5, softcap=5.0) if gemma else {}
    if impl == "chunked":
        fn = functools.partial(attention.chunked, segment_ids_bt=seg, chunk=32, window=50, **extra)
    else:
        fn = functools.partial(attention.attend, segment_ids_bt=seg, impl=impl, window=50, **extra)

    def out_and_grads(f):
        def loss(q, k, v):
            o = f(q, k, v)
            return (o ** 2).sum(), o
        if impl != "chunked" and not (impl == "xla" and gemma):
            return jax.jit(f)(q, k, v), ()
        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return o, grads

    got, got_grads = out_and_grads(fn)
    want, want_grads = out_and_grads(lambda q, k, v: reference(q, k, v, seg, window=50, **extra))
    assert not np.allclose(want, reference(q, k, v, seg), atol=1e-3)  # the window matters here
    if gemma:  # so do the cap and the scale; every implementation equals xla's within 1e-5 (measured 3e-7)
        assert not np.allclose(want, reference(q, k, v, seg, window=50), atol=1e-3)
        xla = attention.attend(q, k, v, segment_ids_bt=seg, impl="xla", window=50, **extra)
        np.testing.assert_allclose(got, xla, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    for g, r in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


def test_chunked_several_chunks_and_gradients():
    q, k, v = qkv(1)
    seg = packed_segments()

    def loss(fn, q, k, v):
        return (fn(q, k, v) ** 2).sum()
    ref = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: reference(q, k, v, seg), *a), argnums=(0, 1, 2)))(q, k, v)
    got = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: attention.chunked(q, k, v, seg, chunk=64), *a),
                           argnums=(0, 1, 2)))(q, k, v)
    out = jax.jit(lambda q, k, v: attention.chunked(q, k, v, seg, chunk=64))(q, k, v)
    np.testing.assert_allclose(out, reference(q, k, v, seg), atol=2e-5)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


def test_auto_on_a_gpu_runs_chunked_for_mla_heads_wider_than_cudnn_takes():
    """MLA's 128 + 64 query/key channels (DeepSeek-V3; values zero-padded to them) are over cuDNN
    flash attention's 128: `auto` on a GPU takes chunked (asking cuDNN for them would fail)."""
    q, k, v = qkv(3)
    gpu = type("OnGpu", (), {"platform": "gpu", "size": staticmethod(lambda axis: 1)})()
    wide = [jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, 192 - E))).astype(jnp.bfloat16) for x in (q, k, v)]  # same scores
    got = attention.attend(*wide, impl="auto", constrain=gpu, scale=E ** -0.5)
    want = reference(*(x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(got[..., :E].astype(jnp.float32), want, atol=2e-2)
    np.testing.assert_array_equal(got[..., E:], 0)
    with pytest.raises(config.ConfigError, match="model.attention=cudnn: .* up to 128 channels, this model's have 192"):
        config.load("meshes/deepseek_v3_h100_256.yaml", ["model.attention=cudnn"])


@pytest.mark.parametrize("impl", ["chunked", "splash"])
def test_sharded_2x2x2_matches_reference(impl):
    """Under jit on data=2 x fsdp=2 x tensor=2 (batch over data x fsdp, kv heads over tensor)."""
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    c = sharding.Constrain(RulesConfig(), mesh)
    q, k, v = qkv(2)
    seg = packed_segments()

    @jax.jit
    def run(q, k, v, seg):
        q = c(q, ("batch", "seq", "heads", None))
        k, v = (c(x, ("batch", "seq", "kv_heads", None)) for x in (k, v))
        return attention.attend(q, k, v, segment_ids_bt=seg, impl=impl, constrain=c)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: (fn(q, k, v) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)

    with jax.set_mesh(mesh):
        out = run(q, k, v, seg)
        got = grads(lambda q, k, v: run(q, k, v, seg))
    np.testing.assert_allclose(out, reference(q, k, v, seg), atol=2e-5, rtol=1e-5)
    for g, r in zip(got, grads(lambda q, k, v: reference(q, k, v, seg))):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


def test_splash_compiles_for_tpu_topology():
    """The real kernel (not interpreted), sharded over a v5e:2x2 topology, through the TPU compiler."""
    from jax.experimental import topologies
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may compile for TPU too
    topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(1, 1, 2, 1, 1, 2), MESH_AXES,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
    c = sharding.Constrain(RulesConfig(), mesh)
    assert attention.resolve("auto", c.platform) == "splash"
    t = 1024
    sd = jax.sharding.NamedSharding
    P = jax.sharding.PartitionSpec
    q = jax.ShapeDtypeStruct((B, t, H, 128), jnp.bfloat16, sharding=sd(mesh, P("fsdp", None, "tensor")))
    kv = jax.ShapeDtypeStruct((B, t, K, 128), jnp.bfloat16, sharding=sd(mesh, P("fsdp", None, "tensor")))
    seg = jax.ShapeDtypeStruct((B, t), jnp.int32, sharding=sd(mesh, P("fsdp")))

    def loss(q, k, v, seg):
        return attention.attend(q, k, v, segment_ids_bt=seg, impl="auto", constrain=c).astype(jnp.float32).sum()
    # the persistent compilation cache held off: a compile-only TPU client cannot read its entries back
    compiled = planner.compile_fast(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg), "tpu")
    assert "tpu_custom_call" in compiled.as_text()
