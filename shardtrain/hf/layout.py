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
The rotary layout needs no permutation: models/gpt.py rotates halves exactly as HF does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shardtrain.config import ModelConfig
from shardtrain.hf.families import family_for


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
    d, h, k, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size
    e = m.head_size

    def proj(n):  # HF (n*E, D) <-> ours (D, n, E)
        return (lambda a: a.T.reshape(d, n, e)), (lambda a: a.reshape(d, n * e).T)

    def bias(n):
        return (lambda a: a.reshape(n, e)), (lambda a: a.reshape(n * e))
    layer, attn, mlp = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    entries = [Entry(("embedding_vd",), "model.embed_tokens.weight", (v, d), same, same)]
    entries += [Entry(("blocks", ours), layer + hf + ".weight", (d,), same, same)
                for ours, hf in NORMS[m.norm_position]]
    entries += [
        Entry(("blocks", "wq_dhe"), attn + "q_proj.weight", (h * e, d), *proj(h)),
        Entry(("blocks", "wk_dke"), attn + "k_proj.weight", (k * e, d), *proj(k)),
        Entry(("blocks", "wv_dke"), attn + "v_proj.weight", (k * e, d), *proj(k)),
    ]
    if m.qkv_bias:
        entries += [Entry(("blocks", "bq_he"), attn + "q_proj.bias", (h * e,), *bias(h)),
                    Entry(("blocks", "bk_ke"), attn + "k_proj.bias", (k * e,), *bias(k)),
                    Entry(("blocks", "bv_ke"), attn + "v_proj.bias", (k * e,), *bias(k))]
    if m.qk_norm and m.qk_norm_scope == "head":
        entries += [Entry(("blocks", "q_norm"), attn + "q_norm.weight", (e,), same, same),
                    Entry(("blocks", "k_norm"), attn + "k_norm.weight", (e,), same, same)]
    elif m.qk_norm:
        entries += [Entry(("blocks", "q_norm_he"), attn + "q_norm.weight", (h * e,), *bias(h)),
                    Entry(("blocks", "k_norm_ke"), attn + "k_norm.weight", (k * e,), *bias(k))]
    entries += [
        Entry(("blocks", "wo_hed"), attn + "o_proj.weight", (d, h * e),
              lambda a: a.T.reshape(h, e, d), lambda a: a.reshape(h * e, d).T),
    ]
    if m.moe.n_experts > 1:
        entries += moe_entries(m)
    else:
        entries += [Entry(("blocks", "w_gate_df"), mlp + "gate_proj.weight", (f, d), tr, tr),
                    Entry(("blocks", "w_up_df"), mlp + "up_proj.weight", (f, d), tr, tr),
                    Entry(("blocks", "w_down_fd"), mlp + "down_proj.weight", (d, f), tr, tr)]
    entries.append(Entry(("final_norm",), "model.norm.weight", (d,), same, same))
    if not m.tie_embeddings:
        entries.append(Entry(("unembed_dv",), "lm_head.weight", (v, d), tr, tr))
    return entries


def moe_entries(m: ModelConfig) -> list[Entry]:
    d, f, n = m.d_model, m.d_ff, m.moe.n_experts
    moe = family_for(m).moe
    mlp, (gate, up, down) = "model.layers.{i}." + moe.mlp, moe.experts
    ours = ("blocks", "moe")
    entries = [Entry((*ours, "router_de"), mlp + "gate.weight", (n, d), tr, tr),
               Entry((*ours, "w_gate_edf"), mlp + f"experts.{{j}}.{gate}.weight", (f, d), tr, tr),
               Entry((*ours, "w_up_edf"), mlp + f"experts.{{j}}.{up}.weight", (f, d), tr, tr),
               Entry((*ours, "w_down_efd"), mlp + f"experts.{{j}}.{down}.weight", (d, f), tr, tr)]
    if m.moe.n_shared_experts:
        s = m.moe.shared_expert_d_ff or m.moe.n_shared_experts * f
        entries += [Entry((*ours, "shared_w_gate_df"), mlp + "shared_expert.gate_proj.weight", (s, d), tr, tr),
                    Entry((*ours, "shared_w_up_df"), mlp + "shared_expert.up_proj.weight", (s, d), tr, tr),
                    Entry((*ours, "shared_w_down_fd"), mlp + "shared_expert.down_proj.weight", (d, s), tr, tr),
                    Entry((*ours, "shared_expert_gate_d1"), mlp + "shared_expert_gate.weight", (1, d), tr, tr)]
    return entries


def indexed_names(entry: Entry, m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, index into our stacked parameter) for each HF tensor of `entry`."""
    layers = range(m.n_layers) if entry.layered else [None]
    experts = range(m.moe.n_experts) if entry.per_expert else [None]
    return [(entry.hf.format(i=i, j=j), tuple(x for x in (i, j) if x is not None)) for i in layers for j in experts]


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
