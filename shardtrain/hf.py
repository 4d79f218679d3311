"""Hugging Face checkpoints <-> our parameter tree: configs, names, layouts, tensor by tensor.

Supported: LlamaForCausalLM (Llama 2/3/3.1/3.2), MistralForCausalLM, Qwen2ForCausalLM (Qwen2 /
Qwen2.5), Qwen3ForCausalLM and the mixtures of experts MixtralForCausalLM, Qwen2MoeForCausalLM
and Qwen3MoeForCausalLM, all as configs of the one decoder in models/gpt.py.

Layouts (ours <- HF, per layer i; our block parameters are stacked on a leading `layers` axis):
  embedding_vd (V, D)     <- model.embed_tokens.weight (V, D)
  blocks/wq_dhe (D, H, E) <- model.layers.i.self_attn.q_proj.weight (H*E, D), transposed
  blocks/wk_dke, wv_dke   <- k_proj / v_proj.weight (K*E, D), transposed
  blocks/wo_hed (H, E, D) <- o_proj.weight (D, H*E), transposed
  blocks/bq_he, bk_ke, bv_ke <- q/k/v_proj.bias (Qwen2);  blocks/q_norm, k_norm <- q/k_norm.weight (Qwen3)
  blocks/w_gate_df, w_up_df (D, F) <- gate_proj / up_proj.weight (F, D);  w_down_fd <- down_proj (D, F)
  blocks/attn_norm, mlp_norm <- input_layernorm, post_attention_layernorm;  final_norm <- model.norm
  MoE blocks (per expert j; MLP = block_sparse_moe (Mixtral) or mlp (Qwen-MoE)):
  blocks/moe/router_de (D, E) <- MLP.gate.weight (E, D), transposed
  blocks/moe/w_gate_edf, w_up_edf (E, D, F) <- MLP.experts.j.w1 / w3 (Mixtral), gate_proj / up_proj (Qwen) (F, D)
  blocks/moe/w_down_efd (E, F, D) <- MLP.experts.j.w2 / down_proj (D, F)
  blocks/moe/shared_w_gate_df, shared_w_up_df, shared_w_down_fd <- mlp.shared_expert.* (Qwen2-MoE)
  blocks/moe/shared_expert_gate_d1 (D, 1) <- mlp.shared_expert_gate.weight (1, D)
  unembed_dv (D, V)       <- lm_head.weight (V, D), absent when the embeddings are tied
The rotary layout needs no permutation: models/gpt.py rotates halves exactly as HF does.

Reading memory-maps the safetensors files and fills each device's shard of a parameter from
the one HF tensor it needs (jax.make_array_from_callback), so host memory stays near one
tensor; writing fetches one layer's tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from shardtrain import safetensors_io
from shardtrain.config import ConfigError, ModelConfig, MoeConfig, RopeScalingConfig

SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral",
             "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
QWEN_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")
INDEX = "model.safetensors.index.json"


def is_hf_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir}: no config.json; expected a Hugging Face model directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def safetensors_files(hf_dir: str | Path) -> list[Path]:
    """The weight files, from the index when there is one; a missing shard is an error here."""
    d = Path(hf_dir)
    if (d / INDEX).is_file():
        names = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ConfigError(f"{d / INDEX} lists {len(names)} shards but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing from {d}")
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{d}: no *.safetensors weights (only safetensors checkpoints are read; "
                          "convert .bin files with transformers' save_pretrained(safe_serialization=True))")
    return files


def architecture(hf: dict, where: str) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        raise ConfigError(f"{where}: architecture {arch or hf.get('model_type')!r} is not supported; "
                          f"supported: {', '.join(SUPPORTED)}")
    return arch


def model_config(hf: dict, where: str = "config.json") -> ModelConfig:
    """Our model config for an HF config.json (either rope form: top-level rope_theta /
    rope_scaling, or transformers 5's rope_parameters)."""
    arch = architecture(hf, where)
    for key, ok in [("hidden_act", "silu"), ("mlp_bias", False), ("partial_rotary_factor", 1.0)]:
        if hf.get(key, ok) != ok:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {ok!r})")
    if hf.get("attention_bias") and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        raise ConfigError(f"{where}: attention_bias=true (an o_proj bias) is not supported")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ("default", "linear", "llama3"):
        raise ConfigError(f"{where}: rope type {kind!r} is not supported; supported: default, linear, llama3")
    rope_scaling = None
    if kind != "default":
        fields = {f.name for f in dataclasses.fields(RopeScalingConfig)} - {"type"}
        rope_scaling = RopeScalingConfig(type=kind, **{k: v for k, v in scaling.items() if k in fields})
    head_dim = hf.get("head_dim") or d // h
    fields = dict(sliding_window=sliding_window(hf, arch, where),
        name="gpt", vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=h,
        n_kv_heads=hf.get("num_key_value_heads") or h, d_ff=hf["intermediate_size"], rope_theta=float(theta),
        rope_scaling=rope_scaling, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=None if head_dim * h == d else head_dim,
        qkv_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"))
    return ModelConfig(**{**fields, **moe_fields(hf, arch, where)})


def moe_fields(hf: dict, arch: str, where: str) -> dict:
    """Our model fields for a Mixtral / Qwen-MoE config.json: `moe` (and Qwen-MoE's per-expert
    d_ff); {} for a dense family."""
    if arch == "MixtralForCausalLM":
        return dict(moe=MoeConfig(n_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                                  router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01))))
    if arch not in QWEN_MOE:
        return {}
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError(f"{where}: decoder_sparse_step={hf.get('decoder_sparse_step')} / mlp_only_layers="
                          f"{hf.get('mlp_only_layers')}: dense layers between MoE layers are not supported "
                          "(only decoder_sparse_step=1, mlp_only_layers=[])")
    shared = hf.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
    return dict(d_ff=hf["moe_intermediate_size"], moe=MoeConfig(
        n_experts=hf.get("num_experts") or hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)), n_shared_experts=1 if shared else 0,
        shared_expert_d_ff=shared or None, shared_expert_gate=bool(shared),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001))))


def moe_architecture(m: ModelConfig) -> str:
    """The HF MoE family that can hold our MoE config (ConfigError if none can)."""
    if m.qk_norm and not m.moe.n_shared_experts:
        return "Qwen3MoeForCausalLM"
    if m.moe.n_shared_experts == 1 and m.moe.shared_expert_gate:
        return "Qwen2MoeForCausalLM"
    if not (m.moe.n_shared_experts or m.qkv_bias or m.qk_norm) and m.moe.norm_topk_prob:
        return "MixtralForCausalLM"
    raise ConfigError("this MoE config has no Hugging Face family (Mixtral: no shared experts, norm_topk_prob; "
                      "Qwen2-MoE: one gated shared expert; Qwen3-MoE: qk_norm, no shared experts)")


def sliding_window(hf: dict, arch: str, where: str) -> int | None:
    """The window every layer uses, as transformers decides it: Mistral's (and Mixtral's)
    `sliding_window`; Qwen2 / Qwen3's when use_sliding_window, on layers from max_window_layers on
    (or as `layer_types` says). A mix of windowed and full layers is refused (one window for all
    our layers)."""
    if arch == "LlamaForCausalLM":
        return None
    always = arch in ("MistralForCausalLM", "MixtralForCausalLM")
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
    return int(window) if windowed and window else None


def hf_config(m: ModelConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """config.json for our model config: `base` (the imported model's) updated, or a fresh one."""
    arch = ("Qwen3ForCausalLM" if m.qk_norm else "Qwen2ForCausalLM" if m.qkv_bias
            else "MistralForCausalLM" if m.sliding_window else "LlamaForCausalLM")
    arch = moe_architecture(m) if m.moe.n_experts > 1 else arch
    out = dict(base) if base else {"architectures": [arch], "model_type": SUPPORTED[arch], "hidden_act": "silu",
                                   "max_position_embeddings": 4096, "attention_bias": False}
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        s = m.rope_scaling
        rope = {**dataclasses.asdict(s), "rope_type": s.type, "rope_theta": m.rope_theta}
        rope.pop("type")
        if s.type == "linear":
            rope = {"rope_type": "linear", "factor": s.factor, "rope_theta": m.rope_theta}
    out.update(vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.n_layers,
               num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, intermediate_size=m.d_ff,
               head_dim=m.head_size, rms_norm_eps=m.rms_norm_eps,
               tie_word_embeddings=m.tie_embeddings, rope_theta=m.rope_theta, rope_parameters=rope, dtype=dtype)
    if m.moe.n_experts > 1:
        out["router_aux_loss_coef"] = m.moe.router_aux_loss_coef
    if arch == "MixtralForCausalLM":
        out.update(num_local_experts=m.moe.n_experts, num_experts_per_tok=m.moe.experts_per_token)
    elif arch in QWEN_MOE:
        if "num_local_experts" in out:  # transformers 5 writes Qwen3-MoE's num_experts under this name
            out["num_local_experts"] = m.moe.n_experts
        out.update(num_experts=m.moe.n_experts, num_experts_per_tok=m.moe.experts_per_token,
                   moe_intermediate_size=m.d_ff, norm_topk_prob=m.moe.norm_topk_prob, decoder_sparse_step=1,
                   mlp_only_layers=[], intermediate_size=(base or {}).get("intermediate_size", m.d_ff))
        if m.moe.n_shared_experts:
            out["shared_expert_intermediate_size"] = m.moe.shared_expert_d_ff or m.d_ff
    out.pop("torch_dtype", None)
    windowed = m.sliding_window is not None
    if (out.get("architectures") or [arch])[0] in ("MistralForCausalLM", "MixtralForCausalLM"):
        out["sliding_window"] = m.sliding_window
    elif windowed or out.get("use_sliding_window"):  # Qwen: windowed on every layer, or on none
        out.update(use_sliding_window=windowed, max_window_layers=0 if windowed else m.n_layers)
        if windowed:
            out["sliding_window"] = m.sliding_window
        if "layer_types" in out:
            out["layer_types"] = ["sliding_attention" if windowed else "full_attention"] * m.n_layers
    if m.rope_scaling is not None:
        out["rope_scaling"] = rope
    else:
        out.pop("rope_scaling", None)
    return out


# ----------------------------------------------------------------------------- name and layout map


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


def tensor_map(m: ModelConfig) -> list[Entry]:
    d, h, k, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size
    e = m.head_size

    def same(a):
        return a

    def tr(a):
        return a.T

    def proj(n):  # HF (n*E, D) <-> ours (D, n, E)
        return (lambda a: a.T.reshape(d, n, e)), (lambda a: a.reshape(d, n * e).T)

    def bias(n):
        return (lambda a: a.reshape(n, e)), (lambda a: a.reshape(n * e))
    layer, attn, mlp = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    entries = [
        Entry(("embedding_vd",), "model.embed_tokens.weight", (v, d), same, same),
        Entry(("blocks", "attn_norm"), layer + "input_layernorm.weight", (d,), same, same),
        Entry(("blocks", "wq_dhe"), attn + "q_proj.weight", (h * e, d), *proj(h)),
        Entry(("blocks", "wk_dke"), attn + "k_proj.weight", (k * e, d), *proj(k)),
        Entry(("blocks", "wv_dke"), attn + "v_proj.weight", (k * e, d), *proj(k)),
    ]
    if m.qkv_bias:
        entries += [Entry(("blocks", "bq_he"), attn + "q_proj.bias", (h * e,), *bias(h)),
                    Entry(("blocks", "bk_ke"), attn + "k_proj.bias", (k * e,), *bias(k)),
                    Entry(("blocks", "bv_ke"), attn + "v_proj.bias", (k * e,), *bias(k))]
    if m.qk_norm:
        entries += [Entry(("blocks", "q_norm"), attn + "q_norm.weight", (e,), same, same),
                    Entry(("blocks", "k_norm"), attn + "k_norm.weight", (e,), same, same)]
    entries += [
        Entry(("blocks", "wo_hed"), attn + "o_proj.weight", (d, h * e),
              lambda a: a.T.reshape(h, e, d), lambda a: a.reshape(h * e, d).T),
        Entry(("blocks", "mlp_norm"), layer + "post_attention_layernorm.weight", (d,), same, same),
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

    def tr(a):
        return a.T
    if moe_architecture(m) == "MixtralForCausalLM":
        mlp, (gate, up, down) = "model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")
    else:
        mlp, (gate, up, down) = "model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")
    moe = ("blocks", "moe")
    entries = [Entry((*moe, "router_de"), mlp + "gate.weight", (n, d), tr, tr),
               Entry((*moe, "w_gate_edf"), mlp + f"experts.{{j}}.{gate}.weight", (f, d), tr, tr),
               Entry((*moe, "w_up_edf"), mlp + f"experts.{{j}}.{up}.weight", (f, d), tr, tr),
               Entry((*moe, "w_down_efd"), mlp + f"experts.{{j}}.{down}.weight", (d, f), tr, tr)]
    if m.moe.n_shared_experts:
        s = m.moe.shared_expert_d_ff or m.moe.n_shared_experts * f
        entries += [Entry((*moe, "shared_w_gate_df"), mlp + "shared_expert.gate_proj.weight", (s, d), tr, tr),
                    Entry((*moe, "shared_w_up_df"), mlp + "shared_expert.up_proj.weight", (s, d), tr, tr),
                    Entry((*moe, "shared_w_down_fd"), mlp + "shared_expert.down_proj.weight", (d, s), tr, tr),
                    Entry((*moe, "shared_expert_gate_d1"), mlp + "shared_expert_gate.weight", (1, d), tr, tr)]
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


# ----------------------------------------------------------------------------- import


class Source:
    """An HF model directory, checked before any weight is read: its architecture is supported,
    no shard is missing, and every tensor our model needs is there with the expected shape."""

    def __init__(self, hf_dir: str | Path, m: ModelConfig | None = None):
        self.dir = Path(hf_dir)
        self.hf = read_config(self.dir)
        self.model = m or model_config(self.hf, str(self.dir / "config.json"))
        self.reader = safetensors_io.Reader(safetensors_files(self.dir))
        self.entries = tensor_map(self.model)
        present = set(self.reader.names())
        if self.model.tie_embeddings and "lm_head.weight" in present and m is None:
            # tie_word_embeddings absent from config.json but an lm_head is stored: it is untied
            self.model = dataclasses.replace(self.model, tie_embeddings=False)
            self.entries = tensor_map(self.model)
        bad, config = [], "config.json" if m is None else "the model config"
        for entry in self.entries:
            for name in names_of(entry, self.model):
                if name not in present:
                    bad.append(f"{name}: missing from the weights, expected shape {entry.hf_shape}")
                elif self.reader.shape(name) != entry.hf_shape:
                    bad.append(f"{name}: weights {self.reader.shape(name)}, {config} implies {entry.hf_shape}")
        if bad:
            raise ConfigError(f"{self.dir}: {config} disagrees with the weights ({len(bad)} tensors): "
                              + "; ".join(bad[:5]) + ("; ..." if len(bad) > 5 else ""))

    def dtype_name(self) -> str:
        return str(self.reader.dtype(self.entries[0].hf))

    def params(self, abstract: dict) -> dict:
        """Our parameter tree as jax arrays with the shapes, dtypes and shardings of `abstract`
        (ShapeDtypeStructs), each shard filled straight from the memory-mapped file (host
        memory: about one HF tensor)."""
        out: dict = {}
        for entry in self.entries:
            a = tree_get(abstract, entry.ours)
            tree_set(out, entry.ours, jax.make_array_from_callback(
                a.shape, a.sharding, self._filler(entry, a.shape, a.dtype)))
        return out

    def _filler(self, entry: Entry, shape, dtype):
        last: dict = {}

        def ours(i=None, j=None):  # one HF tensor in our layout, cached until the next one is asked for
            if (i, j) not in last:
                last.clear()
                last[i, j] = entry.to_ours(self.reader.get(entry.hf.format(i=i, j=j)))
            return last[i, j]

        def fill(index):
            if entry.per_expert:  # (L, E, ...): one HF tensor per layer and expert
                return np.stack([np.stack([ours(i, j)[index[2:]] for j in range(shape[1])[index[1]]])
                                 for i in range(shape[0])[index[0]]]).astype(dtype)
            if entry.layered:
                return np.stack([ours(i)[index[1:]] for i in range(shape[0])[index[0]]]).astype(dtype)
            return np.asarray(ours()[index], dtype=dtype)
        return fill


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer and generation config files, when present."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


# ----------------------------------------------------------------------------- export


def export(params: dict, m: ModelConfig, out_dir: str | Path, *, base: dict | None = None,
           dtype: str = "float32", max_shard_bytes: int = 5 * 2 ** 30, side_files: Path | None = None) -> list[Path]:
    """Writes `params` (our tree, jax or numpy arrays) as an HF model directory: config.json,
    safetensors shards (with an index when there are several), tokenizer files. One layer's
    tensor is fetched from the devices at a time. Returns the safetensors files written.

    In a run of several processes every process calls this (a tensor spread over them is
    gathered with `process_allgather`, a collective, in the same order everywhere) and process 0
    alone writes; the others stream the same bytes to os.devnull."""
    writer = jax.process_index() == 0
    out = Path(out_dir)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(safetensors_io.DTYPES[{"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[dtype]])
    specs, fetch = [], {}
    for entry in tensor_map(m):
        array = tree_get(params, entry.ours)
        for name, index in indexed_names(entry, m):
            specs.append((name, entry.hf_shape, np_dtype))
            fetch[name] = (entry, array, index)

    def produce(name):
        entry, array, index = fetch[name]
        x = array[index] if index else array
        if getattr(x, "is_fully_addressable", True):
            host = np.asarray(jax.device_get(x))
        else:  # a tensor spread over several processes: every process gets the whole of it
            from jax.experimental import multihost_utils
            host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return entry.to_hf(host.astype(np.float32)).astype(np_dtype)

    shards, size = [[]], 0
    for spec in specs:
        nbytes = int(np.prod(spec[1])) * np_dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    files = [out / ("model.safetensors" if len(shards) == 1 else f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors")
             for j in range(len(shards))]
    for path, shard in zip(files, shards):
        safetensors_io.write(path if writer else os.devnull, shard, produce, metadata={"format": "pt"})
    if not writer:
        return files
    if len(shards) > 1:
        total = sum(int(np.prod(s[1])) * np_dtype.itemsize for s in specs)
        index = {"metadata": {"total_size": total},
                 "weight_map": {s[0]: f.name for f, shard in zip(files, shards) for s in shard}}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    elif (out / INDEX).exists():
        (out / INDEX).unlink()
    if side_files is not None:
        copy_side_files(side_files, out)
    (out / "config.json").write_text(json.dumps(hf_config(m, base, dtype), indent=2) + "\n")
    return files
