"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query causal attention, SwiGLU MLP.

Shapes: B batch, T sequence, D d_model, H heads, K kv heads, E head dim, F d_ff, V vocab, L layers.
Parameters and activations carry logical axis names only; the trainer maps them to the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models import attention, dense, embed_lookup, no_constraint, param, scan_blocks, stacked

normal = nnx.initializers.normal
ones = nnx.initializers.ones


def rms_norm(x, scale, eps=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype) * scale


def rotary(x_bthe, theta: float, positions_bt=None):
    """Rotary position embedding over the last (head) dimension; positions default to 0..T-1."""
    t, e = x_bthe.shape[1], x_bthe.shape[-1]
    freq_f = theta ** (-jnp.arange(0, e, 2, dtype=jnp.float32) / e)
    pos_bt = jnp.arange(t, dtype=jnp.float32)[None] if positions_bt is None else positions_bt.astype(jnp.float32)
    angle_btf = pos_bt[..., None] * freq_f
    sin, cos = jnp.sin(angle_btf)[:, :, None, :], jnp.cos(angle_btf)[:, :, None, :]
    x1, x2 = jnp.split(x_bthe.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_bthe.dtype)


class Block(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain=no_constraint):
        d, h, k, e, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads, cfg.d_ff
        self.theta, self.constrain, self.attention = cfg.rope_theta, constrain, cfg.attention
        self.attn_norm = param(rngs, ones, (d,), (None,))
        self.wq_dhe = param(rngs, normal(d ** -0.5), (d, h, e), ("embed", "heads", None))
        self.wk_dke = param(rngs, normal(d ** -0.5), (d, k, e), ("embed", "kv_heads", None))
        self.wv_dke = param(rngs, normal(d ** -0.5), (d, k, e), ("embed", "kv_heads", None))
        self.wo_hed = param(rngs, normal((h * e) ** -0.5 / 2), (h, e, d), ("heads", None, "embed"))
        self.mlp_norm = param(rngs, ones, (d,), (None,))
        self.w_gate_df = param(rngs, normal(d ** -0.5), (d, f), ("embed", "mlp"))
        self.w_up_df = param(rngs, normal(d ** -0.5), (d, f), ("embed", "mlp"))
        self.w_down_fd = param(rngs, normal(f ** -0.5 / 2), (f, d), ("mlp", "embed"))

    def __call__(self, x_btd, segment_ids_bt=None, positions_bt=None):
        c = self.constrain
        x_btd = checkpoint_name(x_btd, "layer_input")
        h_btd = rms_norm(x_btd, self.attn_norm[...])
        q_bthe = c(rotary(dense(h_btd, self.wq_dhe[...]), self.theta, positions_bt), ("batch", "seq", "heads", None))
        k_btke = c(rotary(dense(h_btd, self.wk_dke[...]), self.theta, positions_bt), ("batch", "seq", "kv_heads", None))
        v_btke = c(dense(h_btd, self.wv_dke[...]), ("batch", "seq", "kv_heads", None))
        o_bthe = attention.attend(q_bthe, k_btke, v_btke, segment_ids_bt=segment_ids_bt, impl=self.attention,
                                  constrain=c)
        o_bthe = checkpoint_name(c(o_bthe, ("batch", "seq", "heads", None)), "attention_out")
        x_btd = c(x_btd + dense(o_bthe, self.wo_hed[...], n_in=2), ("batch", "seq", None))
        h_btd = rms_norm(x_btd, self.mlp_norm[...])
        gate_btf = c(dense(h_btd, self.w_gate_df[...]), ("batch", "seq", "mlp"))
        up_btf = c(dense(h_btd, self.w_up_df[...]), ("batch", "seq", "mlp"))
        out_btd = dense(jax.nn.silu(gate_btf) * up_btf, self.w_down_fd[...])
        return c(x_btd + out_btd, ("batch", "seq", None))


class Gpt(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain=no_constraint):
        self.constrain, self.embed_how = constrain, cfg.embed
        self.embedding_vd = param(rngs, normal(1.0), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        self.blocks = stacked(lambda r: Block(cfg, rngs=r, constrain=constrain), cfg.n_layers, rngs)
        self.final_norm = param(rngs, ones, (cfg.d_model,), (None,))
        self.unembed_dv = param(rngs, normal(cfg.d_model ** -0.5), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def embed(self, tokens_bt):
        x_btd = embed_lookup(self.embedding_vd[...], tokens_bt, self.embed_how)
        return self.constrain(x_btd, ("batch", "seq", None))

    def head(self, x_btd):
        logits_btv = dense(rms_norm(x_btd, self.final_norm[...]), self.unembed_dv[...])
        return self.constrain(logits_btv, ("batch", "seq", "vocab"))

    def __call__(self, tokens_bt, segment_ids_bt=None, positions_bt=None):
        return self.head(scan_blocks(self.blocks, self.embed(tokens_bt), segment_ids=segment_ids_bt,
                                     positions=positions_bt))
