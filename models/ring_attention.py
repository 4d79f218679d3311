"""Ring attention: causal grouped-query attention with the sequence split over devices.

    o_bthe = ring_attend(q_bthe, k_btke, v_btke, positions_bt, segment_ids_bt=None, constrain=c)

Shapes: B batch, T sequence (each device holds T / n of it), H query heads, K key/value heads
(G = H / K), E head dim. q is not pre-scaled.

Each device keeps its queries and passes its key/value block (with the blocks' positions and
segment ids) around the ring of the n devices that split `seq` (`Shard.ring_shift`, a
`ppermute`): in each of n steps it first issues the transfer of the block it holds to the next
device, then attends its queries to that block, folding the scores into an online softmax
(running max, denominator and weighted sum, all in float32), so the transfer overlaps the block's
computation. After n steps every query has seen every key; no device ever holds the whole
sequence's keys and values.

Masks come from the positions that travel with each block (query position >= key position, and
equal segment ids for packed documents), so the layout of the sequence is free. The trainer uses
the causal load-balanced one: the sequence cut into 2 n chunks, device i holding chunks i and
2n-1-i, so every device has the same number of query-key pairs below the diagonal (with a plain
split the last device would have n times the first's). Every block is computed in full with its
mask (2x the FLOPs that skipping the masked half would need; each device's work is equal).

Without a mesh, or when `seq` is not split, this is one block: plain causal attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Q = ("batch", "seq", "heads", None)
KV = ("batch", "seq", "kv_heads", None)
BT = ("batch", "seq")


def load_balanced_order(t: int, n: int):
    """Positions 0..t-1 in the order that puts chunks i and 2n-1-i (of 2n) on device i."""
    import numpy as np
    chunks = np.arange(t).reshape(2 * n, t // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def _block(q_bqkge, k_bske, v_bske, pos_q_bq, pos_k_bs, seg_q_bq, seg_k_bs, m_bkgq, l_bkgq, acc_bqkge):
    """Folds one key/value block into the online softmax (m: running max, l: denominator)."""
    s_bkgqs = jnp.einsum("bqkge,bske->bkgqs", q_bqkge, k_bske, preferred_element_type=jnp.float32)
    allowed_bqs = (pos_q_bq[:, :, None] >= pos_k_bs[:, None, :]) & (seg_q_bq[:, :, None] == seg_k_bs[:, None, :])
    s_bkgqs = jnp.where(allowed_bqs[:, None, None], s_bkgqs, -jnp.inf)
    m_new = jnp.maximum(m_bkgq, s_bkgqs.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing allowed yet
    p_bkgqs = jnp.exp(s_bkgqs - m_safe[..., None])
    corr_bkgq = jnp.exp(m_bkgq - m_safe)
    l_new = l_bkgq * corr_bkgq + p_bkgqs.sum(-1)
    pv_bqkge = jnp.einsum("bkgqs,bske->bqkge", p_bkgqs.astype(v_bske.dtype), v_bske, preferred_element_type=jnp.float32)
    acc_new = acc_bqkge * corr_bkgq.transpose(0, 3, 1, 2)[..., None] + pv_bqkge
    return m_new, l_new, acc_new


def ring_local(shard, q_bthe, k_btke, v_btke, pos_bt, seg_bt):
    """One device's queries against every device's keys/values, passed around the `seq` ring."""
    b, t, h, e = q_bthe.shape
    kh = k_btke.shape[2]
    g = h // kh
    n = shard.size("seq")
    q_bqkge = (q_bthe * jnp.asarray(e ** -0.5, q_bthe.dtype)).reshape(b, t, kh, g, e)
    fold = jax.checkpoint(_block)  # the backward pass recomputes each block's scores
    m = shard.like(jnp.full((b, kh, g, t), -jnp.inf, jnp.float32), q_bqkge, k_btke, v_btke)
    l = shard.like(jnp.zeros((b, kh, g, t), jnp.float32), q_bqkge, k_btke, v_btke)
    acc = shard.like(jnp.zeros((b, t, kh, g, e), jnp.float32), q_bqkge, k_btke, v_btke)

    def step(carry, _):
        kv, m, l, acc = carry
        nxt = shard.ring_shift(kv, "seq")  # issued first: the transfer overlaps this block's compute
        k_bske, v_bske, pos_k_bs, seg_k_bs = kv
        m, l, acc = fold(q_bqkge, k_bske, v_bske, pos_bt, pos_k_bs, seg_bt, seg_k_bs, m, l, acc)
        return (nxt, m, l, acc), None

    kv = (k_btke, v_btke, pos_bt, seg_bt)
    if n > 1:
        (kv, m, l, acc), _ = jax.lax.scan(step, (kv, m, l, acc), None, length=n - 1)
    m, l, acc = fold(q_bqkge, *kv[:2], pos_bt, kv[2], seg_bt, kv[3], m, l, acc)  # the last block: no transfer
    return (acc / l.transpose(0, 3, 1, 2)[..., None]).reshape(b, t, h, e).astype(q_bthe.dtype)


def ring_attend(q_bthe, k_btke, v_btke, positions_bt, segment_ids_bt=None, *, constrain):
    """Causal attention with the sequence split over `seq` (see the module docstring)."""
    seg_bt = jnp.zeros(q_bthe.shape[:2], jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    pos_bt = jnp.arange(q_bthe.shape[1]) if positions_bt is None else positions_bt
    pos_bt = jnp.broadcast_to(pos_bt, q_bthe.shape[:2]).astype(jnp.int32)
    local = constrain.per_shard(ring_local, (Q, KV, KV, BT, BT), Q)
    return local(q_bthe, k_btke, v_btke, pos_bt, seg_bt)
