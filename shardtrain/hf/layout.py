"""Our parameter tree <-> HF tensor names and layouts, one `Entry` per parameter.

Layouts (ours <- HF, per layer i; our block parameters are stacked on a leading `layers` axis):
  embedding_vd (V, D)     <- model.embed_tokens.weight (V, D)
  blocks/wq_dhe (D, H, E) <- model.layers.i.self_attn.q_proj.weight (H*E, D), transposed
  blocks/wk_dke, wv_dke   <- k_proj / v_proj.weight (K*E, D), transposed
  blocks/wo_hed (H, E, D) <- o_proj.weight (D, H*E), transposed
  blocks/bq_he, bk_ke, bv_ke <- q/k/v_proj.bias (Qwen2);  blocks/q_norm, k_norm <- q/k_norm.weight (Qwen3, Gemma 3)
  blocks/q_norm_he (H, E), k_norm_ke (K, E) <- q/k_norm.weight (H*E,), (K*E,) (OLMo 2: over the whole projection)
  blocks/w_gate_df, w_up_df (D, F) <- gate_proj / up_proj.weight (F, D);  w_down_fd <- down_proj (D, F)
  the norms by model.norm_position (final_norm <- model.norm):
    pre (Llama):       attn_norm, mlp_norm <- input_layernorm, post_attention_layernorm
    post (OLMo 2):     attn_post_norm, mlp_post_norm <- post_attention_layernorm, post_feedforward_layernorm
    pre_post (Gemma):  attn_norm, attn_post_norm, mlp_norm, mlp_post_norm <- input_layernorm,
                       post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm
  MoE blocks (per expert j; MLP and expert names: families.Moe.mlp / experts):
  blocks/moe/router_de (D, E) <- MLP.gate.weight (E, D), transposed
  blocks/moe/w_gate_edf, w_up_edf (E, D, F) <- MLP.experts.j.w1 / w3 (Mixtral), gate_proj / up_proj (Qwen) (F, D)
  blocks/moe/w_down_efd (E, F, D) <- MLP.experts.j.w2 / down_proj (D, F)
  blocks/moe/shared_w_gate_df, shared_w_up_df, shared_w_down_fd <- mlp.shared_expert.* (Qwen2-MoE)
  blocks/moe/shared_expert_gate_d1 (D, 1) <- mlp.shared_expert_gate.weight (1, D)
  unembed_dv (D, V)       <- lm_head.weight (V, D), absent when the embeddings are tied
  latent attention (DeepSeek, model.mla; R q_lora_rank, C kv_lora_rank, N + P query/key, A value channels):
  blocks/wq_a_dr (D, R), q_a_norm <- q_a_proj (R, D), q_a_layernorm;  wq_b_rhe (R, H, N+P) <- q_b_proj (H*(N+P), R)
  (or wq_dhe <- q_proj);  wkv_a_dc (D, C+P), kv_a_norm <- kv_a_proj_with_mqa (C+P, D), kv_a_layernorm;
  wkv_b_che (C, H, N+A) <- kv_b_proj (H*(N+A), C);  wo_hed (H, A, D) <- o_proj (D, H*A);
  blocks/moe/router_bias_e (E,) <- mlp.gate.e_score_correction_bias; shared experts under mlp.shared_experts.
  With moe.first_dense_layers = k: blocks/dense holds HF layers 0..k-1, blocks/sparse the others.
  gpt-oss (families.Moe.fused; under model.layers.{i}.): blocks/bo_d <- self_attn.o_proj.bias;
  blocks/sinks_h (H,) <- self_attn.sinks;  blocks/moe/router_de, router_b_e <- mlp.router.weight (E, D), bias;
  blocks/moe/w_gate_edf, w_up_edf (E, D, F) <- mlp.experts.gate_up_proj (E, D, 2F), columns 0::2 and 1::2;
  b_gate_ef, b_up_ef (E, F) <- gate_up_proj_bias (E, 2F) likewise;  w_down_efd (E, F, D), b_down_ed (E, D) <-
  down_proj, down_proj_bias (MXFP4 blocks and scales dequantized by hf/mxfp4.py).
  Qwen3-Next (`qwen3_next_map`; n = full_attention_interval): HF layer i is blocks/layer_{i % n} of group i // n;
  linear_attn.in_proj_qkvz / in_proj_ba (grouped per key head) <- w_qkvz_dc / w_ba_dh2 (all heads' q, then k, v, z),
  conv1d (C, 1, W) <- conv_wc (W, C), A_log, dt_bias, norm, out_proj <- a_log_h, dt_bias_h, norm_v, wo_vd;
  self_attn.q_proj (H 2E, D: each head's query rows, then its gate rows) <- wq_dhe, wgate_dhe.
The rotary layout needs no permutation: models/gpt.py rotates halves exactly as HF does, except
DeepSeek's interleaved pairs, de-interleaved in the rotary rows of q_b_proj and kv_a_proj (`rope_perm`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shardtrain.config import ModelConfig
from shardtrain.hf.families import LLAMA4, family_for


@dataclass(frozen=True)
class Entry:
    ours: tuple[str, ...]
    """Path in our parameter tree."""
    hf: str
    """HF tensor name; `{i}` is the layer for stacked block parameters, `{j}` the expert for MoE
    expert weights (stacked on the axis after the layers)."""
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    first: int = 0
    """Layered entries of a stage (models.layers.Stages): our layer i is HF layer first + stride i ..."""
    count: int | None = None
    """... for `count` layers (None: all the model's)."""
    stride: int = 1
    """HF layers between our consecutive ones (Qwen3-Next: our group g's layer p is HF layer 4 g + p)."""
    joined: tuple[tuple[str, ...], ...] = ()
    """More of our parameters the HF tensor holds after `ours`, equal parts of to_ours' last axis
    (the experts' gate_up_proj of Llama 4 and gpt-oss: w_gate_edf then w_up_edf)."""

    def hf_name(self, i: int | None = None, j: int | None = None) -> str:
        """The HF tensor of our layer i (None: not layered) and expert j."""
        return self.hf.format(i=None if i is None else self.first + self.stride * i, j=j)

    @property
    def paths(self) -> tuple[tuple[str, ...], ...]:
        return (self.ours, *self.joined)

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf


def same(a):
    return a


def tr(a):
    return a.T


NORMS = {"pre": [("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")],
         "post": [("attn_post_norm", "post_attention_layernorm"), ("mlp_post_norm", "post_feedforward_layernorm")],
         "pre_post": [("attn_norm", "input_layernorm"), ("attn_post_norm", "post_attention_layernorm"),
                      ("mlp_norm", "pre_feedforward_layernorm"), ("mlp_post_norm", "post_feedforward_layernorm")]}
"""model.norm_position -> each block norm's (our name, the HF module under model.layers.{i})."""


def tensor_map(m: ModelConfig) -> list[Entry]:
    if m.linear_attention is not None:
        return qwen3_next_map(m)
    runs = m.mlp_runs
    if len(runs) == 1:
        return model_map(m)
    # DeepSeek: blocks/dense holds HF layers 0..k-1, blocks/sparse the others; Llama 4: each run of dense or
    # MoE layers its stack (models.layers.Stages)
    dense = dataclasses.replace(m, d_ff=m.moe.dense_d_ff or m.d_ff, moe=dataclasses.replace(m.moe, n_experts=0))
    maps = {True: model_map(dense), False: model_map(m)}
    out = [e for e in maps[False] if not e.layered]
    return out + [dataclasses.replace(e, ours=("blocks", name, *e.ours[1:]), first=first, count=count,
                                      joined=tuple(("blocks", name, *j[1:]) for j in e.joined))
                  for name, first, count, is_dense in runs for e in maps[is_dense] if e.layered]


def rope_perm(p: int) -> np.ndarray:
    """DeepSeek's interleaved rotary pairs (x0, x1), (x2, x3), ... -> our halves [x0, x2, ...; x1, x3, ...]."""
    return np.concatenate([np.arange(0, p, 2), np.arange(1, p, 2)])


def mla_entries(m: ModelConfig) -> list[Entry]:
    """Multi-head latent attention's tensors (DeepSeek; the rotary channels de-interleaved). Each tensor's
    permutation follows its role (the queries' and the shared key's rotary rows; none for kv_b_proj's keys
    and values), never its sizes: v_head_dim may equal qk_rope_head_dim."""
    a, d, h = m.mla, m.d_model, m.n_heads
    n, p, c, v = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
    perm, attn = rope_perm(p), "model.layers.{i}.self_attn."
    q_perm = np.concatenate([np.arange(n), n + perm])
    kv_perm = np.concatenate([np.arange(c), c + perm])

    def heads(rows, x, idx=None):  # (H*X, rows) <-> (rows, H, X), each head's channels in order `idx`
        idx = np.arange(x) if idx is None else idx
        inv = np.argsort(idx)
        return (lambda t: t.T.reshape(rows, h, x)[..., idx]), (lambda t: t[..., inv].reshape(rows, h * x).T)
    out = []
    if a.q_lora_rank is None:
        out.append(Entry(("blocks", "wq_dhe"), attn + "q_proj.weight", (h * (n + p), d), *heads(d, n + p, q_perm)))
    else:
        r = a.q_lora_rank
        out += [Entry(("blocks", "wq_a_dr"), attn + "q_a_proj.weight", (r, d), tr, tr),
                Entry(("blocks", "q_a_norm"), attn + "q_a_layernorm.weight", (r,), same, same),
                Entry(("blocks", "wq_b_rhe"), attn + "q_b_proj.weight", (h * (n + p), r), *heads(r, n + p, q_perm))]
    inv = np.argsort(kv_perm)
    return out + [
        Entry(("blocks", "wkv_a_dc"), attn + "kv_a_proj_with_mqa.weight", (c + p, d),
              lambda t: t.T[:, kv_perm], lambda t: t[:, inv].T),
        Entry(("blocks", "kv_a_norm"), attn + "kv_a_layernorm.weight", (c,), same, same),
        Entry(("blocks", "wkv_b_che"), attn + "kv_b_proj.weight", (h * (n + v), c), *heads(c, n + v)),
        Entry(("blocks", "wo_hed"), attn + "o_proj.weight", (d, h * v),
              lambda t: t.T.reshape(h, v, d), lambda t: t.reshape(h * v, d).T)]


def is_llama4(m: ModelConfig) -> bool:
    return any(getattr(m, k) not in (None, False) for k in LLAMA4)


def model_map(m: ModelConfig) -> list[Entry]:
    d, h, k, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size
    e = m.head_size
    llama4 = is_llama4(m)
    order = rope_perm(e) if llama4 else None  # Llama 4 rotates interleaved pairs, as DeepSeek does

    def proj(n, idx=None):  # HF (n*E, D) <-> ours (D, n, E), each head's rows in `idx` order (default HF's)
        idx, back = (np.arange(e), np.arange(e)) if idx is None else (idx, np.argsort(idx))
        return (lambda a: a.T.reshape(d, n, e)[..., idx]), (lambda a: a[..., back].reshape(d, n * e).T)

    def bias(n):
        return (lambda a: a.reshape(n, e)), (lambda a: a.reshape(n * e))
    layer, attn = "model.layers.{i}.", "model.layers.{i}.self_attn."
    mlp = "model.layers.{i}." + ("feed_forward." if llama4 else "mlp.")
    entries = [Entry(("embedding_vd",), "model.embed_tokens.weight", (v, d), same, same)]
    entries += [Entry(("blocks", ours), layer + hf + ".weight", (d,), same, same)
                for ours, hf in NORMS[m.norm_position]]
    if m.mla is not None:
        entries += mla_entries(m)
    else:
        entries += [
            Entry(("blocks", "wq_dhe"), attn + "q_proj.weight", (h * e, d), *proj(h, order)),
            Entry(("blocks", "wk_dke"), attn + "k_proj.weight", (k * e, d), *proj(k, order)),
            Entry(("blocks", "wv_dke"), attn + "v_proj.weight", (k * e, d), *proj(k)),
            Entry(("blocks", "wo_hed"), attn + "o_proj.weight", (d, h * e),
                  lambda a: a.T.reshape(h, e, d), lambda a: a.reshape(h * e, d).T)]
    if m.qkv_bias:
        entries += [Entry(("blocks", "bq_he"), attn + "q_proj.bias", (h * e,), *bias(h)),
                    Entry(("blocks", "bk_ke"), attn + "k_proj.bias", (k * e,), *bias(k)),
                    Entry(("blocks", "bv_ke"), attn + "v_proj.bias", (k * e,), *bias(k))]
    if m.attn_out_bias:
        entries.append(Entry(("blocks", "bo_d"), attn + "o_proj.bias", (d,), same, same))
    if m.attn_sinks:
        entries.append(Entry(("blocks", "sinks_h"), attn + "sinks", (h,), same, same))
    if m.qk_norm and m.qk_norm_scope == "head":
        entries += [Entry(("blocks", "q_norm"), attn + "q_norm.weight", (e,), same, same),
                    Entry(("blocks", "k_norm"), attn + "k_norm.weight", (e,), same, same)]
    elif m.qk_norm:
        entries += [Entry(("blocks", "q_norm_he"), attn + "q_norm.weight", (h * e,), *bias(h)),
                    Entry(("blocks", "k_norm_ke"), attn + "k_norm.weight", (k * e,), *bias(k))]
    if m.moe.n_experts > 1:
        entries += llama4_moe_entries(m) if llama4 else moe_entries(m)
    else:
        entries += [Entry(("blocks", "w_gate_df"), mlp + "gate_proj.weight", (f, d), tr, tr),
                    Entry(("blocks", "w_up_df"), mlp + "up_proj.weight", (f, d), tr, tr),
                    Entry(("blocks", "w_down_fd"), mlp + "down_proj.weight", (d, f), tr, tr)]
    entries.append(Entry(("final_norm",), "model.norm.weight", (d,), same, same))
    if not m.tie_embeddings:
        entries.append(Entry(("unembed_dv",), "lm_head.weight", (v, d), tr, tr))
    return entries


def interleave(gate_up):
    """Our gates then ups (..., 2F) -> gpt-oss's gate_up_proj columns g0, u0, g1, u1, ..."""
    gate, up = np.split(gate_up, 2, axis=-1)
    return np.stack([gate, up], -1).reshape(gate_up.shape)


def deinterleave(t):
    """gpt-oss's gate_up_proj columns g0, u0, g1, u1, ... -> our gates then ups."""
    return np.concatenate([t[..., 0::2], t[..., 1::2]], axis=-1)


def grouped_to_ours(w, key_heads: int, parts: tuple[int, ...]):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (out, D), grouped per key head (each group: its q, k, v, z
    rows, or b, a), -> ours (D, out): all heads' first part, then all heads' second, ... (parts: each
    part's rows per group)."""
    groups = w.reshape(key_heads, sum(parts), -1)
    split = np.split(groups, np.cumsum(parts)[:-1], axis=1)
    return np.concatenate([s.reshape(-1, w.shape[-1]) for s in split]).T


def grouped_to_hf(w, key_heads: int, parts: tuple[int, ...]):
    """grouped_to_ours' inverse."""
    split = np.split(w.T, np.cumsum([key_heads * n for n in parts])[:-1])
    return np.concatenate([s.reshape(key_heads, n, -1) for s, n in zip(split, parts)], axis=1).reshape(w.T.shape)


def qwen3_next_map(m: ModelConfig) -> list[Entry]:
    """Qwen3-Next: HF layer i is layer i % n of our group i // n (n: full_attention_interval; models/qwen3_next.py),
    blocks/layer_p/<weight>: DeltaNet layers (p < n - 1) under linear_attn., the attention layer under self_attn."""
    a, d, n = m.linear_attention, m.d_model, m.linear_attention.full_attention_interval
    h, kv, e = m.n_heads, m.n_kv_heads, m.head_size
    key_heads, r, v = a.key_heads, a.value_heads // a.key_heads, a.value_head_dim
    qkvz, ba = (a.key_head_dim, a.key_head_dim, r * v, r * v), (r, r)
    conv = 2 * key_heads * a.key_head_dim + a.value_heads * v

    def grouped(parts):
        return (lambda w: grouped_to_ours(w, key_heads, parts)), (lambda w: grouped_to_hf(w, key_heads, parts))

    def heads(n_heads):  # (n E, D) <-> (D, n, E)
        return (lambda w: w.T.reshape(d, n_heads, e)), (lambda w: w.reshape(d, n_heads * e).T)
    both = [Entry(("mixer_norm",), "input_layernorm.weight", (d,), same, same),
            Entry(("mlp_norm",), "post_attention_layernorm.weight", (d,), same, same),
            *[dataclasses.replace(x, ours=x.ours[1:], hf=x.hf.removeprefix("model.layers.{i}."))
              for x in moe_entries(m)]]
    lin, attn = "linear_attn.", "self_attn."
    linear = [Entry(("w_qkvz_dc",), lin + "in_proj_qkvz.weight", (key_heads * sum(qkvz), d), *grouped(qkvz)),
              Entry(("w_ba_dh2",), lin + "in_proj_ba.weight", (key_heads * sum(ba), d), *grouped(ba)),
              Entry(("conv_wc",), lin + "conv1d.weight", (conv, 1, a.conv_kernel), lambda w: w[:, 0].T,
                    lambda w: w.T[:, None]),
              Entry(("a_log_h",), lin + "A_log", (a.value_heads,), same, same),
              Entry(("dt_bias_h",), lin + "dt_bias", (a.value_heads,), same, same),
              Entry(("norm_v",), lin + "norm.weight", (v,), same, same),
              Entry(("wo_vd",), lin + "out_proj.weight", (d, a.value_heads * v), tr, tr)]
    full = [Entry(("wq_dhe",), attn + "q_proj.weight", (h * 2 * e, d), lambda w: gated_query_to_ours(w, h),
                  gated_query_to_hf, joined=(("wgate_dhe",),)),
            Entry(("wk_dke",), attn + "k_proj.weight", (kv * e, d), *heads(kv)),
            Entry(("wv_dke",), attn + "v_proj.weight", (kv * e, d), *heads(kv)),
            Entry(("q_norm",), attn + "q_norm.weight", (e,), same, same),
            Entry(("k_norm",), attn + "k_norm.weight", (e,), same, same),
            Entry(("wo_hed",), attn + "o_proj.weight", (d, h * e), lambda w: w.T.reshape(h, e, d),
                  lambda w: w.reshape(h * e, d).T)]

    def at(p, x):  # entry x of layer p of every group
        def ours(path):
            return ("blocks", f"layer_{p}", *path)
        return dataclasses.replace(x, ours=ours(x.ours), hf="model.layers.{i}." + x.hf, first=p, stride=n,
                                   count=m.n_layers // n, joined=tuple(map(ours, x.joined)))
    out = [Entry(("embedding_vd",), "model.embed_tokens.weight", (m.vocab_size, d), same, same)]
    out += [at(p, x) for p in range(n) for x in both + (linear if p < n - 1 else full)]
    out.append(Entry(("final_norm",), "model.norm.weight", (d,), same, same))
    if not m.tie_embeddings:
        out.append(Entry(("unembed_dv",), "lm_head.weight", (m.vocab_size, d), tr, tr))
    return out


def fused_moe_entries(m: ModelConfig) -> list[Entry]:
    """gpt-oss's experts: stacked (E, ...) tensors with biases, gate and up interleaved in one."""
    d, f, n = m.d_model, m.d_ff, m.moe.n_experts
    mlp, ours = "model.layers.{i}.mlp.", ("blocks", "moe")
    return [Entry((*ours, "router_de"), mlp + "router.weight", (n, d), tr, tr),
            Entry((*ours, "router_b_e"), mlp + "router.bias", (n,), same, same),
            Entry((*ours, "w_gate_edf"), mlp + "experts.gate_up_proj", (n, d, 2 * f), deinterleave, interleave,
                  joined=((*ours, "w_up_edf"),)),
            Entry((*ours, "b_gate_ef"), mlp + "experts.gate_up_proj_bias", (n, 2 * f), deinterleave, interleave,
                  joined=((*ours, "b_up_ef"),)),
            Entry((*ours, "w_down_efd"), mlp + "experts.down_proj", (n, f, d), same, same),
            Entry((*ours, "b_down_ed"), mlp + "experts.down_proj_bias", (n, d), same, same)]


def moe_entries(m: ModelConfig) -> list[Entry]:
    d, f, n = m.d_model, m.d_ff, m.moe.n_experts
    moe = family_for(m).moe
    if moe.fused:
        return fused_moe_entries(m)
    mlp, (gate, up, down) = "model.layers.{i}." + moe.mlp, moe.experts
    ours = ("blocks", "moe")
    entries = [Entry((*ours, "router_de"), mlp + "gate.weight", (n, d), tr, tr),
               Entry((*ours, "w_gate_edf"), mlp + f"experts.{{j}}.{gate}.weight", (f, d), tr, tr),
               Entry((*ours, "w_up_edf"), mlp + f"experts.{{j}}.{up}.weight", (f, d), tr, tr),
               Entry((*ours, "w_down_efd"), mlp + f"experts.{{j}}.{down}.weight", (d, f), tr, tr)]
    if m.moe.router == "sigmoid":
        entries.append(Entry((*ours, "router_bias_e"), mlp + "gate.e_score_correction_bias", (n,), same, same))
    if m.moe.n_shared_experts:
        s = m.moe.shared_expert_d_ff or m.moe.n_shared_experts * f
        shared = mlp + ("shared_experts." if moe.shared == "plain" else "shared_expert.")
        entries += [Entry((*ours, "shared_w_gate_df"), shared + "gate_proj.weight", (s, d), tr, tr),
                    Entry((*ours, "shared_w_up_df"), shared + "up_proj.weight", (s, d), tr, tr),
                    Entry((*ours, "shared_w_down_fd"), shared + "down_proj.weight", (d, s), tr, tr)]
    if m.moe.shared_expert_gate:
        entries.append(Entry((*ours, "shared_expert_gate_d1"), mlp + "shared_expert_gate.weight", (1, d), tr, tr))
    return entries


def llama4_moe_entries(m: ModelConfig) -> list[Entry]:
    """Llama 4's MoE tensors: the router (E, D), the experts fused per layer (gate_up_proj (E, D, 2F):
    gates then ups; down_proj (E, F, D), both in our layout already) and the shared expert."""
    d, f, n = m.d_model, m.d_ff, m.moe.n_experts
    ours, ff = ("blocks", "moe"), "model.layers.{i}.feed_forward."
    return [Entry((*ours, "router_de"), ff + "router.weight", (n, d), tr, tr),
            Entry((*ours, "w_gate_edf"), ff + "experts.gate_up_proj", (n, d, 2 * f), same, same,
                  joined=((*ours, "w_up_edf"),)),
            Entry((*ours, "w_down_efd"), ff + "experts.down_proj", (n, f, d), same, same),
            *[Entry((*ours, f"shared_{name}"), ff + f"shared_expert.{hf}.weight", shape, tr, tr)
              for name, hf, shape in (("w_gate_df", "gate_proj", (f, d)), ("w_up_df", "up_proj", (f, d)),
                                      ("w_down_fd", "down_proj", (d, f)))]]


def indexed_names(entry: Entry, m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, index into our stacked parameter) for each HF tensor of `entry`."""
    layers = range(m.n_layers if entry.count is None else entry.count) if entry.layered else [None]
    experts = range(m.moe.n_experts) if entry.per_expert else [None]
    return [(entry.hf_name(i, j), tuple(x for x in (i, j) if x is not None))
            for i in layers for j in experts]


def names_of(entry: Entry, m: ModelConfig) -> list[str]:
    return [name for name, _ in indexed_names(entry, m)]


def tree_get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def tree_set(tree: dict, path, value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def gated_query_to_ours(w, heads: int):
    """Qwen3-Next's q_proj (H 2E, D), each head's query rows then its gate rows, -> (D, H, 2E): our
    wq_dhe and wgate_dhe as the two halves of the last axis (an Entry's `joined`)."""
    return w.reshape(heads, w.shape[0] // heads, -1).transpose(2, 0, 1)


def gated_query_to_hf(w_dhe2):
    """gated_query_to_ours' inverse."""
    return w_dhe2.transpose(1, 2, 0).reshape(-1, w_dhe2.shape[0])
