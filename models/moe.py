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
sort the A assignments by expert, so those bound for each expert shard are contiguous, and tell
every shard how many rows it gets per local expert (a small all-to-all of counts). A device's
arrivals form its receive stream: by sender, then local expert. The stream goes through in rounds
of R = receive_buffer x A rows (`dispatch_round`): each sender sends, by one ragged all-to-all over
`experts` (`jax.lax.ragged_all_to_all`), exactly its rows that fall in the receiver's current
window; the receiver sorts them by local expert and runs the SwiGLU as three grouped matmuls
(`ragged_dot`; unused rows of the window sort last, outside every group), and sends the results
back by ragged all-to-all to the rows they came from. Every device of an exchange runs as many
rounds as its most loaded shard needs (one when the load is within receive_buffer of balanced), so
results are exact, no row is dropped and memory stays one window's for any routing, all tokens
to one expert included. The rounds are a while loop whose gradient (`dispatch_rounds`, a
custom_vjp) keeps the first round's residuals and runs the later rounds again, each recomputing
its forward for its own backward: a loop of unknown length keeps no per-round residuals. Nothing
of size tokens x experts x capacity exists.
Every row move is a gather or scatter of distinct rows (`gather_rows`, `scatter_rows`), each the
other's gradient, so the backward pass builds no scatter-add.
The window never exceeds the most a device can receive: P N min(El, k) rows dropless (a token's k
experts are distinct, so at most min(El, k) of its assignments go to one shard). With
`capacity_factor` c each expert takes at most C = ceil(c A / E) assignments from each device (the
rest are dropped, in token order), at most P min(A, El C) rows.
The planner counts the first round only (the loops over later rounds, in the named scope
`OVERFLOW_SCOPE`, zero times): the cost of routing within receive_buffer of balanced.
Without a mesh (or with one expert shard) the same code runs on one device; XLA:CPU, which has no
ragged all-to-all, gets a dense all-to-all of blocks with the same result (`Shard.ragged_all_to_all`).

Tensor parallelism inside: each device holds its experts' F / tensor hidden units, so expert
outputs are partial sums, psum'd over `mlp` once per token at the end. FSDP: the per-device
expert weights are all-gathered over `expert_embed` inside (their gradients reduce-scattered back).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import grouped_gemm, quant
from models.layers import dense, flat_matmuls, gathered, param

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


def grouped(x_rd, w_edf, group_e, quantization="none", platform=None):
    """Rows x_rd (sorted by group, group_e rows each, padding after) times their group's w_edf: on
    NVIDIA GPUs by the 16-bit grouped-GEMM kernels (models/grouped_gemm.py; XLA:GPU makes `ragged_dot`
    a dense dot over every group) whatever `quantization` says, as no grouped kernel there takes int8 or
    fp8 operands; elsewhere by `ragged_dot`, quantized."""
    with jax.named_scope(GROUPED_SCOPE):
        if platform == "gpu" and grouped_gemm.supported(x_rd, w_edf):
            return grouped_gemm.gmm(x_rd, w_edf, group_e)
        return quant.grouped_dot(x_rd, w_edf, group_e, quantization)


GROUPED_SCOPE = "moe_grouped_matmul"
"""The named scope of the experts' grouped matmuls, forward and backward, by which `plan` tells their
FLOPs from the rest (`moe_flops_by_dtype`, shardtrain/plan/hlo/cost.py), whichever way a compiler
lowered them."""


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
                  b_up_ef=None, *, cfg, quantization="none", platform=None):
    """One device's tokens through their experts (see the module docstring), the grouped matmuls
    quantized by `quantization`, by kernels for `platform` (`grouped`), plus the experts' gate and up
    biases (E, F) where given (the down projection's bias is the caller's: it would be summed over
    `mlp` here); returns out_btd. With router `sigmoid_input` (Llama 4) the weights scale each
    assignment's input instead of its output."""
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
    routes = Routes(send_p, send_at_p, shard.all_to_all(recv_at_p, "experts"), recv_pl, recv_at_p,
                    shard.all_to_all(send_at_p, "experts"))
    most = p * (n * min(el, k) if cap is None else min(a, el * cap))  # the most one device can receive
    rows = min(most, math.ceil(cfg.moe.receive_buffer * a))
    if platform in ("gpu", "tpu"):  # the grouped kernels' row tiles: else the TPU's is a dense dot over every expert
        rows = -(-rows // grouped_gemm.ROW_MULTIPLE) * grouped_gemm.ROW_MULTIPLE
    rounds = -(-shard.pmax(recv_p.sum(), "experts") // rows)  # the same on every device of the exchange
    x_ad = jnp.repeat(x_btd.reshape(n, d), k, axis=0)
    if cfg.moe.router == "sigmoid_input":
        x_ad = (x_ad * weight_btk.reshape(a, 1)).astype(x_btd.dtype)
        weight_btk = jnp.ones_like(weight_btk)
    x_ad = gather_rows(x_ad, order_a)
    matmul = functools.partial(grouped, quantization=quantization, platform=platform)

    def ffn(x_rd, w_edfs, group_l, expert_r):  # the local experts' gated MLP over rows sorted by expert
        w_gate_edf, w_up_edf, w_down_efd, *biases = w_edfs
        gate_rf, up_rf = matmul(x_rd, w_gate_edf, group_l), matmul(x_rd, w_up_edf, group_l)
        if biases:  # each row's local expert's (expert_r = el: padding, a zero bias)
            gate_rf, up_rf = (y + b.at[expert_r].get(mode="fill", fill_value=0).astype(y.dtype)
                              for y, b in zip((gate_rf, up_rf), biases))
        return matmul(gated(gate_rf, up_rf, cfg.moe), w_down_efd, group_l)
    biases = () if b_gate_ef is None else (b_gate_ef, b_up_ef)
    y_ad = dispatch_rounds(shard, rows, ffn, x_ad, (w_gate_edf, w_up_edf, w_down_efd, *biases), routes, rounds)
    y_nkd = scatter_rows(y_ad, order_a, a).reshape(n, k, d)  # dropped assignments: zero
    out_nd = jnp.einsum("nkd,nk->nd", y_nkd.astype(jnp.float32), weight_btk.reshape(n, k).astype(jnp.float32))
    return shard.psum(out_nd, "mlp").astype(x_btd.dtype).reshape(b, t, d)


OVERFLOW_SCOPE = "moe_overflow_rounds"
"""The named scope of the loops over rounds past the first, which `plan` counts zero times
(shardtrain/plan/hlo/parse.py): its figures are those of routing within receive_buffer of balanced."""


class Routes(NamedTuple):
    """Who sends how many rows where, per expert shard j (this device's view; int32 arrays)."""
    send_p: jax.Array  # rows this device sends shard j
    send_at_p: jax.Array  # where they start among this device's sorted rows
    dest_at_p: jax.Array  # where they start in j's receive stream
    recv_pl: jax.Array  # rows this device receives from shard j, per local expert
    recv_at_p: jax.Array  # where j's rows start in this device's receive stream
    src_at_p: jax.Array  # where they start among j's sorted rows


def dispatch_round(shard, rows: int, ffn, r, x_ad, w_edfs, routes: Routes, y_ad):
    """Round r of dispatch: the rows of every device's receive stream (arrivals by sender, then
    local expert) at [r rows, (r + 1) rows) go to their device by ragged all-to-all, through its
    experts (`ffn(x_rd, w_edfs, group_e, expert_r)`: rows sorted by local expert), and back into
    y_ad (A, d) at the rows they came from; y_ad's other rows stay."""
    send_p, send_at_p, dest_at_p, recv_pl, recv_at_p, src_at_p = routes
    recv_p, start = recv_pl.sum(1), r * rows
    # the part of each block inside the window: [lo, hi) of its rows, at both ends of the exchange
    lo_p, hi_p = (jnp.clip(start + s - dest_at_p, 0, send_p) for s in (0, rows))
    rlo_p, rhi_p = (jnp.clip(start + s - recv_at_p, 0, recv_p) for s in (0, rows))
    sent_p, got_p = hi_p - lo_p, rhi_p - rlo_p
    d, el = x_ad.shape[1], recv_pl.shape[1]
    recv_rd = shard.ragged_all_to_all(x_ad, jnp.zeros((rows, d), x_ad.dtype), send_at_p + lo_p, sent_p,
                                      jnp.where(sent_p > 0, dest_at_p + lo_p - start, 0), got_p, "experts")
    # arrivals: by sender, then local expert; grouped SwiGLU over the local experts, padding last
    ends = jnp.cumsum(recv_pl.reshape(-1))
    local_r = jnp.searchsorted(ends, start + jnp.arange(rows), side="right", method="compare_all")
    local_r = jnp.where(local_r < ends.shape[0], local_r % el, el)
    order_r = jnp.argsort(local_r, stable=True)
    group_l = jnp.zeros((el + 1,), jnp.int32).at[local_r].add(1)[:el]
    x_rd = gather_rows(recv_rd, order_r)
    y_rd = ffn(x_rd, w_edfs, group_l, jnp.sort(local_r))
    y_rd = jnp.where((jnp.arange(rows) < group_l.sum())[:, None], y_rd, 0)
    back_at_p = jnp.where(got_p > 0, recv_at_p + rlo_p - start, 0)
    return shard.ragged_all_to_all(scatter_rows(y_rd, order_r, rows), y_ad, back_at_p, got_p, src_at_p + rlo_p, sent_p,
                                   "experts")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def dispatch_rounds(shard, rows: int, ffn, x_ad, w_edfs, routes: Routes, rounds):
    """y_ad: every sorted row of x_ad through its expert, in `rounds` rounds of `dispatch_round`
    (the first, then a while loop for the rest: memory is one round's whatever the routing). Its
    gradient keeps the first round's residuals (the only round when routing is within
    receive_buffer of balanced, so that costs what one ragged pass does) and runs the later rounds
    again, each recomputing its forward for its own backward (a loop of unknown length keeps none)."""
    return _dispatch_fwd(shard, rows, ffn, x_ad, w_edfs, routes, rounds)[0]


def _dispatch_fwd(shard, rows, ffn, x_ad, w_edfs, routes, rounds):
    def round_r(r, x, w, y):
        return dispatch_round(shard, rows, ffn, r, x, w, routes, y)
    y_ad, first_vjp = jax.vjp(lambda x, w: round_r(0, x, w, jnp.zeros_like(x)), x_ad, w_edfs)
    with jax.named_scope(OVERFLOW_SCOPE):
        y_ad = jax.lax.fori_loop(1, rounds, lambda r, y: round_r(r, x_ad, w_edfs, y), y_ad)
    return y_ad, (first_vjp, x_ad, w_edfs, routes, rounds)


def _dispatch_bwd(shard, rows, ffn, res, g_ad):
    first_vjp, x_ad, w_edfs, routes, rounds = res

    def later_round(r, acc):
        _, vjp = jax.vjp(lambda x, w: dispatch_round(shard, rows, ffn, r, x, w, routes, jnp.zeros_like(x)),
                         x_ad, w_edfs)
        return jax.tree.map(lambda s, g: s + g.astype(s.dtype), acc, vjp(g_ad))
    first = jax.tree.map(lambda g: g.astype(jnp.float32), first_vjp(g_ad))
    with jax.named_scope(OVERFLOW_SCOPE):
        g_x, g_w = jax.lax.fori_loop(1, rounds, later_round, first)
    no_grad = jax.tree.map(lambda _: None, routes)
    return (g_x.astype(x_ad.dtype), jax.tree.map(lambda g, w: g.astype(w.dtype), g_w, w_edfs), no_grad, None)


dispatch_rounds.defvjp(_dispatch_fwd, _dispatch_bwd)


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
        logits_bte = dense(h_btd.astype(jnp.float32), gathered(self.router_de, c).astype(jnp.float32), flat=flat)
        if hasattr(self, "router_b_e"):
            logits_bte = logits_bte + self.router_b_e[...].astype(jnp.float32)
        if cfg.moe.router == "sigmoid":
            top_i_btk, weight_btk, probs_bte = route_sigmoid(logits_bte, self.router_bias_e[...], cfg, c)
            aux = {"router_load": jax.lax.stop_gradient(expert_load(top_i_btk, cfg.moe.n_experts))}
        elif cfg.moe.router == "sigmoid_input":  # Llama 4: top-k by logit, sigmoid(logit) scales the input
            top_i_btk, _, probs_bte = route(logits_bte, cfg.moe.experts_per_token, c, False)
            weight_btk = jax.nn.sigmoid(jnp.take_along_axis(logits_bte, top_i_btk, axis=-1))
            aux = aux_losses(logits_bte, probs_bte, top_i_btk, cfg)
        else:
            top_i_btk, weight_btk, probs_bte = route(logits_bte, cfg.moe.experts_per_token, c,
                                                     cfg.moe.norm_topk_prob)
            aux = aux_losses(logits_bte, probs_bte, top_i_btk, cfg)
        btk = ("batch", "seq", None)
        biases = (self.b_gate_ef[...], self.b_up_ef[...]) if cfg.moe.expert_bias else ()
        local = c.shard_map(lambda shard, *xs: experts_local(shard, *xs, cfg=cfg, quantization=self.quantization,
                                                             platform=c.platform),
                            (("batch", "seq", None), btk, btk, W_IN, W_IN, W_OUT, *[("experts", "mlp")] * len(biases)),
                            ("batch", "seq", None))
        out_btd = local(h_btd, top_i_btk, weight_btk, self.w_gate_edf[...], self.w_up_edf[...], self.w_down_efd[...],
                        *biases)
        if cfg.moe.expert_bias:  # each chosen expert's down bias, weighted as its output
            b_btkd = self.b_down_ed[...][top_i_btk].astype(jnp.float32)
            bias_btd = jnp.einsum("btkd,btk->btd", b_btkd, weight_btk.astype(jnp.float32))
            out_btd = out_btd + bias_btd.astype(out_btd.dtype)
        if cfg.moe.n_shared_experts:
            shared = tuple(gathered(w, c) for w in (self.shared_w_gate_df, self.shared_w_up_df, self.shared_w_down_fd))
            shared_btd = swiglu(h_btd, *shared, flat, self.quantization)
            if cfg.moe.shared_expert_gate:
                gate_bt1 = dense(h_btd, gathered(self.shared_expert_gate_d1, c), flat=flat)
                shared_btd = jax.nn.sigmoid(gate_bt1) * shared_btd
            out_btd = out_btd + shared_btd
        return c(out_btd, ("batch", "seq", None)), aux
