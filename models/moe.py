"""Mixture-of-experts SwiGLU MLP: a top-k router, dropless (or capacity-capped) sort-based
dispatch, grouped matmuls (`jax.lax.ragged_dot`), and expert parallelism by all-to-all.

Shapes: B batch, T sequence, D d_model, F d_ff (per expert), E experts, k experts per token,
N tokens on a device, A = N k assignments, P expert shards (devices along `experts`), El = E / P
experts per shard, S rows each shard sends to each other shard.

Routing (Hugging Face's Mixtral / Qwen-MoE): p = softmax(router logits) over all E experts, in
float32; the k largest are the token's experts; their probabilities, renormalised to sum to 1
(`norm_topk_prob`, Mixtral and Qwen3-MoE) or not (Qwen2-MoE's default), weight the experts'
outputs. Shared experts (`n_shared_experts`, one SwiGLU MLP of `shared_expert_d_ff` hidden units)
see every token; with `shared_expert_gate` (Qwen2-MoE) their output is scaled by
sigmoid(h . w_gate). gpt-oss adds a learned bias to the router logits (`router_logit_bias`; its
top-k of the logits then softmax over the k is this softmax renormalised over the k), biases to each
expert's projections (`expert_bias`; the down projection's is added outside the per-shard code,
weighted like its expert's output) and its clamped SwiGLU (`swiglu_limit`, `gated`).
Auxiliary losses, returned to the trainer as `aux` (already multiplied by their coefficients):
  moe_aux_loss  = coef x E x sum_e f_e P_e  (Switch / Mixtral load balancing: f_e the fraction of
                  tokens with e among their k, P_e the mean router probability of e; k at balance)
  router_z_loss = coef x mean(logsumexp(logits)^2)  (ST-MoE)
Both are computed over the whole global batch (outside the per-shard code), so every mesh gives
the same loss.

Dispatch, on each device's own tokens (`constrain.shard_map`, manual over every mesh axis):
sort the A assignments by expert, so those bound for each expert shard are contiguous, and send
each shard exactly its rows with one ragged all-to-all over `experts` (`jax.lax.ragged_all_to_all`;
the row counts go first, by a small all-to-all). Arrivals lie packed by sender, then local expert:
sort them by local expert and run the SwiGLU as three grouped matmuls (`ragged_dot`; the
receive buffer's unused rows sort last, outside every group); undo the sort, ragged all-to-all
back, weight and sum each token's k results. Nothing of size tokens x experts x capacity exists.
Every row move is a gather or scatter of distinct rows (`gather_rows`, `scatter_rows`), each the
other's gradient, so the backward pass builds no scatter-add.
Dropless: the receive buffer holds P N min(El, k) rows (a token's k experts are distinct, so at
most min(El, k) of its assignments go to one shard), the price of static shapes; only the routed
rows travel. With `capacity_factor` c each expert takes at most C = ceil(c A / E) assignments from
each device (the rest are dropped, in token order) and the buffer holds P min(A, El C) rows.
Without a mesh (or with one expert shard) the same code runs on one device; XLA:CPU, which has no
ragged all-to-all, gets a dense all-to-all of blocks with the same result (`Shard.ragged_all_to_all`).

Tensor parallelism inside: each device holds its experts' F / tensor hidden units, so expert
outputs are partial sums, psum'd over `mlp` once per token at the end. FSDP: the per-device
expert weights are all-gathered over `expert_embed` inside (their gradients reduce-scattered back).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from models import quant
from models.layers import dense, flat_matmuls, param

normal = nnx.initializers.normal
W_IN = ("experts", "expert_embed", "mlp")
W_OUT = ("experts", "mlp", "expert_embed")


def gated(gate, up, moe_cfg):
    """The experts' gated activation: silu(gate) * up, or gpt-oss's clamped SwiGLU (moe.swiglu_limit)."""
    limit = moe_cfg.swiglu_limit
    if limit is None:
        return jax.nn.silu(gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(moe_cfg.swiglu_alpha * gate)


def swiglu(x_btd, w_gate_df, w_up_df, w_down_fd, flat=True, quantization="none"):
    def mm(x, w):
        return dense(x, w, flat=flat, quantization=quantization)
    return mm(jax.nn.silu(mm(x_btd, w_gate_df)) * mm(x_btd, w_up_df), w_down_fd)


def grouped(x_rd, w_edf, group_e, quantization="none"):
    """Rows x_rd (sorted by group, group_e rows each, padding after) times their group's w_edf."""
    return quant.grouped_dot(x_rd, w_edf, group_e, quantization)


@jax.custom_vjp
def gather_rows(x_nd, index_s):
    """x_nd[index_s] for distinct indices (those >= n give zero rows). Its gradient scatters back
    (`scatter_rows`) instead of the scatter-add XLA makes of a gather's, whose indices may repeat."""
    return x_nd.at[index_s].get(mode="fill", fill_value=0, unique_indices=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def scatter_rows(x_sd, index_s, n: int):
    """A zero (n, ...) array whose row index_s[i] is x_sd[i], for distinct indices (those >= n are
    dropped); its gradient is `gather_rows`."""
    return jnp.zeros((n, *x_sd.shape[1:]), x_sd.dtype).at[index_s].set(x_sd, mode="drop", unique_indices=True)


gather_rows.defvjp(lambda x_nd, index_s: (gather_rows(x_nd, index_s), (index_s, x_nd.shape[0])),
                   lambda res, g_sd: (scatter_rows(g_sd, *res), None))
scatter_rows.defvjp(lambda x_sd, index_s, n: (scatter_rows(x_sd, index_s, n), index_s),
                    lambda n, index_s, g_nd: (gather_rows(g_nd, index_s), None))


def route(logits_bte, k: int, constrain, normalise: bool = True):
    """(top-k expert ids, their weights: probabilities, renormalised over the k when `normalise`,
    router probabilities). The top-k runs per shard: XLA's partitioner would gather the
    probabilities of the whole batch for it."""
    probs = jax.nn.softmax(logits_bte.astype(jnp.float32), axis=-1)
    bte = ("batch", "seq", None)
    top_p, top_i = constrain.shard_map(lambda shard, p: tuple(jax.lax.top_k(p, k)), (bte,), (bte, bte))(probs)
    return top_i, top_p / top_p.sum(-1, keepdims=True) if normalise else top_p, probs


def route_sigmoid(logits_bte, bias_e, cfg, constrain):
    """DeepSeek-V3's routing: (top-k expert ids, their weights, the scores). Each expert scores
    sigmoid(logit); the choice ranks score + bias_e (the load-balancing bias, out of the gradient)
    among the experts of the token's topk_groups best groups (a group's rank: the sum of its two
    best biased scores); the weights are the chosen raw scores, renormalised over the k when
    norm_topk_prob, times routed_scaling_factor. Per shard, as `route`."""
    m = cfg.moe
    scores = jax.nn.sigmoid(logits_bte.astype(jnp.float32))
    bias_e = jax.lax.stop_gradient(bias_e.astype(jnp.float32))

    def choose(shard, scores):
        choice = scores + bias_e
        *lead, e = choice.shape
        groups = choice.reshape(*lead, m.n_groups, e // m.n_groups)
        group_score = jax.lax.top_k(groups, min(2, e // m.n_groups))[0].sum(-1)  # (..., G)
        kept = jax.lax.top_k(group_score, m.topk_groups)[1]
        keep_g = jax.nn.one_hot(kept, m.n_groups, dtype=jnp.bool_).any(-2)
        keep_e = jnp.repeat(keep_g, e // m.n_groups, axis=-1)
        top_i = jax.lax.top_k(jnp.where(keep_e, choice, -jnp.inf), m.experts_per_token)[1]
        return (top_i,)
    bte = ("batch", "seq", None)
    (top_i,) = constrain.shard_map(choose, (bte,), (bte,))(scores)
    weight = jnp.take_along_axis(scores, top_i, axis=-1)
    if m.norm_topk_prob:
        weight = weight / (weight.sum(-1, keepdims=True) + 1e-20)
    return top_i, weight * m.routed_scaling_factor, scores


def expert_load(top_i_btk, n_experts: int):
    """The fraction of the batch's assignments each expert got (E,), out of the gradient."""
    return jax.nn.one_hot(top_i_btk, n_experts, dtype=jnp.float32).sum(-2).mean((0, 1)) / top_i_btk.shape[-1]


def balance_bias(bias_le, load_le, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing step: each expert's bias moves by `rate` towards
    balance, up where its load is under the mean, down where over (per layer: the last axis)."""
    return bias_le + rate * jnp.sign(load_le.mean(-1, keepdims=True) - load_le)


def aux_losses(logits_bte, probs_bte, top_i_btk, cfg) -> dict:
    e = logits_bte.shape[-1]
    f_e = jax.nn.one_hot(top_i_btk, e, dtype=jnp.float32).sum(-2).mean((0, 1))
    p_e = probs_bte.mean((0, 1))
    z = jax.nn.logsumexp(logits_bte.astype(jnp.float32), axis=-1)
    return {"moe_aux_loss": cfg.moe.router_aux_loss_coef * e * jnp.sum(f_e * p_e),
            "router_z_loss": cfg.moe.router_z_loss_coef * jnp.mean(z * z)}


def shared_d_ff(cfg) -> int:
    """Hidden units of the shared experts' one SwiGLU MLP."""
    return cfg.moe.shared_expert_d_ff or cfg.moe.n_shared_experts * cfg.d_ff


def inactive_params(cfg) -> int:
    """Expert parameters of one layer a token does not multiply with (for its FLOPs)."""
    return (cfg.moe.n_experts - cfg.moe.experts_per_token) * 3 * cfg.d_model * cfg.d_ff


def capacity(cfg, assignments: int) -> int | None:
    """Assignments each expert takes from one device's tokens (None: dropless)."""
    if cfg.moe.capacity_factor is None:
        return None
    return max(1, math.ceil(cfg.moe.capacity_factor * assignments / cfg.moe.n_experts))


def exclusive_cumsum(x):
    return jnp.cumsum(x) - x


def experts_local(shard, x_btd, top_i_btk, weight_btk, w_gate_edf, w_up_edf, w_down_efd, b_gate_ef=None,
                  b_up_ef=None, *, cfg, quantization="none"):
    """One device's tokens through their experts (see the module docstring), the grouped matmuls
    quantized by `quantization`, plus the experts' gate and up biases (E, F) where given (the down
    projection's bias is the caller's: it would be summed over `mlp` here); returns out_btd."""
    b, t, d = x_btd.shape
    k = top_i_btk.shape[-1]
    w_gate_edf = shard.all_gather(w_gate_edf, "expert_embed", axis=1)
    w_up_edf = shard.all_gather(w_up_edf, "expert_embed", axis=1)
    w_down_efd = shard.all_gather(w_down_efd, "expert_embed", axis=2)
    p, el = shard.size("experts"), w_gate_edf.shape[0]
    e, n = p * el, b * t
    a = n * k
    expert_a = top_i_btk.reshape(a)
    count_e = jnp.zeros((e,), jnp.int32).at[expert_a].add(1)
    cap = capacity(cfg, a)
    if cap is None:
        kept_e, sort_a = count_e, expert_a
    else:  # an expert keeps its first `cap` assignments in token order; the dropped ones sort last
        by_expert_a = jnp.argsort(expert_a, stable=True)
        rank_a = jnp.zeros((a,), jnp.int32).at[by_expert_a].set(
            jnp.arange(a) - exclusive_cumsum(count_e)[expert_a[by_expert_a]], unique_indices=True)
        kept_e, sort_a = jnp.minimum(count_e, cap), jnp.where(rank_a < cap, expert_a, e)
    order_a = jnp.argsort(sort_a, stable=True)  # sent rows: by expert (so by shard), then token
    # rows this device sends each shard, and receives from each, per local expert
    recv_pl = shard.all_to_all(kept_e.reshape(p, el), "experts")
    send_p, recv_p = kept_e.reshape(p, el).sum(1), recv_pl.sum(1)
    send_at_p, recv_at_p = exclusive_cumsum(send_p), exclusive_cumsum(recv_p)
    rows = p * (n * min(el, k) if cap is None else min(a, el * cap))  # the most one device can receive
    x_ad = gather_rows(jnp.repeat(x_btd.reshape(n, d), k, axis=0), order_a)
    recv_rd = shard.ragged_all_to_all(x_ad, jnp.zeros((rows, d), x_ad.dtype), send_at_p, send_p,
                                      shard.all_to_all(recv_at_p, "experts"), recv_p, "experts")
    # arrivals: by sender, then local expert; grouped SwiGLU over the local experts, padding last
    ends = jnp.cumsum(recv_pl.reshape(-1))
    local_r = jnp.searchsorted(ends, jnp.arange(rows), side="right", method="compare_all")
    local_r = jnp.where(local_r < p * el, local_r % el, el)
    order_r = jnp.argsort(local_r, stable=True)
    group_l = jnp.zeros((el + 1,), jnp.int32).at[local_r].add(1)[:el]
    x_rd = gather_rows(recv_rd, order_r)
    q = quantization
    gate_rf, up_rf = grouped(x_rd, w_gate_edf, group_l, q), grouped(x_rd, w_up_edf, group_l, q)
    if b_gate_ef is not None:  # each sorted row's local expert (el: padding, a zero bias)
        expert_r = jnp.sort(local_r)
        gate_rf = gate_rf + b_gate_ef.at[expert_r].get(mode="fill", fill_value=0).astype(gate_rf.dtype)
        up_rf = up_rf + b_up_ef.at[expert_r].get(mode="fill", fill_value=0).astype(up_rf.dtype)
    y_rd = grouped(gated(gate_rf, up_rf, cfg.moe), w_down_efd, group_l, q)
    y_rd = jnp.where((jnp.arange(rows) < group_l.sum())[:, None], y_rd, 0)
    y_ad = shard.ragged_all_to_all(scatter_rows(y_rd, order_r, rows), jnp.zeros((a, d), y_rd.dtype), recv_at_p,
                                   recv_p, shard.all_to_all(send_at_p, "experts"), send_p, "experts")
    y_nkd = scatter_rows(y_ad, order_a, a).reshape(n, k, d)  # dropped assignments: zero
    out_nd = jnp.einsum("nkd,nk->nd", y_nkd.astype(jnp.float32), weight_btk.reshape(n, k).astype(jnp.float32))
    return shard.psum(out_nd, "mlp").astype(x_btd.dtype).reshape(b, t, d)


class Moe(nnx.Module):
    """`moe(h_btd) -> (out_btd, aux)`: the MoE MLP of one decoder block."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain, quantization="none"):
        d, f, e = cfg.d_model, cfg.d_ff, cfg.moe.n_experts
        self.cfg, self.constrain, self.quantization = cfg, constrain, quantization
        self.router_de = param(rngs, normal(d ** -0.5), (d, e), ("embed", None))
        if cfg.moe.router == "sigmoid":  # load-balancing state: no gradient, no optimizer update
            self.router_bias_e = param(rngs, nnx.initializers.zeros, (e,), (None,))
        if cfg.moe.router_logit_bias:  # a learned bias on the logits (gpt-oss)
            self.router_b_e = param(rngs, nnx.initializers.zeros, (e,), (None,))
        if cfg.moe.expert_bias:
            self.b_gate_ef = param(rngs, nnx.initializers.zeros, (e, f), ("experts", "mlp"))
            self.b_up_ef = param(rngs, nnx.initializers.zeros, (e, f), ("experts", "mlp"))
            self.b_down_ed = param(rngs, nnx.initializers.zeros, (e, d), (None, None))
        self.w_gate_edf = param(rngs, normal(d ** -0.5), (e, d, f), W_IN)
        self.w_up_edf = param(rngs, normal(d ** -0.5), (e, d, f), W_IN)
        self.w_down_efd = param(rngs, normal(f ** -0.5 / 2), (e, f, d), W_OUT)
        if cfg.moe.n_shared_experts:
            s = shared_d_ff(cfg)
            self.shared_w_gate_df = param(rngs, normal(d ** -0.5), (d, s), ("embed", "mlp"))
            self.shared_w_up_df = param(rngs, normal(d ** -0.5), (d, s), ("embed", "mlp"))
            self.shared_w_down_fd = param(rngs, normal(s ** -0.5 / 2), (s, d), ("mlp", "embed"))
            if cfg.moe.shared_expert_gate:
                self.shared_expert_gate_d1 = param(rngs, normal(d ** -0.5), (d, 1), ("embed", None))

    def __call__(self, h_btd):
        c, cfg = self.constrain, self.cfg
        flat = flat_matmuls(c)
        logits_bte = dense(h_btd.astype(jnp.float32), self.router_de[...].astype(jnp.float32), flat=flat)
        if hasattr(self, "router_b_e"):
            logits_bte = logits_bte + self.router_b_e[...].astype(jnp.float32)
        if cfg.moe.router == "sigmoid":
            top_i_btk, weight_btk, probs_bte = route_sigmoid(logits_bte, self.router_bias_e[...], cfg, c)
            aux = {"router_load": jax.lax.stop_gradient(expert_load(top_i_btk, cfg.moe.n_experts))}
        else:
            top_i_btk, weight_btk, probs_bte = route(logits_bte, cfg.moe.experts_per_token, c,
                                                     cfg.moe.norm_topk_prob)
            aux = aux_losses(logits_bte, probs_bte, top_i_btk, cfg)
        btk = ("batch", "seq", None)
        biases = (self.b_gate_ef[...], self.b_up_ef[...]) if cfg.moe.expert_bias else ()
        local = c.shard_map(lambda shard, *xs: experts_local(shard, *xs, cfg=cfg, quantization=self.quantization),
                            (("batch", "seq", None), btk, btk, W_IN, W_IN, W_OUT, *[("experts", "mlp")] * len(biases)),
                            ("batch", "seq", None))
        out_btd = local(h_btd, top_i_btk, weight_btk, self.w_gate_edf[...], self.w_up_edf[...], self.w_down_efd[...],
                        *biases)
        if cfg.moe.expert_bias:  # each chosen expert's down bias, weighted as its output
            b_btkd = self.b_down_ed[...][top_i_btk].astype(jnp.float32)
            bias_btd = jnp.einsum("btkd,btk->btd", b_btkd, weight_btk.astype(jnp.float32))
            out_btd = out_btd + bias_btd.astype(out_btd.dtype)
        if cfg.moe.n_shared_experts:
            shared = (self.shared_w_gate_df[...], self.shared_w_up_df[...], self.shared_w_down_fd[...])
            shared_btd = swiglu(h_btd, *shared, flat, self.quantization)
            if cfg.moe.shared_expert_gate:
                shared_btd = jax.nn.sigmoid(dense(h_btd, self.shared_expert_gate_d1[...], flat=flat)) * shared_btd
            out_btd = out_btd + shared_btd
        return c(out_btd, ("batch", "seq", None)), aux
