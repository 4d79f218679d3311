"""Model registry. A model is one module here exposing a class built as
`cls(model_cfg, rngs=..., constrain=..., quantization="none")` with `embed(tokens_bt) -> x_btd`, stacked `blocks`
(leading logical axis `layers`, each block `block(x_btd, segment_ids_bt=None, positions_bt=None) -> x_btd`;
None means one document per row at positions 0..T-1), `head(x_btd) -> logits_btv` and
`flops_per_token(model_cfg, n_params, seq_len)` (training FLOPs, for MFU and the planner).
A block may return `(x_btd, aux)`, aux a dict of scalar auxiliary losses (an MoE router's), which
the trainer adds to the objective. Models name logical axes only; `constrain(x, names)` is
handed in by the trainer, with `constrain.size(name)` (ways a logical axis is split) and
`constrain.shard_map(fn, in_names, out_names)` (fn(shard, *local arrays) per device).
`quantization` (none / int8 / fp8, the trainer's train.quantization) is how the blocks' matmuls
run (`dense(..., quantization=...)`, models/quant.py); it changes no parameter.
A model class also says which of its weights LoRA can adapt: `adaptable(model_cfg)`.

The building blocks models share (parameters with logical names, the layer scan, matmuls, embedding
lookups) are in models/layers.py; what a model may ask of the trainer (`Constraint`, `Collectives`
and their do-nothing versions) in models/contract.py."""

from __future__ import annotations

import importlib

MODELS = {"gpt": "models.gpt:Gpt", "mlp": "models.mlp:Mlp",
          **{family: "models.gpt:Gpt" for family in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe",
                                                     "qwen3_moe", "olmo2", "gemma2", "gemma3", "deepseek_v3",
                                                     "gpt_oss")},
          "olmo3": "models.gpt:Gpt", "llama4_text": "models.gpt:Gpt",
          "qwen3_next": "models.qwen3_next:Qwen3Next"}
"""model.name -> class. The Hugging Face families are names of the one decoder `gpt` (import-hf writes the
family it read, so the run says what it trains); their differences are config fields."""


class UnknownModel(ValueError):
    """`get` was asked for a name not in MODELS (the trainer turns it into its config error)."""


LORA_A, LORA_B = "_lora_a", "_lora_b"
"""Name suffixes of a LoRA adapter's factors: block weight `w` is adapted by `w_lora_a` (A) and `w_lora_b` (B)."""


def is_adapter(path) -> bool:
    """Whether a parameter path leads to a LoRA adapter factor. `path`: dict keys (strings), or a
    jax key path (`jax.tree_util.tree_map_with_path`'s DictKey / GetAttrKey entries)."""
    return any(str(getattr(k, "key", getattr(k, "name", k))).endswith((LORA_A, LORA_B)) for k in path)


def adapted_weights(model_cfg) -> tuple[str, ...]:
    """The weights `model_cfg.lora` adapts, by parameter name (Hugging Face module names translated
    through the model class's `adaptable(model_cfg)`); () when lora.rank is 0."""
    if model_cfg.lora.rank == 0:
        return ()
    by_hf = {hf_name: name for name, hf_name in get(model_cfg.name).adaptable(model_cfg).items()}
    return tuple(by_hf.get(t, t) for t in model_cfg.lora.targets)


def get(name: str):
    if name not in MODELS:
        raise UnknownModel(f"model.name: unknown model '{name}'; known: {', '.join(MODELS)}")
    module, cls = MODELS[name].split(":")
    return getattr(importlib.import_module(module), cls)
