"""The run configuration's schema: typed, frozen, nested dataclasses, one per YAML section.

A `RunConfig` is the one source of truth every other module reads. Each field carries its default
and a docstring; a field that matters only under another setting sits in that setting's section
(`model.moe`, `train.pipeline`, `train.comm`). `MOVED` lists the flat names those sections
replaced, so that the loader can say where each went. The model section is in `model.py`, loading
in `load.py`, cross-field checks in `validate.py`.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, Optional

from shardtrain.config.model import ModelConfig, MoeConfig


class ConfigError(ValueError):
    """A mistake in user input (config, overrides, mesh, data, checkpoint). Exit code 2."""


_SHORT = reprlib.Repr()  # (Repr's keyword arguments are Python 3.12+)
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 3, 6, 6, 6
_SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 160, 60, 160


def shown(value, limit: int = 200) -> str:
    """A value as an error message may echo it: its repr, at most `limit` characters, and never the
    whole of a huge one (a YAML alias bomb is a list of billions of shared items: reprlib stops at a
    few items per level instead of building a 3 GB string)."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_url(location: str) -> bool:
    """A remote location (gs://, s3://, ...) rather than a local path."""
    return "://" in str(location)


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
class MixtureEntry:
    """One dataset of a mixture: a `shardtrain prepare` output directory and its sampling weight."""

    path: str
    weight: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    """The training (and held-out) tokens: where they come from and the sequence length."""

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
    tokenizer: Optional[str] = None
    """The fingerprint of the tokenizer the model reads (`bytes`, or `N tokens, sha256 HEX`: its
    vocabulary's, as `prepare` records it in manifest.json); null: the data's, resolved at the run's
    start and recorded in run_dir/config.yaml and every checkpoint (import-hf writes its model's). The
    data, checkpoint.init_from's weights and a resumed run's must all have this tokenizer."""
    allow_tokenizer_mismatch: bool = False
    """true: train anyway on data tokenized by another tokenizer than the weights' (else one-line error)."""


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer (optax's) after global-norm clipping, and the learning-rate schedule
    (shardtrain/optim.py). Norm scales get no weight decay."""

    name: Literal["adamw", "adafactor", "muon", "lion"] = "adamw"
    """`adamw`; `adafactor`: factored second moments (a row and a column vector instead of a full
    moment for arrays with two axes of >= 128), no first moment, update clipping 1.0, decoupled
    weight decay; `lion`: one momentum, sign updates (its paper uses a 3-10x smaller learning_rate
    than AdamW's); `muon` (optax.contrib): hidden weight matrices by Muon (Nesterov momentum 0.95,
    Newton-Schulz orthogonalised, updates scaled to AdamW's RMS so learning_rate and weight_decay
    carry over), embeddings, output head, norm scales and other non-matrix parameters by AdamW
    (b1, b2, no weight decay)."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """After warmup_steps of linear warmup: `cosine` decay to learning_rate x min_lr_ratio at
    decay_steps; `wsd` (warmup-stable-decay): constant, then linear decay to learning_rate x
    min_lr_ratio over the last decay_fraction of decay_steps; `constant`: learning_rate to the end."""
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    decay_steps: Optional[int] = None
    """The step the decay ends at (the LR then stays at learning_rate x min_lr_ratio); null: train.steps
    at the run's start, resolved then and recorded in run_dir/config.yaml and each checkpoint, so
    resuming with a larger train.steps keeps it; a number set on a resume re-plans the decay."""
    decay_fraction: float = 0.2
    """wsd: the share of decay_steps the final decay takes (0.2: the last 20%)."""
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    """adamw, lion (and muon's AdamW part): first-moment decay."""
    b2: float = 0.95
    """adamw (and muon's AdamW part): second-moment decay; lion: its momentum's decay."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline schedule over mesh.pipeline stages (shardtrain/parallel/pipeline.py); used only when
    mesh.pipeline > 1."""

    schedule: Literal["gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble"] = "gpipe"
    """`gpipe`: one contiguous group of layers per stage; `circular`: `repeats` non-adjacent
    groups per stage (bubble (P-1)/(repeats*M+P-1), needs M >= stages); both keep every
    micro-batch's activations. `1f1b`: GPipe's layout, each micro-batch's backward as early as
    possible (a stage holds at most P micro-batches' activations); `interleaved_1f1b`: 1F1B over
    circular's layout (M a multiple of P); `zero_bubble`: 1F1B with each backward split into its
    input and weight gradients, the weight gradients run in the bubble (ZB-H1)."""
    microbatches: Optional[int] = None
    """Pipeline micro-batches M per (accumulation) step; default: the largest M <= 4 x pipeline
    stages that divides each data replica's rows."""
    repeats: int = 1
    """Circular and interleaved_1f1b schedules: groups of layers per stage (divides the bubble by this)."""


@dataclass(frozen=True)
class CommConfig:
    """How the data-parallel replicas communicate (shardtrain/parallel/comm.py). The default (float32,
    every_step) is GSPMD's own synchronous step; anything else swaps in a hand-written one."""

    grad_reduce_dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    """Dtype of the cross-replica gradient reduction (int8 keeps an error-feedback residual)."""
    sync: Literal["every_step", "local_sgd"] = "every_step"
    """`every_step`: replicas reduce gradients every step (synchronous data parallelism);
    `local_sgd`: replicas along sync_axes train on their own and average their parameters every
    sync_every steps with an outer optimizer (DiLoCo)."""
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
class OffloadConfig:
    """Train state kept in the host's pinned memory instead of the accelerator's (memory kinds): each
    step brings it in and writes it back over the host link (PCIe), which `plan` counts. The
    numbers are the same as without offload."""

    optimizer: bool = False
    """The optimizer state (AdamW's two moments: 2x the fp32 parameters' bytes) lives on the host; it
    comes to the device after the step's gradients exist, for the update only."""
    params: bool = False
    """The (fp32 master) parameters live on the host too; each step brings them in for the forward
    pass."""


@dataclass(frozen=True)
class WatchdogConfig:
    """Hangs and stragglers (shardtrain/runtime/health.py). A hang: no step finished for
    max(hang_factor x the median step time, hang_min_s), or startup_s before the first step of a
    start; every process then writes its Python stacks to run_dir and exits 70."""

    hang_factor: float = 20.0
    """A step is hung after this many median step times (0: no hang watchdog)."""
    hang_min_s: float = 120.0
    """Never call a step hung before this many seconds."""
    startup_s: float = 1800.0
    """The limit until a start (or restart) has finished its first step, and during saves and evaluations."""
    straggler_factor: float = 1.5
    """With several processes: a process whose host time per step (data, dispatch) exceeds the
    median process's by this factor on straggler_logs consecutive log steps is named (0: off)."""
    straggler_logs: int = 3
    """Consecutive log steps a process must be slow before it is named."""


@dataclass(frozen=True)
class DpoConfig:
    """Direct preference optimisation (train.objective=dpo; shardtrain/dpo.py) on pairs that
    `shardtrain prepare --preference` wrote. A sequence's log-probability is the sum over its
    completion's tokens (EOS included); `ipo` and `simpo` use the mean per token."""

    beta: float = 0.1
    """Scale of the implicit reward beta x (log pi - log pi_ref)."""
    loss: Literal["sigmoid", "ipo", "simpo"] = "sigmoid"
    """`sigmoid`: DPO's -log sigmoid(beta x margin); `ipo`: (margin - 1 / (2 beta))^2 on mean
    log-probs; `simpo`: -log sigmoid(beta x (mean logp chosen - mean logp rejected) - simpo_gamma),
    which never uses a reference."""
    reference: Literal["frozen", "none"] = "frozen"
    """`frozen`: the policy's starting weights (checkpoint.init_from), held in the train state
    sharded like the parameters, without optimizer state (with LoRA: the base model, the adapters
    off, no copy); `none`: reference log-probs of 0 (reference-free)."""
    label_smoothing: float = 0.0
    """Probability that a pair's labels are flipped (conservative DPO; sigmoid and simpo)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma."""


@dataclass(frozen=True)
class GrpoConfig:
    """Group relative policy optimisation (train.objective=grpo; shardtrain/grpo.py): each step
    samples group_size completions of each prompt with the KV-cache generator on the training mesh,
    scores them with `reward`, and optimises the clipped policy-ratio objective with a KL penalty to
    the frozen starting weights. train.global_batch_size counts completions (prompts x group_size)."""

    reward: Optional[str] = None
    """`path/to/file.py:function`, called as function(row, text, ids) -> float for each completion:
    row the prompt's JSONL line ({"prompt": text} for a prepared directory), text and ids the completion's
    (its EOS included in ids when it stopped there)."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are normalised within each group."""
    max_new_tokens: int = 32
    """The most tokens a completion may have (it stops earlier at EOS)."""
    temperature: float = 1.0
    top_p: float = 1.0
    kl_coef: float = 0.04
    """Weight of the KL penalty to the reference (the starting weights; 0: no reference held)."""
    clip: float = 0.2
    """The policy ratio is clipped to [1 - clip, 1 + clip]."""
    epochs_per_batch: int = 1
    """Optimizer updates on each batch of completions (the ratio is to the policy that sampled them)."""


@dataclass(frozen=True)
class TrainConfig:
    """The training loop: steps, batch, seed, precision, recomputation, evaluation and profiling,
    with the pipeline schedule and replica communication in their own sections."""

    steps: int = 200
    objective: Literal["lm", "dpo", "grpo"] = "lm"
    """`lm`: next-token cross-entropy (pretraining, SFT); `dpo`: preference optimisation on
    `prepare --preference` data (the `dpo` section); `grpo`: reinforcement learning from a reward
    on sampled completions of prepared prompts (the `grpo` section)."""
    seed: int = 0
    """All randomness (init, data order) derives from this."""
    global_batch_size: int = 32
    grad_accum_steps: int = 1
    """Micro-batches per step, accumulated inside the compiled step (same update as the full batch)."""
    remat: Literal["none", "full", "dots", "dots_no_batch", "offload", "minimal", "save_dot_except_mlp",
                   "save_qkv_proj", "save_out_proj", "save_attn_out", "save_mlp_gate_up", "minimal_offloaded",
                   "qkv_proj_offloaded"] = "none"
    """Activation recomputation policy for each layer (jax.checkpoint_policies). `offload` keeps
    each layer's input and attention output in host memory (pinned_host) and recomputes the rest:
    TPU / GPU only. The named policies save the outputs of some matmuls and recompute the rest
    (MaxText's names): `minimal` every projection (q, k, v, out, MLP gate / up / down),
    `save_dot_except_mlp` the attention's four, `save_qkv_proj` q, k, v, `save_out_proj` the
    attention's output projection, `save_attn_out` the attention's output, `save_mlp_gate_up` the
    MLP's gate and up; `minimal_offloaded` / `qkv_proj_offloaded` keep minimal's / save_qkv_proj's
    in host memory instead (TPU / GPU only)."""
    scan_unroll: int = 1
    """Layers per iteration of the `lax.scan` over layers: 1 keeps the compiled program and compile
    time flat in depth; n_layers unrolls it fully (sometimes faster for small models on CPU)."""
    loss_chunk: int = 512
    """Sequence positions per cross-entropy chunk: the logits (B x chunk x vocab) are computed,
    reduced and recomputed in the backward pass one chunk at a time, never for the whole sequence;
    0 or >= seq_len: one chunk."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the forward and backward pass: the stored weights are cast to it inside the step
    (the cross-entropy itself is taken in float32; the optimizer update uses param_dtype)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of stored (master) weights and optimizer state."""
    quantization: Literal["none", "int8", "fp8"] = "none"
    """How the blocks' matmuls (attention projections, MLP, MoE experts) run, forward and backward
    (models/quant.py): `int8` operands with int32 accumulation (TPU v5e / v5p / v6e: twice bf16's
    peak), `fp8` e4m3 forward and e5m2 gradients (H100 / H200), both with per-row / per-column
    absmax scales taken fresh each step and straight-through gradients. Master weights, optimizer
    state and checkpoints are unchanged, so a resume may switch it; the embedding, head and norms
    stay in compute_dtype. `none`: compute_dtype throughout."""
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
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline schedule (used when mesh.pipeline > 1)."""
    comm: CommConfig = field(default_factory=CommConfig)
    """How replicas reduce gradients and synchronise (the default: float32, every step)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is not finite: `stop` says `step N`, saves nothing from it
    and exits 65; `skip` leaves parameters and optimizer state as they were before that step and
    counts it (metrics.jsonl: {"event": "nonfinite", "step": N, "action": "skip"})."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Hang watchdog and straggler report."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Optimizer state (and master parameters) in host memory."""


@dataclass(frozen=True)
class LocalTierConfig:
    """A fast local checkpoint tier beside the persistent one (shardtrain/checkpoint/local.py):
    every process writes its own shards to a directory on its own host (a RAM disk such as
    /dev/shm, a local SSD), often; on start the newest step that every process can restore wins."""

    directory: Optional[str] = None
    """A local directory on every host (processes of one host may share it); null: no local tier."""
    every_steps: int = 10
    """Save locally every this many steps; must be smaller than checkpoint.every_steps."""
    max_to_keep: int = 2
    """Local steps each process keeps."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints: how often, how many to keep, where, and the weights to start from."""

    every_steps: int = 100
    """Save every this many steps (asynchronously); the run's last step is always saved."""
    max_to_keep: int = 3
    """Keep the newest this many checkpoints (plus those keep_period names)."""
    keep_period: Optional[int] = None
    """Also keep every step that is a multiple of this."""
    directory: Optional[str] = None
    """Default: run_dir/checkpoints. A local path or gs:// URL."""
    local: LocalTierConfig = field(default_factory=LocalTierConfig)
    """The local tier (off unless local.directory is set)."""
    writer_niceness: int = 19
    """CPU niceness (0-19, Linux) of the threads that write an async save, so that it runs on CPU
    time the training leaves idle instead of slowing the steps; 0: the training's own priority."""
    init_from: Optional[str] = None
    """Start from these weights (step 0, fresh optimizer state): a directory written by
    `shardtrain import-hf`, a run directory or checkpoint step directory, or a Hugging Face model
    directory (config.json + *.safetensors). Ignored once run_dir has checkpoints (resume wins)."""
    allow_changes: tuple[str, ...] = ()
    """Config keys (or sections, e.g. model.rope_scaling) a resume may change although they change
    the model's function or the data stream (model.*, data.path, data.seq_len, data.mixture,
    train.seed, ...): a resume that changes one not listed here stops with exit 2
    (checkpoint/diagnose.py check_changes)."""


@dataclass(frozen=True)
class HardwareConfig:
    """The hardware a config is made for. `shardtrain plan` plans for it when no --chip / --topology
    is given: for a TPU topology with the TPU compiler itself (libtpu), for GPUs with XLA:GPU (compile-only
    without GPUs: the `gpu` extra), else on the devices present."""

    chip: Optional[str] = None
    """A chip of shardtrain/chips.py (v4, v5e, v5p, v6e, tpu7x, a100, h100, h200, b200, cpu); None: the devices
    present."""
    topology: Optional[str] = None
    """TPU chips per dimension of one slice, e.g. "16x16" (v5e-256) or "4x4x8" (v5p-256); for GPUs NODESxGPUS,
    e.g. "2x8" (default: one node of the mesh's GPUs, or mesh.dcn's product of nodes); None for cpu."""
    slices: int = 1
    """TPU slices of `topology` joined over DCN (multi-slice); the product of mesh.dcn equals it."""


@dataclass(frozen=True)
class RunConfig:
    """A whole run: one section per YAML top-level key, plus where the run writes and its name."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """Preference optimisation (used when train.objective=dpo)."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    """Reinforcement learning with sampled completions (used when train.objective=grpo)."""
    run_dir: Optional[str] = None
    """Where metrics, plots, the resolved config and checkpoints go. Default: runs/<config name>."""
    name: str = "run"
    """Run name (default: the config file's stem)."""

    def checkpoint_dir(self) -> str:
        return self.checkpoint.directory or str(Path(self.run_dir) / "checkpoints")


MOVED: dict[type, dict[str, str]] = {
    ModelConfig: {f.name: f"moe.{f.name}" for f in fields(MoeConfig)},
    TrainConfig: {"pipeline_schedule": "pipeline.schedule", "microbatches": "pipeline.microbatches",
                  "pipeline_repeats": "pipeline.repeats", **{f.name: f"comm.{f.name}" for f in fields(CommConfig)}},
}
"""Flat field names that moved into a section: section class -> {old name: its place in that section}.
The loader answers an old name with its new place instead of "unknown key"."""
