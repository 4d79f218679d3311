"""Qwen3-Next's full-attention layer (Qwen3NextAttention) as a function of its weights; its linear
attention layers are models/deltanet.py `linear_attention`.

Each query head has an output gate of its own (q_proj gives a query and a gate per head): the
attention output is multiplied by sigmoid(gate) before o_proj. Queries and keys are RMS-normed per
head with 1 + w (Qwen3-Next's zero-centred norms), and only the first `rotary_dim` channels of each
head rotate (partial_rotary_factor; rotary frequencies over those channels, in Hugging Face's halves
layout), the rest pass through. Shapes: B batch, T sequence, D d_model, H heads, K kv heads, E head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import attention
from models.gpt import rms_norm, rotary


def partial_rotary(x_bthe, rotary_dim: int, theta: float, positions_bt=None):
    """Rotary position embedding on the first `rotary_dim` channels of each head; the rest unchanged."""
    return jnp.concatenate([rotary(x_bthe[..., :rotary_dim], theta, positions_bt), x_bthe[..., rotary_dim:]], -1)


def gated_attention(p: dict, x_btd, *, rotary_dim: int, theta: float, eps: float = 1e-6, positions_bt=None,
                    impl: str = "xla", constrain=None):
    """Causal attention with per-head output gates. `p`: wq_dhe, wgate_dhe (D, H, E), wk_dke, wv_dke
    (D, K, E), q_norm, k_norm (E,: 1 + w), wo_hed (H, E, D)."""
    q_bthe, gate_bthe = (jnp.einsum("btd,dhe->bthe", x_btd, p[w]) for w in ("wq_dhe", "wgate_dhe"))
    k_btke, v_btke = (jnp.einsum("btd,dke->btke", x_btd, p[w]) for w in ("wk_dke", "wv_dke"))
    q_bthe, k_btke = (partial_rotary(rms_norm(x, p[n], eps, plus_one=True), rotary_dim, theta, positions_bt)
                      for x, n in ((q_bthe, "q_norm"), (k_btke, "k_norm")))
    o_bthe = attention.attend(q_bthe, k_btke, v_btke, positions_bt=positions_bt, impl=impl, constrain=constrain)
    return jnp.einsum("bthe,hed->btd", o_bthe * jax.nn.sigmoid(gate_bthe), p["wo_hed"])
