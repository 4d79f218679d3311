"""Attention sinks (gpt-oss): every attention implementation, with sinks on, equals the xla path and an
explicit softmax whose denominator holds exp(sink) (outputs, and the gradients of q, k, v and the
sinks), over packed documents and a sliding window; splash in the Pallas interpreter, ring attention
over 4 devices, the KV-cache path; cuDNN's path (the kernel's logsumexp and a custom VJP) with the xla kernel
standing in for cuDNN's on CPU."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import H, packed_segments, qkv, reference as attention_reference

from models import attention
from models.gpt import cached_attention
from shardtrain import config
from shardtrain.parallel import mesh as mesh_lib, sharding

T = 128  # the smallest splash takes
SINKS = jnp.asarray([1.5, -0.5, 3.0, 0.2])  # one per query head: large enough to take much of the mass


def reference(q, k, v, sinks, seg=None, window=None):
    """softmax([scores, sink]) without the sink's column, over a causal (+ window, same-document) mask."""
    return attention_reference(q, k, v, seg, window, sinks=sinks)


def out_and_grads(fn, q, k, v, sinks):
    def loss(q, k, v, sinks):
        o = fn(q, k, v, sinks)
        return (o ** 2).sum(), o
    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    return o, grads


def assert_same(got, want):
    (o, grads), (o_want, grads_want) = got, want
    np.testing.assert_allclose(o, o_want, atol=2e-5, rtol=1e-5)
    for g, r in zip(grads, grads_want, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


@functools.cache
def xla_and_reference():
    q, k, v = qkv(4, t=T)
    seg = packed_segments(t=T)
    xla = out_and_grads(lambda q, k, v, s: attention.attend(q, k, v, segment_ids_bt=seg, impl="xla", window=50,
                                                            sinks_h=s), q, k, v, SINKS)
    want = out_and_grads(lambda q, k, v, s: reference(q, k, v, s, seg, 50), q, k, v, SINKS)
    return (q, k, v, seg), xla, want


def test_sinks_xla_path_equals_the_explicit_softmax():
    (q, k, v, seg), xla, want = xla_and_reference()
    without = reference(q, k, v, jnp.full((H,), -jnp.inf), seg, 50)
    assert np.abs(want[0] - without).max() > 0.1  # the sinks matter here
    assert_same(xla, want)


@pytest.mark.parametrize("impl", ["chunked", "splash"])
def test_sinks_each_kernel_equals_the_xla_path(impl):
    """Packed documents and a window of 50; chunked in chunks of 32 (each query chunk reads 3 key chunks)."""
    (q, k, v, seg), xla, _ = xla_and_reference()
    if impl == "chunked":
        fn = functools.partial(attention.chunked, segment_ids_bt=seg, chunk=32, window=50)
    else:
        fn = functools.partial(attention.attend, segment_ids_bt=seg, impl=impl, window=50)
    assert_same(out_and_grads(lambda q, k, v, s: fn(q, k, v, sinks_h=s), q, k, v, SINKS), xla)


def test_sinks_under_ring_attention_over_four_devices():
    """The sink enters each device's online softmax once, whatever the number of ring steps (blocks
    of 32 tokens in chunks of 16)."""
    cfg = config.load(None, ["mesh.data=2", "mesh.context=4"])
    c = sharding.Constrain(cfg.rules, mesh_lib.make_mesh(cfg.mesh))
    (q, k, v, seg), xla, _ = xla_and_reference()
    ring = functools.partial(attention.ring, positions_bt=None, segment_ids_bt=seg, constrain=c, chunk=16, window=50)
    with jax.set_mesh(c.mesh):
        got = out_and_grads(lambda q, k, v, s: ring(q, k, v, sinks_h=s), q, k, v, SINKS)
    assert_same(got, xla)


def test_sinks_in_the_kv_cache_path():
    """cached_attention (generation): 5 new queries at slots 20..24 over 32 slots, rows' left padding
    as first_b, equal the full attention's last 5 rows."""
    q, k, v = qkv(6, t=32)
    t0, first = 20, jnp.asarray([0, 3, 0, 7])
    key_s, query_t = jnp.arange(32), t0 + jnp.arange(5)
    mask = (key_s[None, None] <= query_t[None, :, None]) & (key_s[None, None] >= first[:, None, None])
    got = cached_attention(q[:, t0:t0 + 5], k, v, mask, sinks_h=SINKS)
    seg = (jnp.arange(32)[None] >= first[:, None]).astype(jnp.int32)  # the padding: a document of its own
    want = reference(q, k, v, SINKS, seg)[:, t0:t0 + 5]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window, chunk", [(None, 512), (50, 512), (50, 48)])
def test_sinks_by_the_kernels_logsumexp_equal_the_xla_path(window, chunk, monkeypatch):
    """cuDNN's path (`with_sinks_by_logsumexp`: o * sigmoid(lse - sink) with its own VJP) with the xla
    implementation standing in for cuDNN's kernel (same (o, lse) and a VJP that ignores lse's
    cotangent, as cuDNN's does): outputs and gradients of q, k, v and the sinks equal the xla path's,
    GQA over packed documents (ids traced, as in training), causal and with a window; with a chunk
    of 48 the logsumexp's gradient runs in chunks of 16 (gcd with T = 128)."""
    monkeypatch.setattr(attention, "CHUNK", chunk)
    (q, k, v, seg), _, _ = xla_and_reference()

    def run(impl):
        def loss(q, k, v, s, seg):
            if impl == "xla":
                o = attention.attend(q, k, v, segment_ids_bt=seg, impl="xla", window=window, sinks_h=s)
            else:
                o = attention.with_sinks_by_logsumexp(q, k, v, s, seg, window=window, scale=q.shape[-1] ** -0.5,
                                                      impl="xla")
            return (o ** 2).sum(), o
        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, SINKS, seg)
        return o, grads
    assert_same(run("by_logsumexp"), run("xla"))


def test_chunked_logsumexp_equals_the_xla_kernels():
    """Chunks of 32 under a window of 50 and packed documents: the logsumexp the custom VJP differentiates."""
    (q, k, v, seg), _, _ = xla_and_reference()
    mask = (seg[:, :, None] == seg[:, None, :])[:, None]
    _, want = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=(49, 0),
                                           return_residual=True)
    got = attention.chunked_logsumexp(q, k, seg, chunk=32, window=50)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)


def test_cudnn_takes_sinks_and_auto_on_a_gpu_picks_it(monkeypatch):
    """`auto` on a GPU runs cuDNN for a model with sinks (half precision), through `with_sinks_by_logsumexp`;
    a soft cap stays an error (cuDNN's kernel has none)."""
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(7, t=T))
    config.load(None, ["model.attn_sinks=true", "model.attention=cudnn", "train.compute_dtype=bfloat16"])  # no error
    with pytest.raises(ValueError, match="cudnn attention has no soft cap"):
        attention.attend(q, k, v, impl="cudnn", softcap=30.0)
    calls, by_logsumexp = [], attention.with_sinks_by_logsumexp

    def xla_for_cudnn(*args, **kwargs):  # no cuDNN on CPU
        calls.append(kwargs)
        return by_logsumexp(*args, **kwargs, impl="xla")
    monkeypatch.setattr(attention, "with_sinks_by_logsumexp", xla_for_cudnn)
    gpu = type("OnGpu", (), {"platform": "gpu", "size": staticmethod(lambda axis: 1)})()
    got = attention.attend(q, k, v, impl="auto", constrain=gpu, sinks_h=SINKS)
    assert len(calls) == 1
    want = reference(*(x.astype(jnp.float32) for x in (q, k, v)), SINKS)
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=2e-2)


def test_splash_with_sinks_compiles_for_tpu_topology():
    """The real kernel, its sinks sharded with the query heads over `tensor`, through the TPU compiler
    (forward and backward)."""
    from jax.experimental import topologies

    from shardtrain.config import MESH_AXES, RulesConfig
    from shardtrain.plan import planner
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may compile for TPU too
    topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(1, 1, 2, 1, 1, 2), MESH_AXES,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
    c = sharding.Constrain(RulesConfig(), mesh)
    sd, P = jax.sharding.NamedSharding, jax.sharding.PartitionSpec
    q = jax.ShapeDtypeStruct((4, 1024, 8, 64), jnp.bfloat16, sharding=sd(mesh, P("fsdp", None, "tensor")))
    kv = jax.ShapeDtypeStruct((4, 1024, 2, 64), jnp.bfloat16, sharding=sd(mesh, P("fsdp", None, "tensor")))
    sinks = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sd(mesh, P("tensor")))

    def loss(q, k, v, sinks):
        o = attention.attend(q, k, v, impl="auto", constrain=c, window=128, sinks_h=sinks)
        return o.astype(jnp.float32).sum()
    compiled = planner.compile_fast(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(q, kv, kv, sinks), "tpu")
    assert "tpu_custom_call" in compiled.as_text()
