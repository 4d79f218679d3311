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


def weighted_cross_entropy_sum(head: Callable, x_btd, targets_bt, weights_bt, chunk: int):
    """`(cross_entropy(head(x_btd), targets_bt) * weights_bt).sum()` computed `chunk` positions at a
    time (0 or >= T: one chunk, the plain loss). `head` maps x_bcd -> logits_bcv for any length c."""
    b, t = targets_bt.shape
    if chunk <= 0 or chunk >= t:
        return (cross_entropy(head(x_btd), targets_bt) * weights_bt).sum()
    n = t // chunk

    def split(a):  # (B, T, ...) -> (N, B, C, ...)
        return a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint  # the backward pass recomputes this chunk's logits instead of saving them
    def chunk_sum(x_bcd, y_bc, w_bc):
        return (cross_entropy(head(x_bcd), y_bc) * w_bc).sum()

    def body(total, xyw):
        return total + chunk_sum(*xyw), None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x_btd), split(targets_bt), split(weights_bt)))[0]
