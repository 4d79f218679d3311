"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query causal attention, SwiGLU MLP.

One decoder, several families as configs: Llama 2/3 (rope_scaling, tie_embeddings), Mistral
(the Llama layout, sliding_window), Qwen2/2.5 (qkv_bias) and Qwen3 (qk_norm, its own head_dim); with
`moe.n_experts > 1` every block's MLP is a mixture of experts (models/moe.py: Mixtral, Qwen-MoE).
OLMo 2 norms the sublayers' outputs instead of their inputs (norm_position=post) and its queries and
keys over the whole projection (qk_norm_scope=projection). Gemma 2/3 norm both (pre_post) with
1 + w (norm_scale), GeGLU (activation=gelu_tanh), scaled embeddings, their own attention scale and
soft caps, and local (windowed) layers among global ones (layer_pattern: the scan runs over groups
of layers, models/__init__.py `scan_layers`), Gemma 3 with its own rotary base for the local ones. Llama 4's
local layers attend in chunks (attention_chunk) with a weightless qk norm, its global ones without rotary
and with a temperature (global_nope, attn_temperature); yarn and dynamic rope are models/rope.py's.
gpt-oss: learned attention sinks (attn_sinks, models/attention.py), q/k/v and output biases, sliding and
full layers alternating (layer_pattern), MoE experts with biases and a clamped SwiGLU. The rotary
layout is Hugging Face's: the head dimension is split into halves [x1, x2], rotated as
[x1 cos - x2 sin, x2 cos + x1 sin] with frequencies theta^(-2i/E), so HF weights load unpermuted.

Shapes: B batch, T sequence, S cache slots, D d_model, H heads, K kv heads, E head dim, F d_ff,
V vocab, L layers. Parameters and activations carry logical axis names only; the trainer maps
them to the mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models import LORA_A, LORA_B, adapted_weights, attention, moe, rope
from models.contract import no_constraint
from models.layers import (
    BTD,
    BTF,
    BTV,
    Stages,
    dense,
    embed_lookup,
    flat_matmuls,
    gathered,
    lookup_table,
    matmul_params,
    param,
    scan_blocks,
    scan_layers,
    stacked,
)

normal = nnx.initializers.normal
ones = nnx.initializers.ones
zeros = nnx.initializers.zeros
BTHE = ("batch", "seq", "heads", "activation_head_dim")
BTKE = ("batch", "seq", "kv_heads", "activation_head_dim")


def rms_norm(x, scale, eps=1e-6, *, plus_one=False, axes=(-1,)):
    """RMSNorm over `axes` times `scale` (Llama: in x's dtype), or times 1 + scale in float32 (Gemma)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    if plus_one:
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return normed.astype(x.dtype) * scale


def softcap(x, cap):
    """cap * tanh(x / cap), or x when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def inv_frequencies(e: int, theta: float, scaling=None) -> np.ndarray:
    """The E/2 rotary frequencies (float32, as transformers computes them), with `scaling`
    (a config with type linear / llama3 / yarn / dynamic, factor, ...; models/rope.py) applied."""
    freq_f = (1.0 / (theta ** (np.arange(0, e, 2, dtype=np.float32) / np.float32(e)))).astype(np.float32)
    if scaling is None:
        return freq_f
    if scaling.type == "linear":
        return (freq_f / np.float32(scaling.factor)).astype(np.float32)
    if scaling.type in ("yarn", "dynamic"):  # dynamic: unscaled within original_max_position_embeddings
        return rope.yarn_frequencies(e, theta, scaling) if scaling.type == "yarn" else freq_f
    old, lo, hi = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen_f = (2 * math.pi / freq_f).astype(np.float32)
    scaled_f = np.where(wavelen_f > old / lo, freq_f / np.float32(scaling.factor), freq_f).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):  # hi == lo (Llama 4 Scout): no medium band to smooth
        smooth_f = ((old / wavelen_f - lo) / np.float32(hi - lo)).astype(np.float32)
        smoothed_f = (1 - smooth_f) * scaled_f / np.float32(scaling.factor) + smooth_f * scaled_f
    medium = ~(wavelen_f < old / hi) & ~(wavelen_f > old / lo)
    return np.where(medium, smoothed_f, scaled_f).astype(np.float32)


def rotary(x_bthe, theta: float, positions_bt=None, scaling=None):
    """Rotary position embedding over the last (head) dimension; positions default to 0..T-1."""
    t, e = x_bthe.shape[1], x_bthe.shape[-1]
    if positions_bt is None:
        positions_bt = jnp.arange(t, dtype=jnp.int32)[None, :]
    angle_btf = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_frequencies(e, theta, scaling))
    sin, cos = jnp.sin(angle_btf)[:, :, None, :], jnp.cos(angle_btf)[:, :, None, :]
    if (factor := rope.attention_factor(scaling)) != 1.0:  # yarn's, on cos and sin as transformers applies it
        sin, cos = sin * factor, cos * factor
    x1, x2 = jnp.split(x_bthe.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_bthe.dtype)


def cached_attention(q_bthe, k_bske, v_bske, mask_bts, scale=None, cap=None, sinks_h=None):
    """Grouped-query attention of T new queries over S cached keys where mask_bts is True
    (query head h reads kv head h // (H/K), as `jax.nn.dot_product_attention` and HF do); scores
    times `scale` (default E**-0.5), soft-capped by `cap`; `sinks_h` (H,) join each head's softmax
    denominator (a key with that logit and no value)."""
    b, t, h, e = q_bthe.shape
    k = k_bske.shape[2]
    q_btkge = q_bthe.reshape(b, t, k, h // k, e).astype(jnp.float32)
    s_bkgts = jnp.einsum("btkge,bske->bkgts", q_btkge, k_bske.astype(jnp.float32)) * (scale or e ** -0.5)
    s_bkgts = softcap(s_bkgts, cap)
    s_bkgts = jnp.where(mask_bts[:, None, None], s_bkgts, -1e30)
    if sinks_h is None:
        p_bkgts = jax.nn.softmax(s_bkgts, axis=-1)
    else:  # the sink's column joins the softmax, then is dropped
        sink_bkgt1 = jnp.broadcast_to(sinks_h.astype(jnp.float32).reshape(1, k, h // k, 1, 1), (*s_bkgts.shape[:-1], 1))
        p_bkgts = jax.nn.softmax(jnp.concatenate([s_bkgts, sink_bkgt1], -1), axis=-1)[..., :-1]
    o_btkge = jnp.einsum("bkgts,bske->btkge", p_bkgts, v_bske.astype(jnp.float32))
    return o_btkge.reshape(b, t, h, e).astype(q_bthe.dtype)


BLOCK_WEIGHTS = {  # name: (logical axes, input dims, the Hugging Face module's name)
    "wq_dhe": (("embed", "heads", None), 1, "q_proj"), "wk_dke": (("embed", "kv_heads", None), 1, "k_proj"),
    "wv_dke": (("embed", "kv_heads", None), 1, "v_proj"), "wo_hed": (("heads", None, "embed"), 2, "o_proj"),
    "w_gate_df": (("embed", "mlp"), 1, "gate_proj"), "w_up_df": (("embed", "mlp"), 1, "up_proj"),
    "w_down_fd": (("mlp", "embed"), 1, "down_proj")}
"""The block's projection weights, the ones LoRA can adapt: one table for their axes and HF names."""
LOGICAL = {name: axes for name, (axes, _, _) in BLOCK_WEIGHTS.items()}


class Block(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain=no_constraint, quantization="none"):
        d, h, k = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        e = cfg.head_size
        self.theta, self.constrain, self.attention = cfg.rope_theta, constrain, cfg.attention
        self.quantization = quantization
        self.rope_scaling, self.eps, self.window = cfg.rope_scaling, cfg.rms_norm_eps, cfg.sliding_window
        self.kinds, self.local_theta = tuple(cfg.layer_pattern), cfg.rope_local_theta
        self.chunk, self.global_nope, self.qk_l2_norm = cfg.attention_chunk, cfg.global_nope, cfg.qk_l2_norm
        self.temperature = None if cfg.attn_temperature is None else (cfg.attn_temperature, cfg.attn_temperature_floor)
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
        self.softcap, self.plus_one = cfg.attn_softcap, cfg.norm_scale == "one_plus_weight"
        self.act = jax.nn.silu if cfg.activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
        norm_init = zeros if self.plus_one else ones  # 1 + w starts at 1 too
        pre, post = cfg.norm_position in ("pre", "pre_post"), cfg.norm_position in ("post", "pre_post")
        if pre:  # on the attention's input; after it (post), on its output
            self.attn_norm = param(rngs, norm_init, (d,), (None,))
        if post:
            self.attn_post_norm = param(rngs, norm_init, (d,), (None,))
        self.mla = cfg.mla
        if cfg.mla is not None:
            self._mla(cfg, rngs, norm_init)
            qk = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
            self.scale = qk ** -0.5 * rope.score_scale(cfg.rope_scaling)
        else:
            self.wq_dhe = param(rngs, normal(d ** -0.5), (d, h, e), LOGICAL["wq_dhe"])
            self.wk_dke = param(rngs, normal(d ** -0.5), (d, k, e), LOGICAL["wk_dke"])
            self.wv_dke = param(rngs, normal(d ** -0.5), (d, k, e), LOGICAL["wv_dke"])
        if cfg.qkv_bias:
            self.bq_he = param(rngs, zeros, (h, e), ("heads", None))
            self.bk_ke = param(rngs, zeros, (k, e), ("kv_heads", None))
            self.bv_ke = param(rngs, zeros, (k, e), ("kv_heads", None))
        if cfg.qk_norm and cfg.qk_norm_scope == "head":
            self.q_norm = param(rngs, norm_init, (e,), (None,))
            self.k_norm = param(rngs, norm_init, (e,), (None,))
        elif cfg.qk_norm:  # over the whole projection: one weight per head and channel
            self.q_norm_he = param(rngs, norm_init, (h, e), ("heads", None))
            self.k_norm_ke = param(rngs, norm_init, (k, e), ("kv_heads", None))
        ev = e if cfg.mla is None else cfg.mla.v_head_dim
        self.wo_hed = param(rngs, normal((h * ev) ** -0.5 / 2), (h, ev, d), LOGICAL["wo_hed"])
        if cfg.attn_out_bias:
            self.bo_d = param(rngs, zeros, (d,), (None,))
        if cfg.attn_sinks:  # one logit per query head in its softmax denominator (gpt-oss)
            self.sinks_h = param(rngs, zeros, (h,), ("heads",))
        if pre:  # the MLP's, likewise
            self.mlp_norm = param(rngs, norm_init, (d,), (None,))
        if post:
            self.mlp_post_norm = param(rngs, norm_init, (d,), (None,))
        if cfg.moe.n_experts > 1:
            self.moe = moe.Moe(cfg, rngs=rngs, constrain=constrain, quantization=quantization)
        else:
            self._dense_mlp(cfg, rngs)
        self.lora_scale = cfg.lora.alpha / max(cfg.lora.rank, 1)
        for name in adapted_weights(cfg):  # low-rank adapters: A (W's input dims, r), B (r, W's output dims)
            (names, n_in, _), w, r = BLOCK_WEIGHTS[name], getattr(self, name), cfg.lora.rank
            setattr(self, name + LORA_A, param(rngs, normal(math.prod(w.shape[:n_in]) ** -0.5),
                                              (*w.shape[:n_in], r), (*names[:n_in], None)))
            setattr(self, name + LORA_B, param(rngs, zeros, (r, *w.shape[n_in:]), (None, *names[n_in:])))

    def _mla(self, cfg, rngs, norm_init):
        """Multi-head latent attention's weights: C kv_lora_rank, R q_lora_rank, N / P the per-head
        query/key channels without / with rotary, A the value channels."""
        a, d, h = cfg.mla, cfg.d_model, cfg.n_heads
        n, p, c = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        if a.q_lora_rank is None:
            self.wq_dhe = param(rngs, normal(d ** -0.5), (d, h, n + p), LOGICAL["wq_dhe"])
        else:
            r = a.q_lora_rank
            self.wq_a_dr = param(rngs, normal(d ** -0.5), (d, r), ("embed", None))
            self.q_a_norm = param(rngs, norm_init, (r,), (None,))
            self.wq_b_rhe = param(rngs, normal(r ** -0.5), (r, h, n + p), ("embed", "heads", None))
        self.wkv_a_dc = param(rngs, normal(d ** -0.5), (d, c + p), ("embed", None))
        # the ranks R and C are the up-projections' inputs: named `embed`, FSDP-sharded as d_model is
        self.kv_a_norm = param(rngs, norm_init, (c,), (None,))
        self.wkv_b_che = param(rngs, normal(c ** -0.5), (c, h, n + a.v_head_dim), ("embed", "heads", None))

    def mla_query(self, h_btd, positions_bt=None):
        """MLA's queries (B, T, H, E): the per-head channels, then the rotated ones, zero-padded to E."""
        a = self.mla
        n, p = a.qk_nope_head_dim, a.qk_rope_head_dim
        if hasattr(self, "wq_a_dr"):
            q_bthe = self.mm(self.norm(self.mm(h_btd, "wq_a_dr"), "q_a_norm"), "wq_b_rhe")
        else:
            q_bthe = self.mm(h_btd, "wq_dhe")
        q_rope = rotary(q_bthe[..., n:], self.theta, positions_bt, self.rope_scaling)
        q_bthe = jnp.concatenate([q_bthe[..., :n], q_rope], -1)
        return jnp.pad(q_bthe, [(0, 0)] * 3 + [(0, max(n + p, a.v_head_dim) - n - p)])

    def mla_latent(self, h_btd, positions_bt=None):
        """What MLA caches per token: the normed latent (B, T, C) and the rotated shared key part (B, T, P)."""
        p = self.mla.qk_rope_head_dim
        ckv_btc = self.mm(h_btd, "wkv_a_dc")
        k_rope_bt1p = rotary(ckv_btc[:, :, None, -p:], self.theta, positions_bt, self.rope_scaling)
        return self.norm(ckv_btc[..., :-p], "kv_a_norm"), k_rope_bt1p[:, :, 0]

    def mla_keys_values(self, c_bsc, k_rope_bsp):
        """Keys and values (B, S, H, E), zero-padded to E, from latents and rotated key parts."""
        a = self.mla
        n, p, v = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        kv_bshx = self.mm(c_bsc, "wkv_b_che")  # (B, S, H, N + A)
        h, e = kv_bshx.shape[2], max(n + p, v)
        k_rope_bshp = jnp.broadcast_to(k_rope_bsp[:, :, None, :], (*k_rope_bsp.shape[:2], h, p)).astype(kv_bshx.dtype)
        k_bshe = jnp.concatenate([kv_bshx[..., :n], k_rope_bshp], -1)
        pad = [(0, 0)] * 3
        return jnp.pad(k_bshe, [*pad, (0, e - n - p)]), jnp.pad(kv_bshx[..., n:], [*pad, (0, e - v)])

    def _dense_mlp(self, cfg, rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.w_gate_df = param(rngs, normal(d ** -0.5), (d, f), LOGICAL["w_gate_df"])
        self.w_up_df = param(rngs, normal(d ** -0.5), (d, f), LOGICAL["w_up_df"])
        self.w_down_fd = param(rngs, normal(f ** -0.5 / 2), (f, d), LOGICAL["w_down_fd"])

    def weight(self, name):
        """A block weight, gathered whole along the model dimension (`layers.gathered`); with a LoRA
        adapter W + (alpha/r) A @ B, the frozen W out of the gradient."""
        w = gathered(getattr(self, name), self.constrain)
        if not hasattr(self, name + LORA_A):
            return w
        a, b = (gathered(getattr(self, name + part), self.constrain) for part in (LORA_A, LORA_B))
        return jax.lax.stop_gradient(w) + (self.lora_scale * dense(a, b)).astype(w.dtype)

    def mm(self, x, name, n_in=1):
        """x times block weight `name` (flat 2D matmul unless the sequence is split over devices),
        quantized by the block's `quantization`; the result is named `name` for remat policies."""
        out = dense(x, self.weight(name), n_in, flat=flat_matmuls(self.constrain), quantization=self.quantization,
                    row_groups=self.constrain.size("batch"))
        return checkpoint_name(out, name)  # what train.remat's named policies save

    def norm(self, x, name, axes=(-1,)):
        """RMSNorm by the block's norm weight `name`; x itself when the block has no such norm."""
        if not hasattr(self, name):
            return x
        return rms_norm(x, getattr(self, name)[...], self.eps, plus_one=self.plus_one, axes=axes)

    def window_of(self, kind):
        """The attention window of a layer of `kind` (layer_pattern's; None: no pattern, all alike)."""
        return self.window if kind in (None, "local") else None

    def chunk_of(self, kind):
        """The attention chunk of a layer of `kind` (model.attention_chunk: the local layers')."""
        return self.chunk if kind == "local" else None

    def qkv(self, x_btd, positions_bt=None, kind=None):
        """Queries, keys (both rotated, as a layer of `kind` rotates) and values of the (normed) input."""
        c = self.constrain
        h_btd = self.norm(x_btd, "attn_norm")
        if self.mla is not None:
            k_btke, v_btke = self.mla_keys_values(*self.mla_latent(h_btd, positions_bt))
            return c(self.mla_query(h_btd, positions_bt), BTHE), c(k_btke, BTKE), c(v_btke, BTKE)
        q_bthe, k_btke, v_btke = (self.mm(h_btd, w) for w in ("wq_dhe", "wk_dke", "wv_dke"))
        if hasattr(self, "bq_he"):
            q_bthe, k_btke, v_btke = q_bthe + self.bq_he[...], k_btke + self.bk_ke[...], v_btke + self.bv_ke[...]
        q_bthe, k_btke = self.norm(q_bthe, "q_norm"), self.norm(k_btke, "k_norm")
        q_bthe, k_btke = self.norm(q_bthe, "q_norm_he", (-2, -1)), self.norm(k_btke, "k_norm_ke", (-2, -1))
        theta, scaling = self.theta, self.rope_scaling
        if kind == "local" and self.local_theta is not None:
            theta, scaling = self.local_theta, None
        if kind == "global" and self.global_nope:  # Llama 4's NoPE layers: no rotary, a temperature
            return c(self.tempered(q_bthe, positions_bt), BTHE), c(k_btke, BTKE), c(v_btke, BTKE)
        q_bthe, k_btke = rotary(q_bthe, theta, positions_bt, scaling), rotary(k_btke, theta, positions_bt, scaling)
        if self.qk_l2_norm:
            q_bthe, k_btke = rms_norm(q_bthe, 1.0, self.eps), rms_norm(k_btke, 1.0, self.eps)
        return c(q_bthe, BTHE), c(k_btke, BTKE), c(v_btke, BTKE)

    def tempered(self, q_bthe, positions_bt=None):
        """Queries times Llama 4's attention temperature 1 + s ln(1 + floor((p + 1) / floor)) at their
        positions p (0..T-1 by default); unchanged without model.attn_temperature."""
        if self.temperature is None:
            return q_bthe
        s, floor = self.temperature
        p_bt = jnp.arange(q_bthe.shape[1])[None] if positions_bt is None else positions_bt
        scale_bt = jnp.log1p(jnp.floor((p_bt.astype(jnp.float32) + 1.0) / floor)) * s + 1.0
        return (q_bthe * scale_bt[:, :, None, None]).astype(q_bthe.dtype)

    def finish(self, x_btd, o_bthe):
        """Output projection, residual, then the gated MLP (or mixture of experts) and its residual,
        each sublayer normed where norm_position says; an MoE block returns (x_btd, aux losses)."""
        c = self.constrain
        if self.mla is not None:  # the value channels, without the padding
            o_bthe = o_bthe[..., :self.mla.v_head_dim]
        out_btd = self.mm(o_bthe, "wo_hed", n_in=2)
        if hasattr(self, "bo_d"):
            out_btd = out_btd + self.bo_d[...]
        x_btd = c(x_btd + self.norm(out_btd, "attn_post_norm"), BTD)
        h_btd = self.norm(x_btd, "mlp_norm")
        if hasattr(self, "moe"):
            out_btd, aux = self.moe(h_btd)
            return c(x_btd + self.norm(out_btd, "mlp_post_norm"), BTD), aux
        gate_btf = c(self.mm(h_btd, "w_gate_df"), BTF)
        up_btf = c(self.mm(h_btd, "w_up_df"), BTF)
        out_btd = self.mm(self.act(gate_btf) * up_btf, "w_down_fd")
        return c(x_btd + self.norm(out_btd, "mlp_post_norm"), BTD)

    def sinks(self):
        """The attention sinks (H,) in float32, or None without them."""
        return self.sinks_h[...].astype(jnp.float32) if hasattr(self, "sinks_h") else None

    def __call__(self, x_btd, segment_ids_bt=None, positions_bt=None, kind=None):
        """`kind`: the layer's kind in model.layer_pattern (None without one)."""
        x_btd = checkpoint_name(x_btd, "layer_input")  # names for train.remat=offload
        q_bthe, k_btke, v_btke = self.qkv(x_btd, positions_bt, kind)
        o_bthe = attention.attend(q_bthe, k_btke, v_btke, segment_ids_bt=segment_ids_bt, positions_bt=positions_bt,
                                  impl=self.attention, constrain=self.constrain, window=self.window_of(kind),
                                  scale=self.scale, softcap=self.softcap, attention_chunk=self.chunk_of(kind),
                                  sinks_h=self.sinks())
        o_bthe = checkpoint_name(self.constrain(o_bthe, BTHE), "attention_out")
        return self.finish(x_btd, o_bthe)

    def decode(self, x_btd, k_bske, v_bske, slot, positions_bt, first_b, kind=None):
        """The block (a layer of `kind`) for T new tokens written at cache slots slot..slot+T-1
        (positions_bt their rotary positions); each attends to the cached slots first_b..its own
        (slots before first_b are a row's left padding), the last `sliding_window` of them with a
        window. Returns (x_btd, k_bske, v_bske) with the cache updated. With latent attention the
        cache holds the latents instead (k: (B, S, C), v: the rotated key parts (B, S, P); see
        Gpt.cache_layout), expanded to keys and values each step."""
        window = self.window_of(kind)
        if self.mla is not None:
            h_btd = self.norm(x_btd, "attn_norm")
            q_bthe, (k_btke, v_btke) = self.mla_query(h_btd, positions_bt), self.mla_latent(h_btd, positions_bt)
        else:
            q_bthe, k_btke, v_btke = self.qkv(x_btd, positions_bt, kind)
        k_bske = jax.lax.dynamic_update_slice_in_dim(k_bske, k_btke.astype(k_bske.dtype), slot, axis=1)
        v_bske = jax.lax.dynamic_update_slice_in_dim(v_bske, v_btke.astype(v_bske.dtype), slot, axis=1)
        t, s = x_btd.shape[1], k_bske.shape[1]
        keys, values = self.mla_keys_values(k_bske, v_bske) if self.mla is not None else (k_bske, v_bske)
        key_s, query_t = jnp.arange(s), slot + jnp.arange(t)
        mask_bts = (key_s[None, None, :] <= query_t[None, :, None]) & (key_s[None, None, :] >= first_b[:, None, None])
        if window is not None:
            mask_bts &= key_s[None, None, :] > query_t[None, :, None] - window
        if (chunk := self.chunk_of(kind)) is not None:  # positions: slots after the row's left padding
            mask_bts &= (key_s[None, None, :] - first_b[:, None, None]) // chunk == (
                query_t[None, :, None] - first_b[:, None, None]) // chunk
        x_btd = self.finish(x_btd, cached_attention(q_bthe, keys, values, mask_bts, self.scale, self.softcap,
                                                    self.sinks()))
        return (x_btd[0] if isinstance(x_btd, tuple) else x_btd), k_bske, v_bske


def starting_at(cfg, first: int):
    """`cfg` for a stack of layers from layer `first` on: its layer_pattern rotated to start there."""
    kinds = cfg.layer_pattern
    if not kinds:
        return cfg
    shift = first % len(kinds)
    return dataclasses.replace(cfg, layer_pattern=tuple(kinds[shift:]) + tuple(kinds[:shift]))


class Gpt(nnx.Module):
    @staticmethod
    def adaptable(cfg) -> dict[str, str]:
        """The block weights LoRA can adapt in a model of `cfg`: parameter name -> Hugging Face module name.
        Latent attention (cfg.mla) has no grouped-query key/value weights (and no wq_dhe with a
        q_lora_rank); an MoE model's MLP weights are its experts', which take no adapters."""
        absent = set()
        if cfg.mla is not None:
            absent |= {"wk_dke", "wv_dke", *(("wq_dhe",) if cfg.mla.q_lora_rank is not None else ())}
        if cfg.moe.n_experts > 1:
            absent |= {"w_gate_df", "w_up_df", "w_down_fd"}
        return {name: hf_name for name, (_, _, hf_name) in BLOCK_WEIGHTS.items() if name not in absent}

    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain=no_constraint, quantization="none"):
        """`quantization` applies to the blocks' matmuls (projections, MLP, experts); the embedding,
        head and norms stay in the compute dtype."""
        self.constrain, self.eps, self.embed_how = constrain, cfg.rms_norm_eps, cfg.embed
        self.plus_one, self.final_softcap = cfg.norm_scale == "one_plus_weight", cfg.final_softcap
        self.embed_scale = cfg.d_model ** 0.5 if cfg.scale_embeddings else None
        self.kinds = tuple(cfg.layer_pattern)
        self.embedding_vd = param(rngs, normal(1.0), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

        def stack(c, n):
            return stacked(lambda r: Block(c, rngs=r, constrain=constrain, quantization=quantization), n, rngs)
        runs = cfg.mlp_runs
        if len(runs) > 1:  # DeepSeek: k dense layers, then the MoE ones; Llama 4: runs of either; a scan each
            dense_cfg = dataclasses.replace(cfg, d_ff=cfg.moe.dense_d_ff or cfg.d_ff,
                                            moe=dataclasses.replace(cfg.moe, n_experts=0))
            self.blocks = Stages(**{name: stack(starting_at(dense_cfg if dense else cfg, first), count)
                                    for name, first, count, dense in runs})
        else:
            self.blocks = stack(cfg, cfg.n_layers)
        self.final_norm = param(rngs, zeros if self.plus_one else ones, (cfg.d_model,), (None,))
        if not cfg.tie_embeddings:
            self.unembed_dv = param(rngs, normal(cfg.d_model ** -0.5), (cfg.d_model, cfg.vocab_size),
                                    ("embed", "vocab"))

    def embed(self, tokens_bt):
        table_vd = lookup_table(self.embedding_vd[...], self.constrain)
        x_btd = embed_lookup(table_vd, tokens_bt, self.embed_how, flat=flat_matmuls(self.constrain))
        if self.embed_scale is not None:  # sqrt(d_model) rounded to the compute dtype, as Gemma does
            x_btd = x_btd * jnp.asarray(self.embed_scale, x_btd.dtype)
        return self.constrain(x_btd, BTD)

    def _stored_unembedding(self):
        """The unembedding (D, V) as stored: its own weight, or the tied embedding transposed."""
        return self.unembed_dv[...] if hasattr(self, "unembed_dv") else self.embedding_vd[...].T

    def unembedding(self):
        """The unembedding (D, V), whole along d_model: FSDP's gather of it done once, e.g. before a
        chunked loss applies `head` chunk after chunk (else each chunk gathers it again)."""
        return self.constrain(self._stored_unembedding(), (None, "vocab"))

    def head(self, x_btd, unembed_dv=None):
        """Logits (B, T, V); `unembed_dv` as `unembedding` returns it, default the parameter as stored."""
        if unembed_dv is None:
            unembed_dv = self._stored_unembedding()
        h_btd = rms_norm(x_btd, self.final_norm[...], self.eps, plus_one=self.plus_one)
        logits_btv = softcap(dense(h_btd, unembed_dv, flat=flat_matmuls(self.constrain)), self.final_softcap)
        return self.constrain(logits_btv, BTV)

    def __call__(self, tokens_bt, segment_ids_bt=None, positions_bt=None):
        """Logits, or (logits, aux losses) for an MoE model."""
        out = scan_blocks(self.blocks, self.embed(tokens_bt), segment_ids=segment_ids_bt, positions=positions_bt)
        return (self.head(out[0]), out[1]) if isinstance(out, tuple) else self.head(out)

    @staticmethod
    def cache_layout(cfg, b: int, s: int) -> dict:
        """The KV cache generation keeps for `b` rows of `s` slots: {"k", "v": (shape, logical names)},
        (L, B, S, K, E) each; with latent attention (L, B, S, kv_lora_rank) latents and (L, B, S,
        qk_rope_head_dim) rotated key parts, the keys and values expanded from them each step."""
        if cfg.mla is not None:
            names = ("layers", "batch", None, None)
            return {"k": ((cfg.n_layers, b, s, cfg.mla.kv_lora_rank), names),
                    "v": ((cfg.n_layers, b, s, cfg.mla.qk_rope_head_dim), names)}
        shape = (cfg.n_layers, b, s, cfg.n_kv_heads, cfg.head_size)
        return {k: (shape, ("layers", "batch", None, "kv_heads", None)) for k in "kv"}

    def decode(self, tokens_bt, cache, slot, positions_bt, first_b):
        """Logits of T new tokens given a KV cache {"k", "v": (L, B, S, K, E)} (see Block.decode;
        `cache_layout` with latent attention);
        returns (logits_btv, updated cache). Prefill is T = prompt length, then T = 1 per step."""
        stages = self.blocks.stages() if isinstance(self.blocks, Stages) else [self.blocks]
        x_btd, ks, vs, first = self.embed(tokens_bt), [], [], 0
        for stage in stages:  # each stage's layers are the next ones of the cache
            graphdef, state = nnx.split(stage)
            n = jax.tree.leaves(state)[0].shape[0]

            def body(x_btd, layer, kind, graphdef=graphdef):
                layer_state, k_bske, v_bske = layer
                x_btd, k_bske, v_bske = nnx.merge(graphdef, layer_state).decode(
                    x_btd, k_bske, v_bske, slot, positions_bt, first_b, kind)
                return x_btd, (k_bske, v_bske)
            x_btd, (k_lbske, v_lbske) = scan_layers(body, x_btd, (state, cache["k"][first:first + n],
                                                               cache["v"][first:first + n]), stage.kinds)
            ks, vs, first = ks + [k_lbske], vs + [v_lbske], first + n
        cat = (lambda a: a[0]) if len(ks) == 1 else jnp.concatenate
        return self.head(x_btd), {"k": cat(ks), "v": cat(vs)}

    @staticmethod
    def update_state(cfg, params, stats: dict):
        """params after a train step's state updates from the statistics the blocks report (aux
        entries that are not losses): a sigmoid router's balancing bias moves by its layer's load
        (models/moe.py `balance_bias`)."""
        load_le = stats.get("router_load")
        if load_le is None:
            return params

        def update(path, p):
            if getattr(path[-1], "key", None) != "router_bias_e":
                return p
            return moe.balance_bias(p, load_le.reshape(p.shape), cfg.moe.bias_update_rate).astype(p.dtype)
        return jax.tree_util.tree_map_with_path(update, params)

    @staticmethod
    def flops_per_token(cfg, n_params: int, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls (forward + backward; N without a gathered
        embedding table) plus attention's scores and values, 12 L T H E. For a mixture of experts
        N counts the active parameters: each token's experts_per_token experts, not all of them."""
        head_dims = cfg.n_heads * cfg.head_size
        moe_layers = sum(count for _, _, count, dense in cfg.mlp_runs if not dense)  # DeepSeek, Llama 4: some dense
        inactive = moe_layers * moe.inactive_params(cfg) if cfg.moe.n_experts > 1 else 0
        return 6 * (matmul_params(cfg, n_params) - inactive) + 12 * cfg.n_layers * seq_len * head_dims
