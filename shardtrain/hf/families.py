"""The Hugging Face families we read and write, one row each: every fact about a family that the
config mapping (hf/config.py) and the tensor layout (hf/layout.py) need, in one table.

All of them but Qwen3-Next are configs of the one decoder in models/gpt.py. A family differs from another in
- its attention: q/k/v biases (Qwen2), RMSNorm on each query and key head (Qwen3);
- the model fields it fixes (`traits`: OLMo 2's norms after the sublayers, Gemma's GeGLU, ...) and
  the optional ones its config.json can hold (`extras`: Gemma's soft caps, ...);
- how config.json decides the sliding window (`window`: Gemma's and OLMo 3's `layer_types` mix local and
  global layers; the local ones' rotary base: `local_theta_key`, `local_theta`);
- for a mixture of experts: which config.json key holds each of our MoE fields, the defaults when
  a key is absent, and the names of its MoE MLP's tensors;
- DeepSeek-V3's latent attention (`mla`);
- gpt-oss's attention sinks and output bias (traits), its experts' biases, clamped SwiGLU and fused
  expert tensors (`Moe.fused`);
- Qwen3-Next's DeltaNet and gated attention layers (`linear`: models/qwen3_next.py, not the one decoder).

`family_for(model)` picks the family that holds our model config exactly: a config that no family
holds (say qk_norm and qkv_bias together) is a ConfigError rather than an export that drops a
feature.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from shardtrain.config import ConfigError, ModelConfig, MoeConfig


@dataclass(frozen=True)
class Moe:
    """A mixture-of-experts family's config keys and tensor names."""

    keys: dict[str, tuple[str, ...]]
    """Our ModelConfig field -> its config.json keys: read from the first one present; written to
    the first, and to the others where the base config.json already has them."""
    defaults: dict[str, object]
    """Our field -> its value when config.json has none of its keys (the value's type converts)."""
    mlp: str
    """The MoE MLP's module under model.layers.{i}."""
    experts: tuple[str, str, str]
    """Each expert's gate, up and down projection names (under `mlp`experts.{j}.)."""
    fixed: dict[str, object] = field(default_factory=dict)
    """Our fields the family cannot change (Mixtral always renormalises the top-k weights)."""
    shared_expert: bool = False
    """One gated shared expert, its size in shared_expert_intermediate_size (Qwen2-MoE)."""
    shared: Literal["none", "gated", "plain"] = "none"
    """Shared experts: none; `gated`: one gated shared expert of shared_expert_intermediate_size
    (Qwen2-MoE, also `shared_expert`); `plain`: n_shared_experts of the experts' size, one MLP
    under `mlp`shared_experts (DeepSeek)."""
    derived: tuple[str, ...] = ()
    """Our MoE fields the family's own mapping reads and writes (Llama 4's dense_layers, dense_d_ff)."""
    sparse_step: bool = False
    """config.json can leave dense layers between MoE layers (decoder_sparse_step, mlp_only_layers);
    we read only configs where every layer is MoE (Qwen-MoE)."""
    fused: bool = False
    """The experts as stacked tensors under `mlp`experts.: gate_up_proj (E, D, 2F), gate and up
    columns interleaved, down_proj (E, F, D), with biases, and a router with a bias (gpt-oss)."""


@dataclass(frozen=True)
class Family:
    architecture: str
    """config.json `architectures[0]`."""
    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    window: Literal["never", "always", "use_sliding_window", "layer_types"] = "never"
    """How config.json sets the sliding window: never (Llama); `sliding_window` on every layer
    (Mistral, Mixtral); `sliding_window` when `use_sliding_window`, on the layers from
    `max_window_layers` on or as `layer_types` says (Qwen); on the `sliding_attention` layers of
    `layer_types` (default: all but every `pattern`-th), the others global (Gemma)."""
    moe: Moe | None = None
    traits: dict[str, object] = field(default_factory=dict)
    """Our ModelConfig fields (TRAITS) the family fixes where they differ from the defaults."""
    extras: tuple[str, ...] = ()
    """Our optional ModelConfig fields (EXTRAS) its config.json can hold (set, not null)."""
    pattern: int = 0
    """window=layer_types: without `layer_types`, every pattern-th layer is global (Gemma 3 reads
    `sliding_window_pattern` first)."""
    mla: bool = False
    """Multi-head latent attention (DeepSeek): our model.mla from config.json's q_lora_rank, ...."""
    act_key: str = "hidden_act"
    """The config.json key of the MLP's activation."""
    llama4: bool = False
    """Llama 4's chunked rotary layers and NoPE global ones, qk L2 norm, interleaved dense / MoE layers
    (hf/config.py llama4_fields), its feed_forward tensors with fused experts (hf/layout.py)."""
    local_theta_key: str | None = "rope_local_base_freq"
    """With rope_local_theta in extras: config.json's key of the local layers' rotary base besides
    rope_parameters per layer type (Gemma 3's; OLMo 3 has none)."""
    local_theta: float = 10000.0
    """... and that base when config.json gives neither (OLMo 3: transformers' default_theta, whatever
    rope_theta says)."""
    rope: dict = field(default_factory=dict)
    """The rope scaling transformers assumes when config.json has no rope_parameters / rope_scaling
    (gpt-oss: yarn); {}: none."""
    linear: bool = False
    """Qwen3-Next's hybrid: gated DeltaNet layers and gated attention layers with partial rotary
    (our model.linear_attention, model.rotary_fraction; model.name qwen3_next, not the one decoder)."""

    def trait(self, name: str):
        """The value the family fixes for ModelConfig field `name` (one of TRAITS)."""
        return self.traits.get(name, TRAIT_DEFAULTS[name])


TRAIT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                  if f.name in ("norm_position", "norm_scale", "activation", "scale_embeddings", "qk_norm_scope",
                              "attn_sinks", "attn_out_bias")}
"""The ModelConfig fields a family fixes (Family.traits), with their defaults."""
EXTRAS = ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "rope_local_theta")
"""Optional ModelConfig fields only some families hold (Family.extras)."""
LLAMA4 = ("attention_chunk", "global_nope", "attn_temperature", "qk_l2_norm")
"""ModelConfig fields only Llama 4 holds (Family.llama4)."""
GEMMA = dict(traits={"norm_position": "pre_post", "norm_scale": "one_plus_weight", "activation": "gelu_tanh",
                     "scale_embeddings": True}, window="layer_types", act_key="hidden_activation")


QWEN_MOE_KEYS = {"router_aux_loss_coef": ("router_aux_loss_coef",),
                 "n_experts": ("num_experts", "num_local_experts"),  # transformers 5 writes Qwen3-MoE's under both
                 "experts_per_token": ("num_experts_per_tok",), "d_ff": ("moe_intermediate_size",),
                 "norm_topk_prob": ("norm_topk_prob",)}
QWEN_MOE_DEFAULTS = {"router_aux_loss_coef": 0.001, "norm_topk_prob": False}
QWEN_EXPERTS = ("gate_proj", "up_proj", "down_proj")

FAMILIES = {f.architecture: f for f in [  # in order of preference when several hold a model config
    Family("LlamaForCausalLM", "llama"),
    Family("MistralForCausalLM", "mistral", window="always"),
    Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True, window="use_sliding_window"),
    Family("Qwen3ForCausalLM", "qwen3", qk_norm=True, window="use_sliding_window"),
    Family("Olmo2ForCausalLM", "olmo2", qk_norm=True, traits={"norm_position": "post", "qk_norm_scope": "projection"}),
    Family("Olmo3ForCausalLM", "olmo3", qk_norm=True, traits={"norm_position": "post", "qk_norm_scope": "projection"},
           window="layer_types", pattern=4, extras=("rope_local_theta",), local_theta_key=None, local_theta=500000.0),
    Family("Gemma2ForCausalLM", "gemma2", **GEMMA, pattern=2,
           extras=("query_pre_attn_scalar", "attn_softcap", "final_softcap")),
    Family("Gemma3ForCausalLM", "gemma3", **GEMMA, pattern=6, qk_norm=True, extras=EXTRAS),
    Family("MixtralForCausalLM", "mixtral", window="always", moe=Moe(
        keys={"router_aux_loss_coef": ("router_aux_loss_coef",), "n_experts": ("num_local_experts",),
              "experts_per_token": ("num_experts_per_tok",)},
        defaults={"router_aux_loss_coef": 0.01}, mlp="block_sparse_moe.", experts=("w1", "w3", "w2"),
        fixed={"norm_topk_prob": True})),
    Family("Qwen2MoeForCausalLM", "qwen2_moe", qkv_bias=True, window="use_sliding_window", moe=Moe(
        QWEN_MOE_KEYS, QWEN_MOE_DEFAULTS, "mlp.", QWEN_EXPERTS, shared_expert=True, sparse_step=True)),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True, window="use_sliding_window", moe=Moe(
        QWEN_MOE_KEYS, QWEN_MOE_DEFAULTS, "mlp.", QWEN_EXPERTS, sparse_step=True)),
    Family("DeepseekV3ForCausalLM", "deepseek_v3", mla=True, moe=Moe(
        keys={"n_experts": ("n_routed_experts",), "experts_per_token": ("num_experts_per_tok",),
              "d_ff": ("moe_intermediate_size",), "norm_topk_prob": ("norm_topk_prob",),
              "n_shared_experts": ("n_shared_experts",), "routed_scaling_factor": ("routed_scaling_factor",),
              "n_groups": ("n_group",), "topk_groups": ("topk_group",),
              "first_dense_layers": ("first_k_dense_replace",), "dense_d_ff": ("intermediate_size",)},
        defaults={"norm_topk_prob": True, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_groups": 8,
                  "topk_groups": 4, "first_dense_layers": 3},
        mlp="mlp.", experts=QWEN_EXPERTS, fixed={"router": "sigmoid"}, shared="plain")),
    Family("Llama4ForCausalLM", "llama4_text", llama4=True, moe=Moe(
        keys={"n_experts": ("num_local_experts",), "experts_per_token": ("num_experts_per_tok",),
              "router_aux_loss_coef": ("router_aux_loss_coef",)},
        defaults={"experts_per_token": 1, "router_aux_loss_coef": 0.001}, mlp="feed_forward.",
        experts=("gate_up_proj", "gate_up_proj", "down_proj"), fixed={"router": "sigmoid_input", "n_shared_experts": 1},
        shared="plain", derived=("dense_layers", "dense_d_ff"))),
    Family("GptOssForCausalLM", "gpt_oss", qkv_bias=True, window="layer_types", pattern=2,
           traits={"attn_sinks": True, "attn_out_bias": True}, rope={
               "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
               "original_max_position_embeddings": 4096}, moe=Moe(
               keys={"n_experts": ("num_local_experts",), "experts_per_token": ("num_experts_per_tok",),
                     "router_aux_loss_coef": ("router_aux_loss_coef",), "swiglu_limit": ("swiglu_limit",),
                     "swiglu_alpha": ("swiglu_alpha",)},
               defaults={"router_aux_loss_coef": 0.001, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}, mlp="mlp.",
               experts=("gate_up_proj", "gate_up_proj", "down_proj"), fused=True,
               fixed={"norm_topk_prob": True, "router_logit_bias": True, "expert_bias": True})),
    Family("Qwen3NextForCausalLM", "qwen3_next", qk_norm=True, traits={"norm_scale": "one_plus_weight"}, linear=True,
           moe=Moe(QWEN_MOE_KEYS, QWEN_MOE_DEFAULTS, "mlp.", QWEN_EXPERTS, shared_expert=True, sparse_step=True)),
]}
ROUTING = ("router", "n_groups", "topk_groups", "routed_scaling_factor", "first_dense_layers", "dense_d_ff",
           "dense_layers", "router_logit_bias", "expert_bias", "swiglu_limit", "swiglu_alpha")
"""MoE fields that change the math which only families naming them (keys, fixed) hold."""


def family_of(hf: dict, where: str) -> Family:
    """The family of an HF config.json (ConfigError naming the architecture if unsupported)."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch == "Llama4ForConditionalGeneration":
        raise ConfigError(f"{where}: Llama4ForConditionalGeneration (Llama 4 with its vision tower) is not supported; "
                          "import its text model (Llama4ForCausalLM: text_config as config.json, the "
                          "language_model.model.* tensors as model.*)")
    if arch not in FAMILIES:
        raise ConfigError(f"{where}: architecture {arch or hf.get('model_type')!r} is not supported; "
                          f"supported: {', '.join(FAMILIES)}")
    return FAMILIES[arch]


def field_of(m: ModelConfig, ours: str):
    """One of our model fields a family's MoE keys name: `d_ff` (each expert's hidden size) is the
    model's own, the others are model.moe's."""
    return m.d_ff if ours == "d_ff" else getattr(m.moe, ours)


def misfits(f: Family, m: ModelConfig) -> list[str]:
    """What of our model config family `f` cannot hold ([] if it holds it all)."""
    out = [f"qkv_bias={m.qkv_bias}"] if m.qkv_bias != f.qkv_bias else []
    out += [f"qk_norm={m.qk_norm}"] if m.qk_norm != f.qk_norm else []
    out += [f"sliding_window={m.sliding_window}"] if m.sliding_window and f.window == "never" else []
    out += [f"{k}={getattr(m, k)!r}" for k in TRAIT_DEFAULTS if getattr(m, k) != f.trait(k)]
    out += [f"{k}={getattr(m, k)}" for k in EXTRAS if getattr(m, k) is not None and k not in f.extras]
    out += [f"layer_pattern={list(m.layer_pattern)}"] if m.layer_pattern and f.window != "layer_types" \
        and not f.llama4 else []
    out += [f"mla={m.mla}"] if (m.mla is not None) != f.mla else []
    out += [f"linear_attention={m.linear_attention}"] if (m.linear_attention is not None) != f.linear else []
    out += [f"rotary_fraction={m.rotary_fraction}"] if m.rotary_fraction != 1.0 and not f.linear else []
    out += [f"{k}={getattr(m, k)}" for k in LLAMA4 if getattr(m, k) not in (None, False) and not f.llama4]
    e = m.moe
    if (e.n_experts > 1) != (f.moe is not None):
        return [*out, f"n_experts={e.n_experts}"]
    if f.moe is not None:
        out += [f"{k}={field_of(m, k)}" for k, v in f.moe.fixed.items() if field_of(m, k) != v]
        out += [f"{k}={getattr(e, k)}" for k in ROUTING if k not in (*f.moe.keys, *f.moe.fixed, *f.moe.derived)
                and getattr(e, k) != getattr(MoeConfig(), k)]
        plain = not e.shared_expert_gate and e.shared_expert_d_ff in (None, e.n_shared_experts * m.d_ff)
        shared_ok = (e.n_shared_experts == 0 or (e.n_shared_experts == 1 and e.shared_expert_gate)
                     if f.moe.shared_expert else e.n_shared_experts == 0 or plain if f.moe.shared == "plain"
                     else e.n_shared_experts == 0)
        out += [] if shared_ok else [f"n_shared_experts={e.n_shared_experts} (gate {e.shared_expert_gate})"]
    return out


def family_for(m: ModelConfig) -> Family:
    """The first family (in FAMILIES' order) that holds our model config; ConfigError if none does."""
    for f in FAMILIES.values():
        if not misfits(f, m):
            return f
    raise ConfigError("this model config has no Hugging Face family: " + "; ".join(
        f"{f.architecture} cannot hold {', '.join(misfits(f, m))}" for f in FAMILIES.values()))
