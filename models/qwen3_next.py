"""Qwen3-Next (Qwen3NextForCausalLM) as functions of its weights: the gated full-attention layer
(Qwen3NextAttention), its MoE, and `logits`, the whole decoder layer after layer (the reference the
trainer's model must equal; `greedy` generates with each linear layer's recurrent state and the
attention layers' keys and values), and `Qwen3Next`, the trainer's model (model.name qwen3_next):
groups of full_attention_interval layers (DeltaNet layers, then one attention layer) in a rolled
scan over the groups, the routed experts through models/moe.py `Moe`. Its linear attention layers
are models/deltanet.py `linear_attention`.

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
from flax import nnx

from models import attention, deltanet, moe
from models.contract import no_constraint
from models.gpt import Gpt, cached_attention, rms_norm, rotary
from models.layers import BTD, matmul_params, param, stacked

normal, ones, zeros = nnx.initializers.normal, nnx.initializers.ones, nnx.initializers.zeros


def partial_rotary(x_bthe, rotary_dim: int, theta: float, positions_bt=None):
    """Rotary position embedding on the first `rotary_dim` channels of each head; the rest unchanged."""
    return jnp.concatenate([rotary(x_bthe[..., :rotary_dim], theta, positions_bt), x_bthe[..., rotary_dim:]], -1)


def gated_qkv(p: dict, x_btd, positions_bt, *, rotary_dim: int, theta: float, eps: float = 1e-6):
    """The gated attention's rotated queries, their output gates (both (B, T, H, E)), rotated keys and
    values (B, T, K, E) at `positions_bt`."""
    q_bthe, gate_bthe = (jnp.einsum("btd,dhe->bthe", x_btd, p[w]) for w in ("wq_dhe", "wgate_dhe"))
    k_btke, v_btke = (jnp.einsum("btd,dke->btke", x_btd, p[w]) for w in ("wk_dke", "wv_dke"))
    q_bthe, k_btke = (partial_rotary(rms_norm(x, p[n], eps, plus_one=True), rotary_dim, theta, positions_bt)
                      for x, n in ((q_bthe, "q_norm"), (k_btke, "k_norm")))
    return q_bthe, gate_bthe, k_btke, v_btke


def gated_output(p: dict, o_bthe, gate_bthe):
    return jnp.einsum("bthe,hed->btd", o_bthe * jax.nn.sigmoid(gate_bthe), p["wo_hed"])


def gated_attention(p: dict, x_btd, *, rotary_dim: int, theta: float, eps: float = 1e-6, past=None, start: int = 0,
                    impl: str = "xla", constrain=None):
    """Causal attention with per-head output gates: (o_btd, (keys, values)). `p`: wq_dhe, wgate_dhe
    (D, H, E), wk_dke, wv_dke (D, K, E), q_norm, k_norm (E,: 1 + w), wo_hed (H, E, D). Without `past`:
    the T tokens' rotated keys and values; with `past` (generation: (B, S, K, E) buffers holding the
    earlier tokens' at slots 0..start-1), the T tokens at positions start.. are written into slots
    start.. and attend to everything up to themselves; the buffers are returned."""
    t = x_btd.shape[1]
    positions_bt = start + jnp.arange(t)[None]
    q_bthe, gate_bthe, k_btke, v_btke = gated_qkv(p, x_btd, positions_bt, rotary_dim=rotary_dim, theta=theta, eps=eps)
    if past is None:
        o_bthe = attention.attend(q_bthe, k_btke, v_btke, impl=impl, constrain=constrain)
    else:
        k_btke, v_btke = (jax.lax.dynamic_update_slice_in_dim(a, b, start, 1) for a, b in zip(past, (k_btke, v_btke)))
        mask_bts = (jnp.arange(k_btke.shape[1])[None, :] <= positions_bt[0][:, None])[None]
        o_bthe = cached_attention(q_bthe, k_btke, v_btke, mask_bts)
    return gated_output(p, o_bthe, gate_bthe), (k_btke, v_btke)


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


# ----------------------------------------------------------------------------- the trainer's model

LINEAR_WEIGHTS = ("w_qkvz_dc", "w_ba_dh2", "conv_wc", "a_log_h", "dt_bias_h", "norm_v", "wo_vd")
ATTENTION_WEIGHTS = ("wq_dhe", "wgate_dhe", "wk_dke", "wv_dke", "q_norm", "k_norm", "wo_hed")


class Layer(nnx.Module):
    """One layer: its mixer (`linear`: gated DeltaNet, `attention`: gated full attention) and its MoE,
    each after an RMSNorm with 1 + w, each added to the residual."""

    def __init__(self, cfg, kind: str, *, rngs: nnx.Rngs, constrain=no_constraint, quantization="none"):
        d, a = cfg.d_model, cfg.linear_attention
        self.kind, self.constrain, self.eps, self.impl = kind, constrain, cfg.rms_norm_eps, cfg.attention
        self.n_key_heads, self.chunk, self.theta = a.key_heads, a.chunk, cfg.rope_theta
        self.rotary_dim = int(cfg.head_size * cfg.rotary_fraction)
        self.mixer_norm = param(rngs, zeros, (d,), (None,))
        if kind == "linear":
            h, qk, v = a.value_heads, a.key_heads * a.key_head_dim, a.value_head_dim
            self.w_qkvz_dc = param(rngs, normal(d ** -0.5), (d, 2 * qk + 2 * h * v), ("embed", None))
            self.w_ba_dh2 = param(rngs, normal(d ** -0.5), (d, 2 * h), ("embed", None))
            self.conv_wc = param(rngs, normal(a.conv_kernel ** -0.5), (a.conv_kernel, 2 * qk + h * v), (None, None))
            self.a_log_h = param(rngs, zeros, (h,), ("heads",))  # (the value heads: the scan runs per shard of them)
            self.dt_bias_h = param(rngs, ones, (h,), ("heads",))
            self.norm_v = param(rngs, ones, (v,), (None,))
            self.wo_vd = param(rngs, normal((h * v) ** -0.5 / 2), (h * v, d), (None, "embed"))
        else:
            h, k, e = cfg.n_heads, cfg.n_kv_heads, cfg.head_size
            self.wq_dhe = param(rngs, normal(d ** -0.5), (d, h, e), ("embed", "heads", None))
            self.wgate_dhe = param(rngs, normal(d ** -0.5), (d, h, e), ("embed", "heads", None))
            self.wk_dke = param(rngs, normal(d ** -0.5), (d, k, e), ("embed", "kv_heads", None))
            self.wv_dke = param(rngs, normal(d ** -0.5), (d, k, e), ("embed", "kv_heads", None))
            self.q_norm = param(rngs, zeros, (e,), (None,))
            self.k_norm = param(rngs, zeros, (e,), (None,))
            self.wo_hed = param(rngs, normal((h * e) ** -0.5 / 2), (h, e, d), ("heads", None, "embed"))
        self.mlp_norm = param(rngs, zeros, (d,), (None,))
        self.moe = moe.Moe(cfg, rngs=rngs, constrain=constrain, quantization=quantization)

    def weights(self) -> dict:
        return {n: getattr(self, n)[...] for n in (LINEAR_WEIGHTS if self.kind == "linear" else ATTENTION_WEIGHTS)}

    def qkv(self, h_btd, positions_bt):
        return gated_qkv(self.weights(), h_btd, positions_bt, rotary_dim=self.rotary_dim, theta=self.theta,
                         eps=self.eps)

    def finish(self, x_btd, out_btd):
        """The mixer's output added, then the MoE's: (x_btd, aux losses)."""
        c = self.constrain
        x_btd = c(x_btd + out_btd, BTD)
        out_btd, aux = self.moe(rms_norm(x_btd, self.mlp_norm[...], self.eps, plus_one=True))
        return c(x_btd + out_btd, BTD), aux

    def __call__(self, x_btd, segment_ids_bt=None, positions_bt=None):
        h_btd = rms_norm(x_btd, self.mixer_norm[...], self.eps, plus_one=True)
        if self.kind == "linear":
            out_btd, _ = deltanet.linear_attention(self.weights(), h_btd, n_key_heads=self.n_key_heads, eps=self.eps,
                                                   chunk=self.chunk, segment_ids_bt=segment_ids_bt,
                                                   constrain=self.constrain)
        else:
            q_bthe, gate_bthe, k_btke, v_btke = self.qkv(h_btd, positions_bt)
            o_bthe = attention.attend(q_bthe, k_btke, v_btke, segment_ids_bt=segment_ids_bt, positions_bt=positions_bt,
                                      impl=self.impl, constrain=self.constrain)
            out_btd = gated_output(self.weights(), o_bthe, gate_bthe)
        return self.finish(x_btd, out_btd)

    def decode(self, x_btd, cache, slot, positions_bt, first_b):
        """The layer for T new tokens at cache slots slot..slot+T-1 (slots before first_b are a row's
        left padding). `cache`: a linear layer's (conv window, recurrent state), continued from; an
        attention layer's (keys, values) (B, S, K, E), written at the slots. Returns (x_btd, cache)."""
        h_btd = rms_norm(x_btd, self.mixer_norm[...], self.eps, plus_one=True)
        query_t = slot + jnp.arange(x_btd.shape[1])
        if self.kind == "linear":  # padding enters as zeros, which leave both states as they are (as transformers)
            h_btd = h_btd * (query_t[None, :] >= first_b[:, None])[..., None].astype(h_btd.dtype)
            out_btd, (conv, state) = deltanet.linear_attention(
                self.weights(), h_btd, n_key_heads=self.n_key_heads, eps=self.eps, chunk=self.chunk,
                conv_state_bwc=cache[0], state_bhkv=cache[1], constrain=self.constrain)
            cache = (conv.astype(cache[0].dtype), state.astype(cache[1].dtype))
        else:
            q_bthe, gate_bthe, k_btke, v_btke = self.qkv(h_btd, positions_bt)
            k_bske, v_bske = (jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), slot, 1)
                              for buf, new in zip(cache, (k_btke, v_btke)))
            key_s = jnp.arange(k_bske.shape[1])
            mask_bts = (key_s[None, None] <= query_t[None, :, None]) & (key_s[None, None] >= first_b[:, None, None])
            out_btd = gated_output(self.weights(), cached_attention(q_bthe, k_bske, v_bske, mask_bts), gate_bthe)
            cache = (k_bske, v_bske)
        return self.finish(x_btd, out_btd)[0], cache


class Group(nnx.Module):
    """full_attention_interval layers: DeltaNet layers `layer_0`.. then the attention layer, last."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain=no_constraint, quantization="none"):
        self.n = cfg.linear_attention.full_attention_interval
        for i in range(self.n):
            setattr(self, f"layer_{i}", Layer(cfg, "linear" if i < self.n - 1 else "attention", rngs=rngs,
                                              constrain=constrain, quantization=quantization))

    def layers(self) -> list[Layer]:
        return [getattr(self, f"layer_{i}") for i in range(self.n)]

    def __call__(self, x_btd, segment_ids_bt=None, positions_bt=None):
        total = {}
        for layer in self.layers():
            x_btd, aux = layer(x_btd, segment_ids_bt, positions_bt)
            total = {k: total.get(k, 0) + v for k, v in aux.items()}
        return x_btd, total

    def decode(self, x_btd, cache, slot, positions_bt, first_b):
        """`cache`: (k, v, conv, state) of this group: its attention layer's keys and values, its
        linear layers' conv windows and recurrent states stacked (P, ...)."""
        k, v, conv_p, state_p = cache
        convs, states = [], []
        for i, layer in enumerate(self.layers()[:-1]):
            x_btd, (conv, state) = layer.decode(x_btd, (conv_p[i], state_p[i]), slot, positions_bt, first_b)
            convs, states = convs + [conv], states + [state]
        x_btd, (k, v) = self.layers()[-1].decode(x_btd, (k, v), slot, positions_bt, first_b)
        return x_btd, (k, v, jnp.stack(convs), jnp.stack(states))


class Qwen3Next(Gpt):
    """Qwen3-Next for the trainer: the embedding, the groups of layers (a rolled scan over groups,
    `blocks`, each a `Group`), the final norm (1 + w) and the unembedding; Gpt's embed and head."""

    @staticmethod
    def adaptable(cfg) -> dict[str, str]:
        return {}

    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain=no_constraint, quantization="none"):
        self.constrain, self.eps, self.embed_how = constrain, cfg.rms_norm_eps, cfg.embed
        self.plus_one, self.final_softcap, self.embed_scale, self.kinds = True, None, None, ()
        self.embedding_vd = param(rngs, normal(1.0), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        groups = cfg.n_layers // cfg.linear_attention.full_attention_interval
        self.blocks = stacked(lambda r: Group(cfg, rngs=r, constrain=constrain, quantization=quantization), groups,
                              rngs)
        self.final_norm = param(rngs, zeros, (cfg.d_model,), (None,))
        if not cfg.tie_embeddings:
            self.unembed_dv = param(rngs, normal(cfg.d_model ** -0.5), (cfg.d_model, cfg.vocab_size),
                                    ("embed", "vocab"))

    @staticmethod
    def cache_layout(cfg, b: int, s: int) -> dict:
        """What generation keeps for `b` rows of `s` slots, per group G: the attention layer's keys and
        values (G, B, S, K, E), and each of its P linear layers' conv window (G, P, B, W - 1, C) and
        recurrent state (G, P, B, H, K, V)."""
        a = cfg.linear_attention
        g, p = cfg.n_layers // a.full_attention_interval, a.full_attention_interval - 1
        channels = 2 * a.key_heads * a.key_head_dim + a.value_heads * a.value_head_dim
        kv = ((g, b, s, cfg.n_kv_heads, cfg.head_size), ("layers", "batch", None, "kv_heads", None))
        return {"k": kv, "v": kv,
                "conv": ((g, p, b, a.conv_kernel - 1, channels), ("layers", None, "batch", None, None)),
                "state": ((g, p, b, a.value_heads, a.key_head_dim, a.value_head_dim),
                          ("layers", None, "batch", "heads", None, None))}

    def decode(self, tokens_bt, cache, slot, positions_bt, first_b):
        """Logits of T new tokens given the cache of `cache_layout` (Layer.decode); returns (logits_btv,
        updated cache). Prefill is T = prompt length, then T = 1 per step."""
        graphdef, state = nnx.split(self.blocks)

        def body(x_btd, xs):
            group_state, *group_cache = xs
            return nnx.merge(graphdef, group_state).decode(x_btd, group_cache, slot, positions_bt, first_b)
        names = ("k", "v", "conv", "state")
        x_btd, out = jax.lax.scan(body, self.embed(tokens_bt), (state, *(cache[n] for n in names)))
        return self.head(x_btd), dict(zip(names, out))

    @staticmethod
    def flops_per_token(cfg, n_params: int, seq_len: int) -> float:
        """Training FLOPs per token: 6N over the active parameters (each token's experts_per_token
        experts), the attention layers' 12 T H E each, and the DeltaNet scans' 3 x (2 C (2 K + V) +
        6 K V) per value head (within-chunk scores and values, the state's reads and update)."""
        a = cfg.linear_attention
        attention_layers = cfg.n_layers // a.full_attention_interval
        c, k, v = min(a.chunk, seq_len), a.key_head_dim, a.value_head_dim
        scan = 3 * (2 * c * (2 * k + v) + 6 * k * v) * a.value_heads * (cfg.n_layers - attention_layers)
        inactive = cfg.n_layers * moe.inactive_params(cfg)
        return (6 * (matmul_params(cfg, n_params) - inactive) + 12 * attention_layers * seq_len * cfg.n_heads
                * cfg.head_size + scan)
