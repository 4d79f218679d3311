"""Qwen3-Next (Qwen3NextForCausalLM) as functions of its weights: the gated full-attention layer
(Qwen3NextAttention), its MoE, and `logits`, the whole decoder layer after layer (the reference the
trainer's model must equal; not yet a registered model: no scan, no sharding; `greedy` generates
with each linear layer's recurrent state and the attention layers' keys and values). Its linear
attention layers are models/deltanet.py `linear_attention`.

Each query head has an output gate of its own (q_proj gives a query and a gate per head): the
attention output is multiplied by sigmoid(gate) before o_proj. Queries and keys are RMS-normed per
head with 1 + w (Qwen3-Next's zero-centred norms), and only the first `rotary_dim` channels of each
head rotate (partial_rotary_factor; rotary frequencies over those channels, in Hugging Face's halves
layout), the rest pass through. Shapes: B batch, T sequence, D d_model, H heads, K kv heads, E head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models import attention, deltanet, moe
from models.contract import no_constraint
from models.gpt import cached_attention, rms_norm, rotary


def partial_rotary(x_bthe, rotary_dim: int, theta: float, positions_bt=None):
    """Rotary position embedding on the first `rotary_dim` channels of each head; the rest unchanged."""
    return jnp.concatenate([rotary(x_bthe[..., :rotary_dim], theta, positions_bt), x_bthe[..., rotary_dim:]], -1)


def gated_attention(p: dict, x_btd, *, rotary_dim: int, theta: float, eps: float = 1e-6, past=None, start: int = 0,
                    impl: str = "xla", constrain=None):
    """Causal attention with per-head output gates: (o_btd, (keys, values)). `p`: wq_dhe, wgate_dhe
    (D, H, E), wk_dke, wv_dke (D, K, E), q_norm, k_norm (E,: 1 + w), wo_hed (H, E, D). Without `past`:
    the T tokens' rotated keys and values; with `past` (generation: (B, S, K, E) buffers holding the
    earlier tokens' at slots 0..start-1), the T tokens at positions start.. are written into slots
    start.. and attend to everything up to themselves; the buffers are returned."""
    t = x_btd.shape[1]
    positions_bt = start + jnp.arange(t)[None]
    q_bthe, gate_bthe = (jnp.einsum("btd,dhe->bthe", x_btd, p[w]) for w in ("wq_dhe", "wgate_dhe"))
    k_btke, v_btke = (jnp.einsum("btd,dke->btke", x_btd, p[w]) for w in ("wk_dke", "wv_dke"))
    q_bthe, k_btke = (partial_rotary(rms_norm(x, p[n], eps, plus_one=True), rotary_dim, theta, positions_bt)
                      for x, n in ((q_bthe, "q_norm"), (k_btke, "k_norm")))
    if past is None:
        o_bthe = attention.attend(q_bthe, k_btke, v_btke, impl=impl, constrain=constrain)
    else:
        k_btke, v_btke = (jax.lax.dynamic_update_slice_in_dim(a, b, start, 1) for a, b in zip(past, (k_btke, v_btke)))
        mask_bts = (jnp.arange(k_btke.shape[1])[None, :] <= positions_bt[0][:, None])[None]
        o_bthe = cached_attention(q_bthe, k_btke, v_btke, mask_bts)
    return jnp.einsum("bthe,hed->btd", o_bthe * jax.nn.sigmoid(gate_bthe), p["wo_hed"]), (k_btke, v_btke)


def sparse_moe(p: dict, x_btd, *, experts_per_token: int, norm_topk_prob: bool):
    """Softmax top-k routing over the experts (every expert computed, weighted by its routing weight:
    a reference, not a dispatch) plus the shared expert scaled by sigmoid(x w). `p`: router_de,
    w_gate_edf, w_up_edf, w_down_efd, shared_w_gate_df, shared_w_up_df, shared_w_down_fd,
    shared_expert_gate_d1."""
    n = p["router_de"].shape[1]
    top_i, top_w, _ = moe.route(x_btd @ p["router_de"], experts_per_token, no_constraint, norm_topk_prob)
    weight_bte = (jax.nn.one_hot(top_i, n) * top_w[..., None]).sum(-2)
    h_btef = jax.nn.silu(jnp.einsum("btd,edf->btef", x_btd, p["w_gate_edf"])) * jnp.einsum(
        "btd,edf->btef", x_btd, p["w_up_edf"])
    routed_btd = jnp.einsum("btef,efd,bte->btd", h_btef, p["w_down_efd"], weight_bte.astype(x_btd.dtype))
    shared_btd = moe.swiglu(x_btd, p["shared_w_gate_df"], p["shared_w_up_df"], p["shared_w_down_fd"])
    return routed_btd + jax.nn.sigmoid(x_btd @ p["shared_expert_gate_d1"]) * shared_btd


def logits(params: dict, tokens_bt, *, n_key_heads: int, rotary_dim: int, theta: float, eps: float,
           experts_per_token: int, norm_topk_prob: bool, chunk: int = deltanet.CHUNK, states=None, start: int = 0):
    """(logits (B, T, V), each layer's state after the T tokens). `params`: embedding_vd, final_norm,
    unembed_dv and `layers`, one dict each: mixer_norm, mlp_norm (1 + w), moe (sparse_moe's) and
    `linear` (deltanet.linear_attention's) or `attention` (gated_attention's). A linear layer's state
    is its conv window and recurrent state, an attention layer's the keys and values so far; with
    `states` (generation) the tokens continue the sequence from position `start`."""
    x_btd, out = params["embedding_vd"][tokens_bt], []
    for i, layer in enumerate(params["layers"]):
        state = None if states is None else states[i]
        h_btd = rms_norm(x_btd, layer["mixer_norm"], eps, plus_one=True)
        if "linear" in layer:
            h_btd, state = deltanet.linear_attention(layer["linear"], h_btd, n_key_heads=n_key_heads, eps=eps,
                                                     chunk=chunk, **dict(zip(("conv_state_bwc", "state_bhkv"),
                                                                             state or ())))
        else:
            h_btd, state = gated_attention(layer["attention"], h_btd, rotary_dim=rotary_dim, theta=theta, eps=eps,
                                           past=state, start=start)
        out.append(state)
        x_btd = x_btd + h_btd
        h_btd = rms_norm(x_btd, layer["mlp_norm"], eps, plus_one=True)
        x_btd = x_btd + sparse_moe(layer["moe"], h_btd, experts_per_token=experts_per_token,
                                   norm_topk_prob=norm_topk_prob)
    return rms_norm(x_btd, params["final_norm"], eps, plus_one=True) @ params["unembed_dv"], out


def greedy(params: dict, prompt_ids: list[int], n: int, **shape) -> list[int]:
    """n greedy tokens after the prompt: a prefill, then one token a step through each layer's state
    (`logits`' keyword arguments in `shape`)."""
    step = jax.jit(functools.partial(logits, **shape))
    out, states = step(params, jnp.asarray([prompt_ids]))
    slots = len(prompt_ids) + n  # the attention layers' keys and values in buffers of every position
    states = [s if "linear" in layer else tuple(jnp.pad(a, ((0, 0), (0, slots - a.shape[1]), (0, 0), (0, 0)))
                                                for a in s) for layer, s in zip(params["layers"], states)]
    new = [int(out[0, -1].argmax())]
    for i in range(n - 1):
        out, states = step(params, jnp.asarray([new[-1:]]), states=states, start=len(prompt_ids) + i)
        new.append(int(out[0, -1].argmax()))
    return new
