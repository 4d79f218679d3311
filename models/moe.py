"""Mixture-of-experts SwiGLU MLP: a top-k router, dropless (or capacity-capped) sort-based
dispatch, grouped matmuls (`jax.lax.ragged_dot`), and expert parallelism by all-to-all.

Shapes: B batch, T sequence, D d_model, F d_ff (per expert), E experts, k experts per token,
N tokens on a device, A = N k assignments, P expert shards (devices along `experts`), El = E / P
experts per shard, S rows each shard sends to each other shard.

Routing (Mixtral's): p = softmax(router logits) over all E experts; the k largest are the token's
experts; their probabilities renormalised to sum to 1 weight the experts' outputs. Auxiliary
losses, returned to the trainer as `aux` (already multiplied by their coefficients):
  moe_aux_loss  = coef x E x sum_e f_e P_e  (Switch / Mixtral load balancing: f_e the fraction of
                  tokens with e among their k, P_e the mean router probability of e; k at balance)
  router_z_loss = coef x mean(logsumexp(logits)^2)  (ST-MoE)
Both are computed over the whole global batch (outside the per-shard code), so every mesh gives
the same loss.

Dispatch, on each device's own tokens (`constrain.shard_map`, manual over every mesh axis):
sort the A assignments by expert, so those bound for each expert shard are contiguous; scatter
them into a (P, S, D) send buffer, one block of S rows per destination shard; all-to-all over
`experts`; on arrival sort the P S rows by local expert and run the SwiGLU as three grouped
matmuls (`ragged_dot`; padding rows sort last, outside every group); undo the sort, all-to-all
back, weight and sum each token's k results. Nothing of size tokens x experts x capacity exists.
Dropless: S = A (a shard may receive every assignment of another), the buffers are P times what
balanced routing needs -- the price of static shapes (a `ragged_all_to_all` would remove it).
With `capacity_factor` c each expert takes at most C = ceil(c A / E) assignments from each
device (the rest are dropped, in token order) and S = El C. Without a mesh (or with one expert
shard) the same code runs without the all-to-all.

Tensor parallelism inside: each device holds its experts' F / tensor hidden units, so expert
outputs are partial sums, psum'd over `mlp` once per token at the end. FSDP: the per-device
expert weights are all-gathered over `embed` inside (their gradients reduce-scattered back).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import dense, param

normal = nnx.initializers.normal
W_IN = ("experts", "embed", "mlp")
W_OUT = ("experts", "mlp", "embed")


def swiglu(x_btd, w_gate_df, w_up_df, w_down_fd, flat=True):
    def mm(x, w):
        return dense(x, w, flat=flat)
    return mm(jax.nn.silu(mm(x_btd, w_gate_df)) * mm(x_btd, w_up_df), w_down_fd)


def grouped(x_rd, w_edf, group_e):
    """Rows x_rd (sorted by group, group_e rows each, padding after) times their group's w_edf."""
    return jax.lax.ragged_dot(x_rd, w_edf, group_e)


def route(logits_bte, k: int, constrain):
    """(top-k expert ids, their renormalised weights, router probabilities). The top-k runs per
    shard: XLA's partitioner would gather the probabilities of the whole batch for it."""
    probs = jax.nn.softmax(logits_bte.astype(jnp.float32), axis=-1)
    bte = ("batch", "seq", None)
    top_p, top_i = constrain.shard_map(lambda shard, p: tuple(jax.lax.top_k(p, k)), (bte,), (bte, bte))(probs)
    return top_i, top_p / top_p.sum(-1, keepdims=True), probs


def aux_losses(logits_bte, probs_bte, top_i_btk, cfg) -> dict:
    e = logits_bte.shape[-1]
    f_e = jax.nn.one_hot(top_i_btk, e, dtype=jnp.float32).sum(-2).mean((0, 1))
    p_e = probs_bte.mean((0, 1))
    z = jax.nn.logsumexp(logits_bte.astype(jnp.float32), axis=-1)
    return {"moe_aux_loss": cfg.router_aux_loss_coef * e * jnp.sum(f_e * p_e),
            "router_z_loss": cfg.router_z_loss_coef * jnp.mean(z * z)}


def inactive_params(cfg) -> int:
    """Expert parameters of one layer a token does not multiply with (for its FLOPs)."""
    return (cfg.n_experts - cfg.experts_per_token) * 3 * cfg.d_model * cfg.d_ff


def capacity(cfg, assignments: int) -> int | None:
    """Assignments each expert takes from one device's tokens (None: dropless)."""
    if cfg.capacity_factor is None:
        return None
    return max(1, math.ceil(cfg.capacity_factor * assignments / cfg.n_experts))


def experts_local(shard, x_btd, top_i_btk, weight_btk, w_gate_edf, w_up_edf, w_down_efd, *, cfg):
    """One device's tokens through their experts (see the module docstring); returns out_btd."""
    b, t, d = x_btd.shape
    k = top_i_btk.shape[-1]
    w_gate_edf = shard.all_gather(w_gate_edf, "embed", axis=1)
    w_up_edf = shard.all_gather(w_up_edf, "embed", axis=1)
    w_down_efd = shard.all_gather(w_down_efd, "embed", axis=2)
    p, el = shard.size("experts"), w_gate_edf.shape[0]
    e = p * el
    x_nd = x_btd.reshape(b * t, d)
    a = b * t * k
    expert_a = top_i_btk.reshape(a)
    order_a = jnp.argsort(expert_a, stable=True)  # assignment order: by expert, then token
    expert_s = expert_a[order_a]
    token_s = order_a // k
    count_e = jnp.zeros((e,), jnp.int32).at[expert_a].add(1)
    rank_s = jnp.arange(a) - (jnp.cumsum(count_e) - count_e)[expert_s]  # position in its expert
    cap = capacity(cfg, a)
    kept_e = count_e if cap is None else jnp.minimum(count_e, cap)
    keep_s = rank_s < (a if cap is None else cap)
    rows = a if cap is None else min(a, el * cap)  # S
    # row of an assignment in the block sent to its shard: kept rows of its shard's earlier experts + rank
    kept_pl = kept_e.reshape(p, el)
    offset_e = (jnp.cumsum(kept_pl, axis=1) - kept_pl).reshape(e)
    shard_s = expert_s // el
    row_s = jnp.where(keep_s, offset_e[expert_s] + rank_s, rows)  # rows: out of range, dropped
    send_psd = jnp.zeros((p, rows, d), x_btd.dtype).at[shard_s, row_s].set(x_nd[token_s], mode="drop")
    send_ps = jnp.full((p, rows), el, jnp.int32).at[shard_s, row_s].set(expert_s % el, mode="drop")
    recv_psd = shard.all_to_all(send_psd, "experts")
    recv_ps = shard.all_to_all(send_ps, "experts")
    # grouped SwiGLU over the local experts; padding (id el) sorts last, outside every group
    local_r = recv_ps.reshape(p * rows)
    order_r = jnp.argsort(local_r, stable=True)
    group_l = jnp.zeros((el + 1,), jnp.int32).at[local_r].add(1)[:el]
    x_rd = recv_psd.reshape(p * rows, d)[order_r]
    gate_rf = grouped(x_rd, w_gate_edf, group_l)
    up_rf = grouped(x_rd, w_up_edf, group_l)
    y_rd = grouped(jax.nn.silu(gate_rf) * up_rf, w_down_efd, group_l)
    y_rd = jnp.where((jnp.arange(p * rows) < group_l.sum())[:, None], y_rd, 0)
    y_psd = y_rd[jnp.argsort(order_r)].reshape(p, rows, d)
    back_psd = shard.all_to_all(y_psd, "experts")
    y_sd = jnp.where(keep_s[:, None], back_psd[shard_s, jnp.minimum(row_s, rows - 1)], 0)
    y_nkd = y_sd[jnp.argsort(order_a)].reshape(b * t, k, d)
    out_nd = jnp.einsum("nkd,nk->nd", y_nkd.astype(jnp.float32), weight_btk.reshape(b * t, k).astype(jnp.float32))
    return shard.psum(out_nd, "mlp").astype(x_btd.dtype).reshape(b, t, d)


class Moe(nnx.Module):
    """`moe(h_btd) -> (out_btd, aux)`: the MoE MLP of one decoder block."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.n_experts
        self.cfg, self.constrain = cfg, constrain
        self.router_de = param(rngs, normal(d ** -0.5), (d, e), ("embed", None))
        self.w_gate_edf = param(rngs, normal(d ** -0.5), (e, d, f), W_IN)
        self.w_up_edf = param(rngs, normal(d ** -0.5), (e, d, f), W_IN)
        self.w_down_efd = param(rngs, normal(f ** -0.5 / 2), (e, f, d), W_OUT)
        if cfg.n_shared_experts:
            s = cfg.n_shared_experts * f
            self.shared_gate_df = param(rngs, normal(d ** -0.5), (d, s), ("embed", "mlp"))
            self.shared_up_df = param(rngs, normal(d ** -0.5), (d, s), ("embed", "mlp"))
            self.shared_down_fd = param(rngs, normal(s ** -0.5 / 2), (s, d), ("mlp", "embed"))

    def __call__(self, h_btd):
        c, cfg = self.constrain, self.cfg
        flat = c.size("seq") == 1
        logits_bte = dense(h_btd.astype(jnp.float32), self.router_de[...].astype(jnp.float32), flat=flat)
        top_i_btk, weight_btk, probs_bte = route(logits_bte, cfg.experts_per_token, c)
        aux = aux_losses(logits_bte, probs_bte, top_i_btk, cfg)
        btk = ("batch", "seq", None)
        local = c.shard_map(lambda shard, *xs: experts_local(shard, *xs, cfg=cfg),
                            (("batch", "seq", None), btk, btk, W_IN, W_IN, W_OUT), ("batch", "seq", None))
        out_btd = local(h_btd, top_i_btk, weight_btk, self.w_gate_edf[...], self.w_up_edf[...], self.w_down_efd[...])
        if cfg.n_shared_experts:
            shared = (self.shared_gate_df[...], self.shared_up_df[...], self.shared_down_fd[...])
            out_btd = out_btd + swiglu(h_btd, *shared, flat)
        return c(out_btd, ("batch", "seq", None)), aux
