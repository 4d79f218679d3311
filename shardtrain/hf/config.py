"""An HF config.json <-> our ModelConfig, each family's differences read from hf/families.py.

`model_config` reads either rope form (top-level rope_theta / rope_scaling, or transformers 5's
rope_parameters, Gemma 3's and OLMo 3's per layer type; linear, llama3, yarn, dynamic) and refuses what
the one decoder of models/gpt.py cannot compute (another activation, an o_proj bias outside gpt-oss, partial
rotary outside Qwen3-Next, a mix of windowed and full layers outside the layer_types families, dense layers
between MoE layers outside DeepSeek's and Llama 4's, bidirectional attention).
`hf_config` writes the config.json transformers loads: the imported one updated, or a fresh one for
the family that holds the model config.
"""

from __future__ import annotations

import dataclasses

from shardtrain.config import ConfigError, LinearAttentionConfig, MlaConfig, ModelConfig, MoeConfig, RopeScalingConfig
from shardtrain.hf.families import FAMILIES, TRAIT_DEFAULTS, Family, Moe, family_for, family_of, field_of, misfits

ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
"""Our model.activation -> transformers' name of it."""
LAYER_KINDS = {"sliding_attention": "local", "full_attention": "global"}
"""transformers' layer_types -> our layer_pattern kinds."""


def model_config(hf: dict, where: str = "config.json") -> ModelConfig:
    """Our model config for an HF config.json."""
    family = family_of(hf, where)
    act = ACTIVATIONS[family.trait("activation")]
    partial = [] if family.linear else [("partial_rotary_factor", 1.0)]
    for key, ok in [(family.act_key, act), ("mlp_bias", False), *partial, ("use_bidirectional_attention", False)]:
        if (hf.get(key) or ok) != ok:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {ok!r})")
    if hf.get("quantization_config"):  # DeepSeek-V3's own checkpoint: fp8 blocks with scales beside them
        method = hf["quantization_config"].get("quant_method") if isinstance(hf["quantization_config"], dict) else None
        if not (method == "mxfp4" and family.moe is not None and family.moe.fused):  # gpt-oss's: hf/mxfp4.py
            raise ConfigError(f"{where}: quantization_config (quant_method {method!r}) is not supported; "
                              "dequantize the weights to bfloat16 first")
    if hf.get("attention_bias") and not family.qkv_bias:
        raise ConfigError(f"{where}: attention_bias=true (an o_proj bias) is not supported")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")) and family.rope:  # transformers' default
        hf = {**hf, "rope_parameters": {"rope_theta": hf.get("rope_theta", 10000.0), **family.rope}}
    theta, rope_scaling, local_theta = rope(hf, where, family)
    head_dim = hf.get("head_dim") or d // h
    window, pattern = sliding_window(hf, family, where)
    fields = dict(sliding_window=window, layer_pattern=pattern,
        name=family.model_type, vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=h,
        n_kv_heads=hf.get("num_key_value_heads") or h, d_ff=hf["intermediate_size"], rope_theta=theta,
        rope_scaling=rope_scaling, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family.window == "layer_types")),  # Gemma: tied by default
        head_dim=None if head_dim * h == d else head_dim, qkv_bias=family.qkv_bias, qk_norm=family.qk_norm,
        **{k: family.trait(k) for k in TRAIT_DEFAULTS}, **extras(hf, family, local_theta, where))
    if family.mla:
        fields.update(mla_fields(hf, where))
    fields.update(moe_fields(hf, family, where))
    if family.llama4:
        fields.update(llama4_fields(hf, fields["moe"], where))
    if family.linear:
        fields.update(linear_fields(hf, where))
    return ModelConfig(**fields)


LINEAR_KEYS = {"key_heads": "linear_num_key_heads", "value_heads": "linear_num_value_heads",
               "key_head_dim": "linear_key_head_dim", "value_head_dim": "linear_value_head_dim",
               "conv_kernel": "linear_conv_kernel_dim", "full_attention_interval": "full_attention_interval"}
"""Our model.linear_attention fields -> Qwen3-Next's config.json keys."""


def linear_fields(hf: dict, where: str) -> dict:
    """Qwen3-Next's fields: the DeltaNet layers' shapes, the groups of layer_types (interval - 1
    linear_attention layers, then a full_attention one), the attention layers' rotary fraction."""
    defaults = LinearAttentionConfig()
    given = {ours: int(hf.get(key) or getattr(defaults, ours)) for ours, key in LINEAR_KEYS.items()}
    n, interval = hf["num_hidden_layers"], given["full_attention_interval"]
    types = linear_layer_types(n, interval)
    if (hf.get("layer_types") or types) != types:
        raise ConfigError(f"{where}: layer_types {hf['layer_types']} not supported; supported: groups of "
                          f"{interval - 1} linear_attention layers then a full_attention one (full_attention_interval "
                          f"{interval}) over all {n} layers")
    fraction = hf.get("partial_rotary_factor") or (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return dict(linear_attention=LinearAttentionConfig(**given), rotary_fraction=float(fraction))


def linear_layer_types(n: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def linear_keys(m: ModelConfig, out: dict) -> dict:
    """Qwen3-Next's keys of config.json (linear_fields' inverse); `out`: the config.json written so far."""
    a = m.linear_attention
    new = {key: getattr(a, ours) for ours, key in LINEAR_KEYS.items()}
    new["layer_types"] = linear_layer_types(m.n_layers, a.full_attention_interval)
    new["rope_parameters"] = {**out["rope_parameters"], "partial_rotary_factor": m.rotary_fraction}
    if "partial_rotary_factor" in out:
        new["partial_rotary_factor"] = m.rotary_fraction
    return new


def llama4_fields(hf: dict, moe: MoeConfig, where: str) -> dict:
    """Llama 4's fields: rotary layers attend in chunks (local), the NoPE ones (every
    no_rope_layer_interval-th) to everything with a temperature (global); dense layers (not in
    moe_layers) of intermediate_size_mlp among the MoE ones, whose shared expert has the experts' size."""
    n = hf["num_hidden_layers"]
    interval = hf.get("no_rope_layer_interval", 4)
    rotary = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    step = hf.get("interleave_moe_layer_step", 1)
    moe_layers = hf.get("moe_layers")
    moe_layers = list(range(step - 1, n, step)) if moe_layers is None else moe_layers
    chunk = hf.get("attention_chunk_size", 8192)
    types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rotary]
    if (hf.get("layer_types") or types) != types or chunk is None or len(rotary) != n:
        raise ConfigError(f"{where}: layer_types {hf.get('layer_types')} / attention_chunk_size {chunk} / "
                          f"no_rope_layers {rotary}: only chunked rotary layers and full NoPE layers are supported")
    kinds = ["local" if r else "global" for r in rotary]
    g = next(g for g in range(1, n + 1) if all(kinds[i] == kinds[i % g] for i in range(n)))
    tuning = hf.get("attn_temperature_tuning", True)
    return dict(layer_pattern=tuple(kinds[:g]), attention_chunk=int(chunk), global_nope="global" in kinds,
                attn_temperature=float(hf.get("attn_scale", 0.1)) if tuning else None,
                attn_temperature_floor=int(hf.get("floor_scale", 8192)), qk_l2_norm=bool(hf.get("use_qk_norm", True)),
                moe=dataclasses.replace(moe, dense_layers=tuple(i for i in range(n) if i not in moe_layers),
                                        dense_d_ff=hf.get("intermediate_size_mlp", 16384)))


def llama4_keys(m: ModelConfig) -> dict:
    """The Llama 4 keys of config.json (llama4_fields' inverse)."""
    kinds = [m.layer_pattern[i % len(m.layer_pattern)] if m.layer_pattern else "local" for i in range(m.n_layers)]
    return {"no_rope_layers": [int(k == "local" or not m.global_nope) for k in kinds],
            "layer_types": ["chunked_attention" if k == "local" else "full_attention" for k in kinds],
            "attention_chunk_size": m.attention_chunk, "attn_temperature_tuning": m.attn_temperature is not None,
            "attn_scale": m.attn_temperature or 0.1, "floor_scale": m.attn_temperature_floor,
            "use_qk_norm": m.qk_l2_norm,
            "moe_layers": [i for i in range(m.n_layers) if i not in m.moe.dense_layers],
            "intermediate_size_mlp": m.moe.dense_d_ff or m.d_ff}


def mla_fields(hf: dict, where: str) -> dict:
    """Our mla (and n_kv_heads = n_heads, no head_dim) for a DeepSeek config.json."""
    if not hf.get("rope_interleave", True):
        raise ConfigError(f"{where}: rope_interleave=false is not supported (only true)")
    if (hf.get("num_key_value_heads") or hf["num_attention_heads"]) != hf["num_attention_heads"]:
        raise ConfigError(f"{where}: num_key_value_heads={hf['num_key_value_heads']} is not supported "
                          f"(only num_attention_heads={hf['num_attention_heads']})")
    return dict(n_kv_heads=hf["num_attention_heads"], head_dim=None, mla=MlaConfig(
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"]))


def extras(hf: dict, family: Family, local_theta: float | None, where: str) -> dict:
    """The family's optional fields (Family.extras) from config.json: Gemma's attention scale and soft caps."""
    scalar = hf.get("query_pre_attn_scalar")
    if scalar is not None and float(scalar) != int(scalar):  # transformers' is an int; never round one
        raise ConfigError(f"{where}: query_pre_attn_scalar={scalar!r} is not supported (only a whole number)")
    keys = {"query_pre_attn_scalar": ("query_pre_attn_scalar", int), "attn_softcap": ("attn_logit_softcapping", float),
            "final_softcap": ("final_logit_softcapping", float)}
    out = {ours: None if hf.get(key) is None else kind(hf[key])
           for ours, (key, kind) in keys.items() if ours in family.extras}
    if "rope_local_theta" in family.extras:
        out["rope_local_theta"] = local_theta
    return out


def rope(hf: dict, where: str, family: Family) -> tuple[float, RopeScalingConfig | None, float | None]:
    """(rope_theta, rope scaling or None, the local layers' rope_theta or None) of an HF config.json.
    Gemma 3 and OLMo 3 rotate their local (sliding_attention) layers by a base of their own, without
    scaling: rope_parameters per layer type (transformers 5), or the family's key (Gemma 3's
    rope_local_base_freq) or default (Family.local_theta)."""
    params = hf.get("rope_parameters") or {}
    local = None
    if "full_attention" in params:  # per layer type
        params, local_params = params["full_attention"] or {}, params.get("sliding_attention") or {}
        if local_params.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope type {local_params['rope_type']!r} of the sliding_attention layers is "
                              "not supported; supported: default")
        local = local_params.get("rope_theta")
    if local is None:
        local = hf.get(family.local_theta_key, family.local_theta)
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return float(theta), None, float(local)
    return float(theta), rope_scaling(scaling, kind, hf, where), float(local)


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
"""The rope types we read (transformers' rope_type; `dynamic` only within its max_position_embeddings)."""


def rope_scaling(scaling: dict, kind: str, hf: dict, where: str) -> RopeScalingConfig:
    """Our rope_scaling for config.json's rope_scaling / rope_parameters of type `kind`, with the
    defaults transformers' rope init functions take for the keys it lacks."""
    fields = {f.name for f in dataclasses.fields(RopeScalingConfig)} - {"type"}
    given = {k: v for k, v in scaling.items() if k in fields and v is not None}
    if kind == "dynamic":  # transformers rescales past max_position_embeddings
        given["original_max_position_embeddings"] = hf.get("max_position_embeddings", 2048)
    if kind == "yarn":
        if "original_max_position_embeddings" not in given:
            raise ConfigError(f"{where}: rope type 'yarn' needs original_max_position_embeddings")
        if "factor" not in given:  # DeepSeek's convention: the context's growth
            given["factor"] = hf["max_position_embeddings"] / given["original_max_position_embeddings"]
        given.update({k: given.get(k) or v for k, v in (("beta_fast", 32.0), ("beta_slow", 1.0))})
    return RopeScalingConfig(type=kind, **given)


def moe_fields(hf: dict, family: Family, where: str) -> dict:
    """Our model fields for a mixture-of-experts config.json: `moe` (and d_ff, each expert's hidden
    size, where the family names it); {} for a dense family."""
    moe = family.moe
    if moe is None:
        return {}
    if moe.sparse_step and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
        raise ConfigError(f"{where}: decoder_sparse_step={hf.get('decoder_sparse_step')} / mlp_only_layers="
                          f"{hf.get('mlp_only_layers')}: dense layers between MoE layers are not supported "
                          "(only decoder_sparse_step=1, mlp_only_layers=[])")
    out = dict(moe.fixed)
    for ours, keys in moe.keys.items():
        key = next((k for k in keys if hf.get(k) is not None), None)
        if key is None and ours not in moe.defaults:
            raise ConfigError(f"{where}: {' or '.join(keys)} is missing ({family.architecture} needs it)")
        default = moe.defaults.get(ours)
        out[ours] = default if key is None else hf[key] if default is None else type(default)(hf[key])
    if moe.shared_expert:
        shared = hf.get("shared_expert_intermediate_size", 0)
        out.update(n_shared_experts=1 if shared else 0, shared_expert_d_ff=shared or None,
                   shared_expert_gate=bool(shared))
    d_ff = {"d_ff": out.pop("d_ff")} if "d_ff" in out else {}
    return {**d_ff, "moe": MoeConfig(**out)}


def sliding_window(hf: dict, family: Family, where: str) -> tuple[int | None, tuple[str, ...]]:
    """(the window, our layer_pattern) as transformers decides them (families.Family.window). Outside
    the Gemma families a mix of windowed and full layers is refused (one window for all our layers)."""
    if family.window == "never":
        return None, ()
    if family.window == "layer_types":
        return hf.get("sliding_window"), layer_pattern(hf, family, where)
    always = family.window == "always"
    window = hf.get("sliding_window")
    if not always and not hf.get("use_sliding_window", False):
        window = None
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        first = 0 if always else hf.get("max_window_layers", 28)
        types = ["sliding_attention" if window and i >= first else "full_attention" for i in range(n)]
    windowed = sum(t == "sliding_attention" for t in types)
    if 0 < windowed < n:
        raise ConfigError(f"{where}: {windowed} of {n} layers use sliding_window={window} and the others full "
                          "attention (max_window_layers / layer_types); only one kind for all layers is supported")
    return (int(window) if windowed and window else None), ()


def layer_pattern(hf: dict, family: Family, where: str) -> tuple[str, ...]:
    """Our layer_pattern for config.json's layer_types (or its default, `sliding_window_pattern`):
    their shortest repeating group, as local / global kinds."""
    n = hf["num_hidden_layers"]
    every = hf.get("sliding_window_pattern") or family.pattern
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                      for i in range(n)]
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown or len(types) != n:
        raise ConfigError(f"{where}: layer_types {unknown or types} not supported; supported: one of "
                          f"{', '.join(LAYER_KINDS)} for each of the {n} layers")
    g = next(g for g in range(1, n + 1) if all(types[i] == types[i % g] for i in range(n)))
    if "sliding_attention" in types and not hf.get("sliding_window"):
        raise ConfigError(f"{where}: layer_types has sliding_attention layers but sliding_window is "
                          f"{hf.get('sliding_window')}")
    return tuple(LAYER_KINDS[t] for t in types[:g])


# ----------------------------------------------------------------------------- ours -> config.json


def export_family(m: ModelConfig, base: dict | None) -> Family:
    """The family to write: the imported model's (`base`, its config.json), which must still hold
    the model config, or else the one model.name names if it holds it, or else the first that does."""
    if base is None:
        named = [f for f in FAMILIES.values() if f.model_type == m.name and not misfits(f, m)]
        return named[0] if named else family_for(m)
    family = family_of(base, "the imported model's config.json")
    bad = misfits(family, m)
    if bad:
        raise ConfigError(f"export-hf: the weights were imported from a {family.architecture}, which cannot "
                          f"hold this model config's {', '.join(bad)}")
    return family


def hf_config(m: ModelConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """config.json for our model config: `base` (the imported model's) updated, or a fresh one."""
    family = export_family(m, base)
    out = dict(base) if base else {"architectures": [family.architecture], "model_type": family.model_type,
                                   "max_position_embeddings": 4096, "attention_bias": False}
    out[family.act_key] = ACTIVATIONS[m.activation]
    rope = rope_parameters(m)
    out.update(vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.n_layers,
               num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, intermediate_size=m.d_ff,
               head_dim=m.head_size, rms_norm_eps=m.rms_norm_eps,
               tie_word_embeddings=m.tie_embeddings, rope_theta=m.rope_theta, rope_parameters=rope, dtype=dtype)
    if family.moe is not None:
        out.update(moe_keys(m, family.moe, out, base))
    if family.llama4:
        out.update(llama4_keys(m))
    if family.linear:
        out.update(linear_keys(m, out))
    if family.mla:
        a = m.mla
        out.update(q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                   qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, rope_interleave=True,
                   head_dim=a.qk_rope_head_dim, qk_head_dim=a.qk_nope_head_dim + a.qk_rope_head_dim)
    out.pop("torch_dtype", None)
    out.pop("quantization_config", None)  # gpt-oss's MXFP4 experts were dequantized on import
    windowed = m.sliding_window is not None
    if family.window == "always":
        out["sliding_window"] = m.sliding_window
    elif family.window == "use_sliding_window" and (windowed or out.get("use_sliding_window")):
        # Qwen: windowed on every layer, or on none
        out.update(use_sliding_window=windowed, max_window_layers=0 if windowed else m.n_layers)
        if windowed:
            out["sliding_window"] = m.sliding_window
        if "layer_types" in out:
            out["layer_types"] = ["sliding_attention" if windowed else "full_attention"] * m.n_layers
    if family.window == "layer_types":
        out.update(gemma_keys(m, family, rope))
    if m.rope_scaling is not None:
        out["rope_scaling"] = rope
    else:
        out.pop("rope_scaling", None)
    if base is not None and same_rope(base, m):  # the rope keys as the imported config.json wrote them
        for key in ("rope_theta", "rope_scaling", "rope_parameters"):
            out.pop(key, None)
            out.update({key: base[key]} if key in base else {})
    return out


def same_rope(hf: dict, m: ModelConfig) -> bool:
    """Whether config.json `hf` rotates as our model config does."""
    theta, scaling, local = rope(hf, "config.json", family_of(hf, "config.json"))
    return (theta, scaling) == (m.rope_theta, m.rope_scaling) and m.rope_local_theta in (None, local)


def gemma_keys(m: ModelConfig, family: Family, rope: dict) -> dict:
    """The keys of a config.json with layer_types (Gemma, OLMo 3, gpt-oss): layer kinds, window, (Gemma)
    attention scale and soft caps, and (Gemma 3, OLMo 3) rope_parameters per layer type."""
    kinds = m.layer_pattern or (("local",) if m.sliding_window else ("global",))
    names = {kind: name for name, kind in LAYER_KINDS.items()}
    out = {"layer_types": [names[kinds[i % len(kinds)]] for i in range(m.n_layers)], "sliding_window": m.sliding_window}
    if "query_pre_attn_scalar" in family.extras:
        out.update(query_pre_attn_scalar=m.query_pre_attn_scalar or m.head_size,
                   attn_logit_softcapping=m.attn_softcap, final_logit_softcapping=m.final_softcap)
    if "rope_local_theta" in family.extras:
        local = m.rope_theta if m.rope_local_theta is None else m.rope_local_theta
        sliding = {"rope_type": "default", "rope_theta": local}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": sliding}
        if family.local_theta_key:
            out[family.local_theta_key] = local
    return out


def rope_parameters(m: ModelConfig) -> dict:
    """transformers 5's rope_parameters (also written as rope_scaling when there is scaling)."""
    s = m.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": m.rope_theta}
    keys = {"linear": ["factor"], "dynamic": ["factor"],
            "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
            "yarn": ["factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                     "attention_factor", "mscale", "mscale_all_dim"]}[s.type]
    return {"rope_type": s.type, "rope_theta": m.rope_theta,
            **{k: getattr(s, k) for k in keys if getattr(s, k) is not None}}


def moe_keys(m: ModelConfig, moe: Moe, out: dict, base: dict | None) -> dict:
    """The MoE keys of config.json (`out`: the config.json written so far)."""
    new = {key: field_of(m, ours) for ours, keys in moe.keys.items()
           for i, key in enumerate(keys) if i == 0 or key in out}
    if moe.sparse_step:
        new.update(decoder_sparse_step=1, mlp_only_layers=[])
    if "dense_d_ff" in moe.keys:  # the first dense layers' MLP (DeepSeek)
        new["intermediate_size"] = m.moe.dense_d_ff or m.d_ff
    elif "d_ff" in moe.keys:  # d_ff is each expert's size; intermediate_size (a dense MLP's) stays
        new["intermediate_size"] = (base or {}).get("intermediate_size", m.d_ff)
    if moe.shared_expert and m.moe.n_shared_experts:
        new["shared_expert_intermediate_size"] = m.moe.shared_expert_d_ff or m.d_ff
    return new
