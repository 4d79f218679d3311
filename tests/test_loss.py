"""Chunked cross-entropy equals the plain one (loss and gradients), also sharded."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from shardtrain import loss
from shardtrain.config import MeshConfig, RulesConfig
from shardtrain.parallel import mesh as mesh_lib, sharding


def setup(b=4, t=64, d=16, v=50):
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kx, (b, t, d)), jax.random.normal(kw, (d, v)) * 0.5,
            jax.random.randint(ky, (b, t), 0, v))


def test_chunked_equals_plain_loss_and_grads():
    x, w, y = setup()

    weights = (jnp.arange(64) % 5 != 0).astype(jnp.float32)[None].repeat(4, 0)  # some positions masked

    def plain(x, w):
        return (loss.cross_entropy(x @ w, y) * weights).sum() / weights.sum()

    def chunked(x, w):
        return loss.weighted_cross_entropy_sum(lambda xc: xc @ w, x, y, weights, chunk=16) / weights.sum()

    (lp, gp), (lc, gc) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w) for f in (plain, chunked))
    np.testing.assert_allclose(lc, lp, rtol=1e-6)
    for a, b in zip(gc, gp):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    assert loss.weighted_cross_entropy_sum(lambda xc: xc @ w, x, y, weights, chunk=0) / weights.sum() == plain(x, w)
    np.testing.assert_allclose(jax.jit(chunked)(x, w), lp, rtol=1e-6)  # the forward alone (evaluation)


def test_chunked_loss_computes_each_chunks_logits_once():
    """The gradient's program has three vocabulary-sized matmuls per chunk (logits, their gradient
    with respect to x and to the head), as the plain loss's: no chunk's logits are recomputed."""
    x, w, y = setup(v=50)

    def vocab_dots(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and 50 in (eqn.outvars[0].aval.shape + eqn.invars[0].aval.shape
                                                              + eqn.invars[1].aval.shape):
                n += 1
            subs = jax.extend.core.jaxprs_in_params(eqn.params)
            n += sum(vocab_dots(sub.jaxpr if hasattr(sub, "jaxpr") else sub) for sub in subs)
        return n

    def f(chunk):
        return lambda x, w: loss.weighted_cross_entropy_sum(lambda xc: xc @ w, x, y, jnp.ones(y.shape), chunk)
    assert [vocab_dots(jax.make_jaxpr(jax.grad(f(c), argnums=(0, 1)))(x, w).jaxpr) for c in (0, 16)] == [3, 3]


@pytest.mark.parametrize("axes", [dict(data=2, fsdp=2, tensor=2), dict(data=2, context=2, tensor=2)])
def test_chunked_sharded_matches_and_never_holds_full_logits(axes):
    """On a 2x2x2 mesh the chunked loss matches; its compiled program has no B x T x V array, and
    with the sequence split over `context` no chunk crosses devices (no all-to-all, no gather)."""
    mesh = mesh_lib.make_mesh(MeshConfig(**axes))
    c = sharding.Constrain(RulesConfig(), mesh)
    x, w, y = setup(b=8, t=64, d=16, v=48)

    def f(x, w, chunk):
        head = lambda xc: c(xc @ w, ("batch", "seq", "vocab"))  # noqa: E731
        return loss.weighted_cross_entropy_sum(head, c(x, ("batch", "seq", None)), y, jnp.ones(y.shape), chunk,
                                               seq_shards=c.size("seq")) / y.size

    with jax.set_mesh(mesh):
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)), static_argnums=2)
        (lc, gc), (lp, gp) = grad(x, w, 8), grad(x, w, 0)
        hlo = grad.lower(x, w, 8).compile().as_text()
    np.testing.assert_allclose(lc, lp, rtol=1e-6)
    for a, b in zip(gc, gp):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    # per device: batch 8 / 2 or 4 ways, vocab 48 / 2 ways; the full sequence would be f32[b,64,24]
    b = 8 // (axes["data"] * axes.get("fsdp", 1))
    assert f"f32[{b},64,24]" not in hlo and f"f32[{b},8,24]" in hlo
    if "context" in axes:
        assert "all-to-all" not in hlo and "all-gather" not in hlo
