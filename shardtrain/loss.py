"""Next-token cross-entropy, plain and chunked over the sequence.

The plain loss materialises fp32 logits B x T x V (and their gradient): for Llama-3's 128k
vocabulary at 4 x 8192 tokens per chip that is 16.8 GB. `weighted_cross_entropy_sum` applies the
model's head to C positions at a time inside a `lax.scan` whose body is rematerialised, so the
forward keeps only each chunk's loss sum and the backward recomputes one chunk's logits at a time:
at most B x C x V logits exist at once. Same loss and gradients as the plain one.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits_btv, targets_bt):
    """Per-token cross-entropy (B, T), float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_btv.astype(jnp.float32), targets_bt)


def n_chunks(t: int, chunk: int, seq_shards: int = 1) -> int:
    """How many chunks `weighted_cross_entropy_sum` computes T positions in (1: the plain loss)."""
    local = t // seq_shards
    return 1 if chunk <= 0 or chunk >= local else local // chunk


def weighted_cross_entropy_sum(head: Callable, x_btd, targets_bt, weights_bt, chunk: int, seq_shards: int = 1):
    """`(cross_entropy(head(x_btd), targets_bt) * weights_bt).sum()` computed `chunk` positions at a
    time (0 or >= T: one chunk, the plain loss). `head` maps x_bcd -> logits_bcv for any length c.

    With the sequence split over `seq_shards` devices (context parallelism: device s holds positions
    s T/S .. (s+1) T/S - 1), each chunk takes `chunk` positions from every device's part alike, so no
    chunk crosses devices (the sum does not depend on the order) and each device computes B x chunk
    x V logits at a time; `chunk` must divide T / seq_shards (or be >= it: one chunk)."""
    b, t = targets_bt.shape
    n = n_chunks(t, chunk, seq_shards)
    if n == 1:
        return (cross_entropy(head(x_btd), targets_bt) * weights_bt).sum()

    def split(a):  # (B, T, ...) -> (N, B, S C, ...): chunk i holds positions s T/S + i C + (0..C-1) of every s
        a = a.reshape(b, seq_shards, n, chunk, *a.shape[2:])
        return jnp.moveaxis(a, 2, 0).reshape(n, b, seq_shards * chunk, *a.shape[4:])

    @jax.checkpoint  # the backward pass recomputes this chunk's logits instead of saving them
    def chunk_sum(x_bcd, y_bc, w_bc):
        return (cross_entropy(head(x_bcd), y_bc) * w_bc).sum()

    def body(total, xyw):
        return total + chunk_sum(*xyw), None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x_btd), split(targets_bt), split(weights_bt)))[0]
