"""Gated DeltaNet linear attention (Qwen3-Next's `linear_attention` layers): the gated delta rule
as a chunked scan over the sequence, sharded over heads, and one recurrent step for generation.

Per head, a state S (K x V) is decayed, corrected towards each token's value, and read by its query:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t K**-0.5

`gated_delta_rule` computes the same in chunks of C tokens (Yang et al., "Gated Delta Networks",
as transformers' `torch_chunk_gated_delta_rule` and the flash-linear-attention kernels): inside a
chunk the C corrections are one unit lower-triangular solve (the UT transform) and a C x C
attention; a `lax.scan` over the chunks carries S, so memory is O(T C + K V) per head and the scan
is T / C steps. Heads are independent: under the trainer the function runs per shard of `heads`
(`constrain.shard_map`), every head's state on the device that holds it. `gated_delta_step` is
the recurrence for one new token (generation keeps S per layer instead of a KV cache).

q and k come l2-normalised by the caller, their heads already repeated to v's (Qwen3-Next's
grouped value heads). Shapes: B batch, T sequence, H heads, K key head dim, V value head dim,
N chunks of C. Computed in float32; outputs in v's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.contract import no_constraint

CHUNK = 64


def gated_delta_rule(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, *, chunk: int = CHUNK, state_bhkv=None,
                     segment_ids_bt=None, constrain=None):
    """(o_bthv, final state (B, H, K, V)) of the gated delta rule from `state_bhkv` (default zeros),
    per shard of `heads` when `constrain` (the trainer's) is given. With `segment_ids_bt` (packed
    documents) each document starts from a zero state, as if run alone."""
    names_x, names_g = ("batch", None, "heads", None), ("batch", None, "heads")
    names_s = ("batch", "heads", None, None)
    b, t, h, k = q_bthk.shape
    if state_bhkv is None:
        state_bhkv = jnp.zeros((b, h, k, v_bthv.shape[-1]), jnp.float32)
    if segment_ids_bt is None:
        segment_ids_bt = jnp.zeros((b, t), jnp.int32)
    local = (constrain or no_constraint).shard_map(
        lambda shard, *xs: _chunked(*xs, chunk=chunk),
        (names_x, names_x, names_x, names_g, names_g, names_s, ("batch", None)), (names_x, names_s))
    return local(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, state_bhkv, segment_ids_bt)


def _chunked(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, state_bhkv, seg_bt, *, chunk):
    b, t, h, k = q_bthk.shape
    c = min(chunk, t)
    pad = -t % c
    n = (t + pad) // c
    # packed documents: a token sees the carried state only in the state's document (`from_start`), the
    # chunk's tokens only in its own (`same`), and writes the next state only in the chunk's last one
    seg_nb1c = jnp.pad(seg_bt, [(0, 0), (0, pad)], mode="edge").reshape(b, n, c).transpose(1, 0, 2)[:, :, None]
    state_seg_nb11 = jnp.concatenate([seg_nb1c[:1, ..., :1], seg_nb1c[:-1, ..., -1:]])
    from_start_nb1c = seg_nb1c == state_seg_nb11
    to_end_nb1c = seg_nb1c == seg_nb1c[..., -1:]
    same_nb1cc = seg_nb1c[..., :, None] == seg_nb1c[..., None, :]

    def chunks(x):  # (B, T, H, ...) -> (N, B, H, C, ...), zero-padded to N C tokens
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, c, h, *x.shape[3:])
        return jnp.moveaxis(x, (1, 3), (0, 2))
    q, kk, v, g, beta = map(chunks, (q_bthk * k ** -0.5, k_bthk, v_bthv, g_bth, beta_bth))
    cum_nbhc = jnp.cumsum(g, -1)  # log of the decay from the chunk's start through each token
    lower_cc = jnp.tril(jnp.ones((c, c), bool))
    decay_nbhcc = jnp.exp(jnp.where(lower_cc & same_nb1cc, cum_nbhc[..., :, None] - cum_nbhc[..., None, :], -jnp.inf))
    from_start_nbhc = jnp.where(from_start_nb1c, jnp.exp(cum_nbhc), 0.0)  # the carried state's decay, or 0
    k_beta = kk * beta[..., None]
    # UT transform: (I + strictly lower(beta K K^T * decay)) W = [beta V, beta K exp(cum)]
    system = jnp.einsum("...ik,...jk->...ij", k_beta, kk) * decay_nbhcc
    rhs = jnp.concatenate([v * beta[..., None], k_beta * from_start_nbhc[..., None]], -1)
    solved = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    new_v, k_cumdecay = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    intra_nbhcc = jnp.einsum("...ik,...jk->...ij", q, kk) * decay_nbhcc
    q_decayed = q * from_start_nbhc[..., None]
    k_decayed = kk * jnp.where(to_end_nb1c, jnp.exp(cum_nbhc[..., -1:] - cum_nbhc), 0.0)[..., None]
    chunk_decay = jnp.where(seg_nb1c[..., -1:] == state_seg_nb11, jnp.exp(cum_nbhc[..., -1:]), 0.0)[..., None]

    def step(s_bhkv, xs):
        new_v, k_cumdecay, intra, q_decayed, k_decayed, chunk_decay = xs
        v_new = new_v - k_cumdecay @ s_bhkv  # the part of the values the state does not yet predict
        o_bhcv = q_decayed @ s_bhkv + intra @ v_new
        return s_bhkv * chunk_decay + jnp.swapaxes(k_decayed, -1, -2) @ v_new, o_bhcv
    state, o_nbhcv = jax.lax.scan(step, state_bhkv.astype(jnp.float32),
                                  (new_v, k_cumdecay, intra_nbhcc, q_decayed, k_decayed, chunk_decay))
    o_bthv = jnp.moveaxis(o_nbhcv, (0, 2), (1, 3)).reshape(b, n * c, h, -1)[:, :t]
    return o_bthv.astype(v_bthv.dtype), state


def gated_delta_step(q_bhk, k_bhk, v_bhv, g_bh, beta_bh, state_bhkv):
    """One token's (o_bhv, new state) of the recurrence (generation)."""
    f32 = jnp.float32
    q, k, v = (x.astype(f32) for x in (q_bhk, k_bhk, v_bhv))
    s = state_bhkv.astype(f32) * jnp.exp(g_bh.astype(f32))[..., None, None]
    delta_bhv = (v - jnp.einsum("bhkv,bhk->bhv", s, k)) * beta_bh.astype(f32)[..., None]
    s = s + k[..., :, None] * delta_bhv[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", s, q * q.shape[-1] ** -0.5).astype(v_bhv.dtype), s


def causal_conv(x_btc, w_wc, state_bwc, segment_ids_bt=None):
    """silu of the causal depthwise convolution (kernel W per channel) of x following `state`, the
    W - 1 inputs before it (zeros at a sequence's start): (y_btc, the last W - 1 inputs: the next state).
    With `segment_ids_bt` (packed documents) a token's window holds only its own document's inputs."""
    w, t = w_wc.shape[0], x_btc.shape[1]
    full = jnp.concatenate([state_bwc.astype(x_btc.dtype), x_btc], 1)  # (B, W - 1 + T, C)
    if segment_ids_bt is None:
        y_btc = sum(full[:, i:i + t] * w_wc[i] for i in range(w))
    else:
        seg_bt = jnp.concatenate([jnp.repeat(segment_ids_bt[:, :1], w - 1, 1), segment_ids_bt], 1)
        y_btc = sum(jnp.where((seg_bt[:, i:i + t] == segment_ids_bt)[..., None], full[:, i:i + t], 0) * w_wc[i]
                    for i in range(w))
    return jax.nn.silu(y_btc), full[:, t:]


def l2_normalized(x, eps=1e-6):
    return x * jax.lax.rsqrt((x * x).sum(-1, keepdims=True) + eps)


def linear_attention(p: dict, x_btd, *, n_key_heads: int, eps: float = 1e-6, conv_state_bwc=None, state_bhkv=None,
                     chunk: int = CHUNK, segment_ids_bt=None, constrain=None):
    """Qwen3-Next's gated DeltaNet layer: (output_btd, (next conv state, next recurrent state)).

    q, k (n_key_heads heads of K) and v (H heads of V) go through one causal depthwise convolution
    with silu; each head decays its state by exp(g), g = -exp(a_log) softplus(x w_a + dt_bias), and
    writes with strength beta = sigmoid(x w_b); q and k are l2-normalised and each serves H / n_key_heads
    consecutive value heads; the output is RMS-normed per head, gated by silu(x w_z) and projected.
    `p`: w_qkvz_dc (D, q and k: n_key_heads K each, v and z: H V each), w_ba_dh2 (D, b then a: H each),
    conv_wc (W, the q, k, v channels), a_log_h, dt_bias_h, norm_v (V,), wo_vd (H V, D).
    With states given (generation), continues from them; a single token takes the recurrent step.
    With `segment_ids_bt` (packed documents, training) each document runs as if alone."""
    b, t, _ = x_btd.shape
    h, v_dim = p["a_log_h"].shape[0], p["norm_v"].shape[0]
    qk = (p["w_qkvz_dc"].shape[1] - 2 * h * v_dim) // 2  # n_key_heads K
    if conv_state_bwc is None:
        conv_state_bwc = jnp.zeros((b, p["conv_wc"].shape[0] - 1, p["conv_wc"].shape[1]), x_btd.dtype)
    qkv_btc, z_btc = jnp.split(x_btd @ p["w_qkvz_dc"], [2 * qk + h * v_dim], -1)
    qkv_btc, conv_state_bwc = causal_conv(qkv_btc, p["conv_wc"], conv_state_bwc, segment_ids_bt)
    q, k, v = jnp.split(qkv_btc, [qk, 2 * qk], -1)
    q, k = (jnp.repeat(l2_normalized(x.reshape(b, t, n_key_heads, -1)), h // n_key_heads, 2) for x in (q, k))
    v_bthv = v.reshape(b, t, h, v_dim)
    b_bth, a_bth = jnp.split(x_btd @ p["w_ba_dh2"], 2, -1)
    beta_bth = jax.nn.sigmoid(b_bth)
    g_bth = -jnp.exp(p["a_log_h"].astype(jnp.float32)) * jax.nn.softplus(a_bth.astype(jnp.float32) + p["dt_bias_h"])
    if t == 1 and state_bhkv is not None:
        o_bhv, state_bhkv = gated_delta_step(q[:, 0], k[:, 0], v_bthv[:, 0], g_bth[:, 0], beta_bth[:, 0], state_bhkv)
        o_bthv = o_bhv[:, None]
    else:
        o_bthv, state_bhkv = gated_delta_rule(q, k, v_bthv, g_bth, beta_bth, chunk=chunk, state_bhkv=state_bhkv,
                                              segment_ids_bt=segment_ids_bt, constrain=constrain)
    o32 = o_bthv.astype(jnp.float32)
    normed = o32 * jax.lax.rsqrt((o32 * o32).mean(-1, keepdims=True) + eps) * p["norm_v"]
    gated = (normed * jax.nn.silu(z_btc.reshape(b, t, h, v_dim).astype(jnp.float32))).astype(x_btd.dtype)
    return gated.reshape(b, t, h * v_dim) @ p["wo_vd"], (conv_state_bwc, state_bhkv)
