"""Run configuration: typed, frozen, nested dataclasses loaded from YAML with dotted overrides.

One source of truth: every other module reads a `RunConfig`. Errors a user can cause raise
`ConfigError`, whose message names the field and the fix; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tempfile
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import yaml


class ConfigError(ValueError):
    """A mistake in user input (config, overrides, mesh, data, checkpoint). Exit code 2."""


MESH_AXES = ("data", "pipeline", "fsdp", "expert", "context", "tensor")
"""Mesh axis names, outermost (slowest, across hosts) first. `expert` and `context` sit inside
fsdp and outside tensor: their collectives (an all-to-all per MoE layer, a ring of key/value
blocks per attention layer) want the fast interconnect (ICI) but less of it than tensor's."""

AxisRule = Optional[str | tuple[str, ...]]


def mesh_axes(rule: AxisRule) -> tuple[str, ...]:
    """A rule (or a PartitionSpec entry) as a tuple of mesh axes: null -> (), "fsdp" -> ("fsdp",)."""
    return (rule,) if isinstance(rule, str) else tuple(rule or ())


@dataclass(frozen=True)
class DcnConfig:
    """Sizes of each mesh axis across slices / hosts (the slow network); the ICI sizes in `mesh`
    are per slice. The full axis size is ici x dcn. All 1 means a single slice."""

    data: int = 1
    pipeline: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh. The product of the axis sizes (x dcn) must equal the device count; one axis
    may be -1, meaning "the remaining devices"."""

    data: int = 1
    """Data parallelism: the batch is split, parameters are replicated."""
    pipeline: int = 1
    """Pipeline parallelism: the stacked layers are split into this many stages."""
    fsdp: int = 1
    """Fully sharded data parallelism (ZeRO-3): batch and parameters split, weights gathered per layer."""
    expert: int = 1
    """Expert parallelism (MoE models): the experts are split; tokens travel to their experts'
    devices with an all-to-all. Outside the MoE layers the batch is split over it too."""
    context: int = 1
    """Context (sequence) parallelism: each sequence is split into 2 x context chunks, device i
    holding chunks i and 2 context - 1 - i; attention passes key/value blocks around a ring."""
    tensor: int = 1
    """Tensor (Megatron) parallelism: attention heads and MLP hidden units split."""
    dcn: DcnConfig = field(default_factory=DcnConfig)
    """Per-axis sizes across slices/hosts for a hybrid ICI x DCN mesh."""

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) * getattr(self.dcn, a) for a in MESH_AXES}

    def device_count(self, default: int) -> int:
        """The device count this mesh asks for, or `default` when one axis is -1 (any count)."""
        sizes = self.sizes().values()
        return math.prod(sizes) if all(s > 0 for s in sizes) else default


@dataclass(frozen=True)
class RulesConfig:
    """Logical axis -> mesh axis (a name, a list of names, or null for replicated). One row per
    logical name; models use only these names, for parameters and activations alike (the
    `activation_*` rows name activation dimensions that no parameter has, so sharding them is a
    rules change, not a model edit)."""

    batch: AxisRule = ("data", "fsdp", "expert")
    """Examples of a batch. Over `expert` too: outside the MoE layers the expert devices are
    data-parallel replicas (as in MaxText and DeepSpeed-MoE), so no device repeats another's work."""
    embed: AxisRule = ("fsdp", "expert")
    """The model dimension of weights (ZeRO-3 / FSDP). Over `expert` too: outside the MoE layers the
    expert devices are data-parallel replicas, so they shard those weights as well (as MaxText does)."""
    mlp: AxisRule = "tensor"
    heads: AxisRule = "tensor"
    kv_heads: AxisRule = "tensor"
    vocab: AxisRule = "tensor"
    layers: AxisRule = "pipeline"
    seq: AxisRule = "context"
    """Sequence dimension of activations: split over `context`, attention runs as ring attention."""
    experts: AxisRule = "expert"
    """The expert dimension of MoE expert weights."""
    expert_embed: AxisRule = "fsdp"
    """The model dimension of MoE expert weights (not `expert`: their expert dimension holds it)."""
    activation_embed: AxisRule = None
    """The model dimension of activations (the residual stream x_btd); null: whole on every device."""
    activation_head_dim: AxisRule = None
    """The per-head dimension of attention activations (q, k, v)."""


@dataclass(frozen=True)
class RopeScalingConfig:
    """Rotary frequency scaling for contexts longer than pre-training (Hugging Face `rope_scaling`)."""

    type: Literal["linear", "llama3"] = "llama3"
    """`linear`: every frequency divided by `factor`; `llama3`: Llama 3.1's low/high-frequency blend."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3: the pre-training context length."""


LORA_TARGETS = {"wq_dhe": "q_proj", "wk_dke": "k_proj", "wv_dke": "v_proj", "wo_hed": "o_proj",
                "w_gate_df": "gate_proj", "w_up_df": "up_proj", "w_down_fd": "down_proj"}
"""Block weights LoRA can adapt: our parameter name -> the Hugging Face module name (either works)."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters: each target weight W is used as W + (alpha / rank) * A @ B with A
    (W's input dims, rank) and B (rank, W's output dims), sharded like W's dims; B starts at zero.
    With rank > 0 only the adapters train (the rest is frozen) and export-hf merges them into W."""

    rank: int = 0
    """Adapter rank; 0: no adapters."""
    alpha: float = 16.0
    targets: tuple[str, ...] = ("wq_dhe", "wk_dke", "wv_dke", "wo_hed")
    """Adapted block weights by parameter name (wq_dhe, w_up_df, ...) or HF module name (q_proj, up_proj, ...)."""

    def target_params(self) -> tuple[str, ...]:
        by_hf = {v: k for k, v in LORA_TARGETS.items()}
        return tuple(by_hf.get(t, t) for t in self.targets) if self.rank > 0 else ()


@dataclass(frozen=True)
class ModelConfig:
    """Model architecture. `name` picks the class from the registry in `models/`. Llama 2/3,
    Mistral, Qwen2/2.5 and Qwen3 are configs of the one decoder `gpt` (alias `llama`)."""

    name: str = "gpt"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide n_heads."""
    d_ff: int = 512
    """Hidden size of the (SwiGLU) MLP."""
    rope_theta: float = 10000.0
    attention: Literal["auto", "xla", "chunked", "splash", "cudnn"] = "auto"
    """Attention implementation (models/attention.py): `xla` materialises the T x T scores;
    `chunked` is flash-style plain XLA (long sequences anywhere); `splash` the Pallas TPU kernel;
    `cudnn` cuDNN flash attention on NVIDIA GPUs; `auto`: splash on TPU, cudnn on GPU, xla on CPU."""
    embed: Literal["gather", "one_hot"] = "gather"
    """Token embedding: `gather` rows of the table (no B x T x V intermediate); `one_hot` a one-hot
    matmul (shards cleanly over a vocab-sharded table; 2 V D FLOPs per token)."""
    rope_scaling: Optional[RopeScalingConfig] = None
    """Rotary frequency scaling (Llama 3.1+ `llama3`, or `linear`); null: none."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (Llama 1e-5, Qwen 1e-6)."""
    tie_embeddings: bool = False
    """The output projection is the transposed token embedding (Llama 3.2 1B/3B, small Qwens)."""
    head_dim: Optional[int] = None
    """Attention head size; default d_model / n_heads (Qwen3 sets its own)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2 / Qwen2.5)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before rotary (Qwen3)."""
    sliding_window: Optional[int] = None
    """Sliding-window causal attention: a token attends to itself and the W - 1 tokens before it
    (Hugging Face's `sliding_window`: Mistral, Qwen2 with use_sliding_window); null: the whole
    causal context. Every attention implementation and generation's KV cache honour it."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters for fine-tuning (off unless lora.rank > 0)."""
    n_experts: int = 0
    """Mixture of experts: experts per MoE layer (every layer's MLP; d_ff is each expert's hidden
    size); 0 or 1: a dense MLP."""
    experts_per_token: int = 2
    """MoE: experts each token is routed to (top-k, by softmax router probability)."""
    n_shared_experts: int = 0
    """MoE: experts every token also passes through (DeepSeek / Qwen-MoE style), unweighted."""
    shared_expert_d_ff: Optional[int] = None
    """MoE: hidden size of the shared experts' one SwiGLU MLP; default n_shared_experts x d_ff."""
    shared_expert_gate: bool = False
    """MoE: the shared experts' output is scaled by sigmoid(h . w), w a learned vector (Qwen2-MoE)."""
    norm_topk_prob: bool = True
    """MoE: the top-k router probabilities are renormalised to sum to 1 (Mixtral, Qwen3-MoE);
    false weights each expert by its softmax probability over all experts (Qwen2-MoE's default)."""
    capacity_factor: Optional[float] = None
    """MoE: null routes every token (dropless); a number caps each expert at capacity_factor x
    (tokens x experts_per_token / n_experts) assignments per expert shard's batch, dropping the rest."""
    router_aux_loss_coef: float = 0.01
    """MoE: weight of the load-balancing loss n_experts x sum_e (fraction of assignments to e) x
    (mean router probability of e)."""
    router_z_loss_coef: float = 0.001
    """MoE: weight of the router z-loss, the mean of logsumexp(router logits)^2 (ST-MoE)."""


@dataclass(frozen=True)
class MixtureEntry:
    """One dataset of a mixture: a `shardtrain prepare` output directory and its sampling weight."""

    path: str
    weight: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    source: Literal["text", "synthetic", "tokens"] = "text"
    """`text`: byte tokens of the files under `path`; `synthetic`: seeded learnable sequences;
    `tokens`: the shards `shardtrain prepare` wrote to `path` (or `mixture`), documents packed into
    windows with segment ids and positions."""
    path: Optional[str] = None
    """text: directory or glob of text files (default: the Python standard library's top-level .py
    files). tokens: the directory `shardtrain prepare --out` wrote: a local path or gs://BUCKET/PATH (read by
    byte range through tensorstore)."""
    seq_len: int = 128
    mixture: tuple[MixtureEntry, ...] = ()
    """tokens: several prepared directories sampled by weight instead of `path`, e.g.
    [{path: /data/web, weight: 0.7}, {path: /data/code, weight: 0.3}]."""
    verify: Literal["size", "checksum"] = "size"
    """tokens: check each shard's size against the manifest (cheap), or also its sha256 (reads
    every shard once at start)."""


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay and global-norm clipping."""

    learning_rate: float = 3e-3
    warmup_steps: int = 20
    decay_steps: Optional[int] = None
    """Cosine decay length; default: train.steps."""
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    seed: int = 0
    """All randomness (init, data order) derives from this."""
    global_batch_size: int = 32
    grad_accum_steps: int = 1
    """Micro-batches per step, accumulated inside the compiled step (same update as the full batch)."""
    remat: Literal["none", "full", "dots", "dots_no_batch", "offload"] = "none"
    """Activation recomputation policy for each layer (jax.checkpoint_policies). `offload` keeps
    each layer's input and attention output in host memory (pinned_host) and recomputes the rest:
    TPU / GPU only."""
    scan_unroll: int = 1
    """Layers per iteration of the `lax.scan` over layers: 1 keeps the compiled program and compile
    time flat in depth; n_layers unrolls it fully (sometimes faster for small models on CPU)."""
    loss_chunk: int = 512
    """Sequence positions per cross-entropy chunk: the logits (B x chunk x vocab) are computed,
    reduced and recomputed in the backward pass one chunk at a time, never for the whole sequence;
    0 or >= seq_len: one chunk."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of stored (master) weights and optimizer state."""
    log_every: int = 1
    eval_every: int = 0
    """Evaluate on the held-out split every this many steps and at the last step; 0: never."""
    eval_steps: int = 10
    """Batches (of train.global_batch_size) per evaluation, always the split's first ones."""
    compile_cache: bool = True
    """JAX persistent compilation cache under ~/.cache/shardtrain/jax."""
    profile_steps: Optional[tuple[int, int]] = None
    """[first, last] steps to trace with jax.profiler into run_dir/profile (step numbers as in
    metrics.jsonl: 1 <= first <= last <= steps; a resumed run traces the part still ahead)."""
    microbatches: Optional[int] = None
    """Pipeline micro-batches M per (accumulation) step; default: the largest M <= 4 x pipeline
    stages that divides each data replica's rows."""
    pipeline_schedule: Literal["gpipe", "circular"] = "gpipe"
    """`gpipe`: one contiguous group of layers per stage; `circular`: pipeline_repeats
    non-adjacent groups per stage (bubble (P-1)/(repeats*M+P-1), needs M >= stages)."""
    pipeline_repeats: int = 1
    """Circular schedule: groups of layers per stage (divides the bubble by this)."""
    grad_reduce_dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    """Dtype of the cross-replica gradient reduction (int8 keeps an error-feedback residual)."""
    sync: Literal["every_step", "local_sgd"] = "every_step"
    sync_every: int = 8
    """local_sgd: inner steps between outer (DiLoCo) synchronisations."""
    sync_axes: tuple[str, ...] = ("data",)
    """local_sgd: mesh axes whose replicas train independently between synchronisations."""
    outer_learning_rate: float = 1.0
    """local_sgd: outer Nesterov SGD learning rate on the mean parameter delta (1.0 with momentum 0:
    plain averaging of the replicas)."""
    outer_momentum: float = 0.0
    """local_sgd: outer Nesterov momentum. DiLoCo's 0.7 / 0.9 suit H in the hundreds; at H=4 on the
    demo they overshoot (bench/README.md, Communication modes)."""


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 100
    """Save every this many steps (asynchronously); the run's last step is always saved."""
    max_to_keep: int = 3
    """Keep the newest this many checkpoints (plus those keep_period names)."""
    keep_period: Optional[int] = None
    """Also keep every step that is a multiple of this."""
    directory: Optional[str] = None
    """Default: run_dir/checkpoints. A local path or gs:// URL."""
    writer_niceness: int = 19
    """CPU niceness (0-19, Linux) of the threads that write an async save, so that it runs on CPU
    time the training leaves idle instead of slowing the steps; 0: the training's own priority."""
    init_from: Optional[str] = None
    """Start from these weights (step 0, fresh optimizer state): a directory written by
    `shardtrain import-hf`, a run directory or checkpoint step directory, or a Hugging Face model
    directory (config.json + *.safetensors). Ignored once run_dir has checkpoints (resume wins)."""


@dataclass(frozen=True)
class HardwareConfig:
    """The hardware a config is made for. `shardtrain plan` plans for it when no --chip / --topology
    is given: for a TPU topology with the TPU compiler itself (libtpu), else on the devices present."""

    chip: Optional[str] = None
    """A chip of shardtrain/plan/chips.py (v4, v5e, v5p, v6e, a100, h100, h200, cpu); None: the devices present."""
    topology: Optional[str] = None
    """TPU chips per dimension of one slice, e.g. "16x16" (v5e-256) or "4x4x8" (v5p-256); None for GPUs and cpu."""
    slices: int = 1
    """TPU slices of `topology` joined over DCN (multi-slice); the product of mesh.dcn equals it."""


@dataclass(frozen=True)
class RunConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    run_dir: Optional[str] = None
    """Where metrics, plots, the resolved config and checkpoints go. Default: runs/<config name>."""
    name: str = "run"
    """Run name (default: the config file's stem)."""

    def checkpoint_dir(self) -> str:
        return self.checkpoint.directory or str(Path(self.run_dir) / "checkpoints")


# ----------------------------------------------------------------------------- loading


def _convert(tp, value, where: str):
    """Checks and converts a YAML value to the annotated type `tp`."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[-1] if len(errors) == 1 else f"{where}: {value!r} is not a valid {_type_name(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(map(str, typing.get_args(tp)))
            raise ConfigError(f"{where}: {value!r} is not one of: {choices}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if args and args[-1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-2 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, str, bool) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _build(cls, values: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{path}'{hint}")
        kwargs[key] = _convert(hints[key], value, path)
    return cls(**kwargs)


def from_dict(tree: dict, cls=None):
    """A config (RunConfig by default, or the section class `cls`) from a plain dict such as a
    checkpoint's saved config; unknown keys and wrong types raise ConfigError."""
    return _build(cls or RunConfig, tree, "" if cls is None else cls.__name__)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        node = tree.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section")
        tree = node
    tree[last] = value


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)



class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML
    would silently keep the last value)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # PyYAML itself reports an unhashable key
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (YAML would keep only the last one; remove the other)",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(p: Path) -> dict:
    """A config file's top-level mapping; every way a file can be unusable is one ConfigError line."""
    if p.is_dir():
        raise ConfigError(f"config '{p}' is a directory, not a YAML file; pass a file such as meshes/demo.yaml")
    if not p.exists():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{p}' cannot be read: {e}") from None
    if not text.strip():
        raise ConfigError(f"config file '{p}' is empty; give at least one section, e.g. copy meshes/demo.yaml")
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        what = " ".join(x for x in (e.context, e.problem) if x)
        kind = "" if what.startswith("duplicate key") else "YAML syntax error: "
        raise ConfigError(f"{where}: {kind}{what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: YAML syntax error: {' '.join(str(e).split())}") from None
    if tree is None:
        raise ConfigError(f"config file '{p}' holds only comments; give at least one section, "
                          "e.g. copy meshes/demo.yaml")
    if not isinstance(tree, dict):
        raise ConfigError(f"{p}: expected a mapping of sections (mesh:, model:, ...) at the top level, "
                          f"got {type(tree).__name__}")
    return tree


def load(path: str | None = None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Loads a YAML config (or the defaults) and applies `key=value` overrides (YAML values)."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        tree = read_yaml(p)
        tree.setdefault("name", p.stem)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not KEY=VALUE (e.g. train.steps=50)")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    cfg = _build(RunConfig, tree, "")
    validate(cfg)
    return resolve_paths(cfg)


def absolute(path: str | None) -> str | None:
    """A path the user gave, made absolute against the current directory once, at load time (so
    that a later chdir or a library that insists on absolute paths cannot break it); URLs such as
    gs://... are returned untouched."""
    if path is None or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def resolve_paths(cfg: RunConfig) -> RunConfig:
    """The config with run_dir defaulted (runs/<name>) and every path made absolute."""
    return dataclasses.replace(
        cfg, run_dir=absolute(cfg.run_dir or str(Path("runs") / cfg.name)),
        checkpoint=dataclasses.replace(cfg.checkpoint, directory=absolute(cfg.checkpoint.directory),
                                       init_from=absolute(cfg.checkpoint.init_from)),
        data=dataclasses.replace(cfg.data, path=absolute(cfg.data.path), mixture=tuple(
            dataclasses.replace(e, path=absolute(e.path)) for e in cfg.data.mixture)))


def validate(cfg: RunConfig) -> None:
    """Checks that need more than one field; device-dependent checks live in mesh.py."""
    m, t = cfg.model, cfg.train
    sizes = [getattr(cfg.mesh, a) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    for axis, size in zip(MESH_AXES, sizes):
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}: size must be a positive integer or -1, got {size}")
        if getattr(cfg.mesh.dcn, axis) < 1:
            raise ConfigError(f"mesh.dcn.{axis}: size must be >= 1")
    for name, value in [("train.steps", t.steps), ("train.global_batch_size", t.global_batch_size),
                        ("train.grad_accum_steps", t.grad_accum_steps), ("train.log_every", t.log_every),
                        ("data.seq_len", cfg.data.seq_len), ("checkpoint.every_steps", cfg.checkpoint.every_steps),
                        ("train.sync_every", t.sync_every), ("train.pipeline_repeats", t.pipeline_repeats),
                        ("train.scan_unroll", t.scan_unroll), ("train.eval_steps", t.eval_steps)]:
        if value < 1:
            raise ConfigError(f"{name}: must be >= 1, got {value}")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every: must be >= 0 (0: no evaluation), got {t.eval_every}")
    d = cfg.data
    if d.mixture and d.source != "tokens":
        raise ConfigError(f"data.mixture needs data.source=tokens, got data.source={d.source}")
    if d.mixture and d.path is not None:
        raise ConfigError("data.path and data.mixture are both set; give one of them")
    if any(e.weight <= 0 for e in d.mixture):
        raise ConfigError(f"data.mixture: weights must be > 0, got {[e.weight for e in d.mixture]}")
    if d.source == "tokens" and d.path is None and not d.mixture:
        raise ConfigError("data.source=tokens needs data.path=DIR (a `shardtrain prepare --out DIR`) or data.mixture")
    if t.profile_steps is not None:
        first, last = t.profile_steps
        if not 1 <= first <= last <= t.steps:
            raise ConfigError(f"train.profile_steps: [{first}, {last}] must be [first, last] steps with "
                              f"1 <= first <= last <= train.steps={t.steps}, "
                              f"e.g. [{min(3, t.steps)}, {min(5, t.steps)}]")
    validate_optimizer(cfg.optimizer)
    if not 0 <= cfg.checkpoint.writer_niceness <= 19:
        raise ConfigError(f"checkpoint.writer_niceness: must be 0 (no change) to 19 (lowest priority), "
                          f"got {cfg.checkpoint.writer_niceness}")
    if t.loss_chunk < 0:
        raise ConfigError(f"train.loss_chunk: must be >= 0 (0: one chunk), got {t.loss_chunk}")
    if 0 < t.loss_chunk < cfg.data.seq_len and cfg.data.seq_len % t.loss_chunk:
        raise ConfigError(f"train.loss_chunk={t.loss_chunk} must divide data.seq_len={cfg.data.seq_len}; "
                          f"choose a divisor or 0 (one chunk)")
    if t.global_batch_size % t.grad_accum_steps:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                          f"train.grad_accum_steps={t.grad_accum_steps}")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if m.sliding_window is not None and m.sliding_window < 1:
        raise ConfigError(f"model.sliding_window: must be >= 1 (or null: the whole context), got {m.sliding_window}")
    if m.n_experts > 1 and not 1 <= m.experts_per_token <= m.n_experts:
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} must be between 1 and "
                          f"model.n_experts={m.n_experts}")
    if m.n_experts < 0 or m.n_shared_experts < 0:
        raise ConfigError("model.n_experts and model.n_shared_experts must be >= 0")
    if m.capacity_factor is not None and m.capacity_factor <= 0:
        raise ConfigError(f"model.capacity_factor={m.capacity_factor} must be > 0, or null for dropless routing")
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model} "
                          "(or set model.head_dim)")
    for target in m.lora.targets:
        if target not in LORA_TARGETS and target not in LORA_TARGETS.values():
            raise ConfigError(f"model.lora.targets: unknown weight '{target}'; choose from "
                              f"{', '.join(LORA_TARGETS)} (or {', '.join(LORA_TARGETS.values())})")
    if m.lora.rank < 0:
        raise ConfigError(f"model.lora.rank: must be >= 0 (0: no adapters), got {m.lora.rank}")
    if m.lora.rank > 0 and (t.sync != "every_step" or t.grad_reduce_dtype != "float32"):
        raise ConfigError("model.lora.rank > 0 needs train.sync=every_step and train.grad_reduce_dtype=float32 "
                          "(LoRA with local SGD or compressed gradients is not supported yet)")
    moe_lora = [p for p in m.lora.target_params() if p.startswith("w_") and p.endswith(("_df", "_fd"))]
    if m.n_experts > 1 and moe_lora:
        raise ConfigError(f"model.lora.targets: {', '.join(moe_lora)} are dense-MLP weights, which an MoE model "
                          "(model.n_experts > 1) does not have; adapt attention weights only")
    if str(cfg.run_dir).startswith("gs://"):
        raise ConfigError(f"run_dir={cfg.run_dir}: must be a local directory (metrics, plots); put "
                          "checkpoints on GCS with checkpoint.directory=gs://BUCKET/PATH")
    for axis in t.sync_axes:
        if axis not in MESH_AXES:
            raise ConfigError(f"train.sync_axes: unknown mesh axis '{axis}'; mesh axes: {', '.join(MESH_AXES)}")
    validate_hardware(cfg)
    for logical in dataclasses.fields(RulesConfig):
        rule = getattr(cfg.rules, logical.name)
        for axis in mesh_axes(rule):
            if axis not in MESH_AXES:
                raise ConfigError(f"rules.{logical.name}: unknown mesh axis '{axis}'; "
                                  f"mesh axes: {', '.join(MESH_AXES)}")


def validate_hardware(cfg: RunConfig) -> None:
    from shardtrain.plan.chips import CHIPS  # figures only: imports nothing from shardtrain

    hw = cfg.hardware
    if hw.chip is not None and hw.chip not in CHIPS:
        close = difflib.get_close_matches(hw.chip, CHIPS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"hardware.chip: unknown chip '{hw.chip}'{hint}; known: {', '.join(CHIPS)}")
    if hw.slices < 1:
        raise ConfigError(f"hardware.slices: must be >= 1, got {hw.slices}")
    if hw.topology is None:
        if hw.slices > 1:
            raise ConfigError("hardware.slices > 1 needs hardware.topology (the chips of one slice, e.g. 4x4x8)")
        return
    if hw.chip is None or CHIPS[hw.chip].tpu_name is None:
        raise ConfigError(f"hardware.topology={hw.topology}: needs hardware.chip to name a TPU (v4, v5e, v5p, v6e)")
    dims = hw.topology.split("x")
    if not 2 <= len(dims) <= 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ConfigError(f"hardware.topology={hw.topology!r}: expected chips per dimension, e.g. 16x16 or 4x4x8")
    dcn = math.prod(getattr(cfg.mesh.dcn, a) for a in MESH_AXES)
    if dcn > 1 and dcn != hw.slices:
        raise ConfigError(f"mesh.dcn: its product {dcn} must equal hardware.slices={hw.slices} "
                          "(the DCN axes run across the slices)")


def validate_optimizer(o: OptimizerConfig) -> None:
    for name, ok, want in [
        ("learning_rate", o.learning_rate > 0, "> 0, e.g. 3e-3"),
        ("b1", 0 <= o.b1 < 1, "in [0, 1), e.g. 0.9"),
        ("b2", 0 <= o.b2 < 1, "in [0, 1), e.g. 0.95"),
        ("weight_decay", o.weight_decay >= 0, ">= 0 (0 turns it off)"),
        ("grad_clip", o.grad_clip > 0, "> 0, e.g. 1.0"),
        ("warmup_steps", o.warmup_steps >= 0, ">= 0"),
        ("decay_steps", o.decay_steps is None or o.decay_steps >= 1, ">= 1 (or null: train.steps)"),
        ("min_lr_ratio", 0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
    ]:
        if not ok:
            raise ConfigError(f"optimizer.{name}: must be {want}, got {getattr(o, name)}")


def prepare_dir(path: str, field_name: str) -> None:
    """Creates a local output directory and checks that it can be written, so that a run_dir that
    is a file or read-only stops before anything is compiled. gs:// paths are left to orbax."""
    if path.startswith("gs://"):
        return
    p = Path(path)
    blocker = next((q for q in [p, *p.parents] if q.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ConfigError(f"{field_name}={path}: '{blocker}' is a file, not a directory; pick another {field_name}")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ConfigError(f"{field_name}={path}: cannot write there ({e.strerror or e}); "
                          f"pick a directory you can write, e.g. {field_name}=/tmp/run") from None


def dump(cfg: RunConfig) -> str:
    """The resolved config as YAML (tuples as lists)."""
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x
    return yaml.safe_dump(plain(to_dict(cfg)), sort_keys=False)
