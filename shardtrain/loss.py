"""Next-token cross-entropy, plain and chunked over the sequence.

The plain loss materialises fp32 logits B x T x V (and their gradient): for Llama-3's 128k
vocabulary at 4 x 8192 tokens per chip that is 16.8 GB. `weighted_cross_entropy_sum` applies the
model's head to C positions at a time inside a `lax.scan` that computes each chunk's gradients
as it goes: at most B x C x V logits exist at once, and none is computed twice. Same loss and
gradients as the plain one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits_btv, targets_bt, one_hot: bool = False):
    """Per-token cross-entropy (B, T), float32. `one_hot`: the target's logit picked by a one-hot
    product instead of a gather (inside a pipeline stage, XLA's CPU partitioner aborts on the gather
    from vocabulary-split logits: spmd_partitioner_util.cc "Check failed: ... num_devices_per_group")."""
    logits_btv = logits_btv.astype(jnp.float32)
    if one_hot:
        picked_bt = (jax.nn.one_hot(targets_bt, logits_btv.shape[-1], dtype=logits_btv.dtype) * logits_btv).sum(-1)
        return jax.nn.logsumexp(logits_btv, axis=-1) - picked_bt
    return optax.softmax_cross_entropy_with_integer_labels(logits_btv, targets_bt)


def n_chunks(t: int, chunk: int, seq_shards: int = 1) -> int:
    """How many chunks `weighted_cross_entropy_sum` computes T positions in (1: the plain loss)."""
    local = t // seq_shards
    return 1 if chunk <= 0 or chunk >= local else local // chunk


def weighted_cross_entropy_sum(head: Callable, x_btd, targets_bt, weights_bt, chunk: int, seq_shards: int = 1,
                               one_hot: bool = False):
    """`(cross_entropy(head(x_btd), targets_bt) * weights_bt).sum()` computed `chunk` positions at a
    time (0 or >= T: one chunk, the plain loss). `head` maps x_bcd -> logits_bcv for any length c.

    Chunked, the forward pass also computes each chunk's gradients (the loss is the end of the
    program, so the gradient of its logits is known there): it keeps the gradient with respect to
    x_btd and the sum over chunks of the gradients with respect to what `head` closes over (e.g.
    the unembedding), and the backward pass only scales them. No chunk's logits are computed twice.

    With the sequence split over `seq_shards` devices (context parallelism: device s holds positions
    s T/S .. (s+1) T/S - 1), each chunk takes `chunk` positions from every device's part alike, so no
    chunk crosses devices (the sum does not depend on the order) and each device computes B x chunk
    x V logits at a time; `chunk` must divide T / seq_shards (or be >= it: one chunk)."""
    b, t = targets_bt.shape
    n = n_chunks(t, chunk, seq_shards)
    if n == 1:
        return (cross_entropy(head(x_btd), targets_bt, one_hot) * weights_bt).sum()

    def split(a):  # (B, T, ...) -> (N, B, S C, ...): chunk i holds positions s T/S + i C + (0..C-1) of every s
        a = a.reshape(b, seq_shards, n, chunk, *a.shape[2:])
        return jnp.moveaxis(a, 2, 0).reshape(n, b, seq_shards * chunk, *a.shape[4:])

    x_nbcd = split(x_btd)
    head_with_params, params = jax.closure_convert(head, x_nbcd[0])  # its parameters become arguments
    return _chunked_sum(head_with_params, one_hot, x_nbcd, split(targets_bt), split(weights_bt), *params)


def _chunk_sum(head, one_hot, x_bcd, params, y_bc, w_bc):
    """One chunk's weighted loss sum, `head` taking its parameters as arguments."""
    return (cross_entropy(head(x_bcd, *params), y_bc, one_hot) * w_bc).sum()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_sum(head, one_hot, x_nbcd, y_nbc, w_nbc, *params):
    def body(total, xyw):
        x_bcd, y_bc, w_bc = xyw
        return total + _chunk_sum(head, one_hot, x_bcd, params, y_bc, w_bc), None
    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (x_nbcd, y_nbc, w_nbc))[0]


def _chunked_sum_fwd(head, one_hot, x_nbcd, y_nbc, w_nbc, *params):
    def body(carry, xyw):
        total, dparams = carry
        x_bcd, y_bc, w_bc = xyw
        value, (dx_bcd, dchunk) = jax.value_and_grad(_chunk_sum, argnums=(2, 3))(
            head, one_hot, x_bcd, params, y_bc, w_bc)
        return (total + value, jax.tree.map(jnp.add, dparams, dchunk)), dx_bcd

    zeros = jax.tree.map(jnp.zeros_like, params)
    (total, dparams), dx_nbcd = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), (x_nbcd, y_nbc, w_nbc))
    return total, (dx_nbcd, dparams)


def _chunked_sum_bwd(head, one_hot, saved, g):
    dx_nbcd, dparams = saved
    scale = lambda d: (d * g).astype(d.dtype)  # noqa: E731
    return (scale(dx_nbcd), None, None, *map(scale, dparams))


_chunked_sum.defvjp(_chunked_sum_fwd, _chunked_sum_bwd)
