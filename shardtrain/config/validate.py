"""Cross-field checks of a loaded RunConfig: one `validate_<section>` per section, run by `validate`.

The loader has already checked each value's type; what is left is what needs more than one field
(a divisor, a range, a setting that only some other setting allows). Each check raises one
ConfigError line naming the field and the fix. Checks that need the devices live in parallel/mesh.py,
checks that need the model (its shapes, the weights LoRA can adapt) in parallel/sharding.py, step.py,
parallel/pipeline.py and parallel/comm.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing

from shardtrain.chips import CHIPS
from shardtrain.config.model import ModelConfig, MoeConfig
from shardtrain.config.schema import (
    MESH_AXES,
    CheckpointConfig,
    CommConfig,
    ConfigError,
    DataConfig,
    MeshConfig,
    OptimizerConfig,
    PipelineConfig,
    RulesConfig,
    RunConfig,
    TrainConfig,
    WatchdogConfig,
    is_url,
    mesh_axes,
    shown,
)

MAX_STEPS = 2**31 - 1
"""The most steps a schedule may count: optax keeps the step count in an int32."""
MAX_SEED = 2**31 - 1
"""train.seed: 0..MAX_SEED (grain's shuffle takes 0..2**32-1, and a mixture's k-th dataset and the
synthetic eval split use seed + k)."""


def validate(cfg: RunConfig) -> None:
    """Checks that need more than one field; device-dependent checks live in mesh.py."""
    validate_mesh(cfg.mesh)
    validate_train(cfg.train, cfg.data.seq_len)
    validate_data(cfg.data)
    validate_optimizer(cfg.optimizer, cfg.model.lora.rank)
    validate_checkpoint(cfg.checkpoint)
    validate_allow_changes(cfg.checkpoint.allow_changes)
    validate_model(cfg.model)
    validate_lora(cfg.model, cfg.train.comm)
    validate_run_dir(cfg.run_dir)
    validate_hardware(cfg, with_mesh=False)
    validate_rules(cfg.rules)
    validate_objective(cfg)
    rope = cfg.model.rope_scaling
    if rope is not None and rope.type == "dynamic" and cfg.data.seq_len > rope.original_max_position_embeddings:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len}: model.rope_scaling.type=dynamic changes the frequencies "
                          f"past original_max_position_embeddings={rope.original_max_position_embeddings}, which only "
                          "transformers' inference does; use a shorter data.seq_len, or rope_scaling.type=yarn")
    if cfg.model.attention == "cudnn" and cfg.train.compute_dtype != "bfloat16":
        raise ConfigError(f"model.attention=cudnn: cuDNN's fused attention takes bfloat16, and train.compute_dtype "
                          f"is {cfg.train.compute_dtype}; set train.compute_dtype=bfloat16, or model.attention=auto "
                          "(chunked attention in float32)")


def at_least_one(named_values) -> None:
    for name, value in named_values:
        if value < 1:
            raise ConfigError(f"{name}: must be >= 1, got {value}")


def validate_mesh(mesh: MeshConfig) -> None:
    sizes = [getattr(mesh, a) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    for axis, size in zip(MESH_AXES, sizes):
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}: size must be a positive integer or -1, got {size}")
        if getattr(mesh.dcn, axis) < 1:
            raise ConfigError(f"mesh.dcn.{axis}: size must be >= 1")


def validate_train(t: TrainConfig, seq_len: int) -> None:
    at_least_one([("train.steps", t.steps), ("train.global_batch_size", t.global_batch_size),
                  ("train.grad_accum_steps", t.grad_accum_steps), ("train.log_every", t.log_every),
                  ("data.seq_len", seq_len), ("train.scan_unroll", t.scan_unroll),
                  ("train.eval_steps", t.eval_steps)])
    if t.steps > MAX_STEPS:
        raise ConfigError(f"train.steps: must be at most {MAX_STEPS} (the optimizer counts steps in an int32), "
                          f"got {t.steps}")
    if not 0 <= t.seed <= MAX_SEED:
        raise ConfigError(f"train.seed: must be between 0 and {MAX_SEED}, got {t.seed}")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every: must be >= 0 (0: no evaluation), got {t.eval_every}")
    if t.profile_steps is not None:
        first, last = t.profile_steps
        if not 1 <= first <= last <= t.steps:
            raise ConfigError(f"train.profile_steps: [{first}, {last}] must be [first, last] steps with "
                              f"1 <= first <= last <= train.steps={t.steps}, "
                              f"e.g. [{min(3, t.steps)}, {min(5, t.steps)}]")
    if t.loss_chunk < 0:
        raise ConfigError(f"train.loss_chunk: must be >= 0 (0: one chunk), got {t.loss_chunk}")
    if 0 < t.loss_chunk < seq_len and seq_len % t.loss_chunk:
        raise ConfigError(f"train.loss_chunk={t.loss_chunk} must divide data.seq_len={seq_len}; "
                          f"choose a divisor or 0 (one chunk)")
    if t.global_batch_size % t.grad_accum_steps:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                          f"train.grad_accum_steps={t.grad_accum_steps}")
    validate_pipeline(t.pipeline)
    validate_comm(t.comm)
    validate_watchdog(t.watchdog)


def validate_objective(cfg: RunConfig) -> None:
    """train.objective=dpo|grpo: their sections' values, and the data and modes they do not combine with yet."""
    objective = cfg.train.objective
    if objective == "lm":
        return
    what = "preference pairs" if objective == "dpo" else "prompts"
    how = ("shardtrain prepare ... --preference" if objective == "dpo"
           else "shardtrain prepare PROMPTS.jsonl --text-field prompt")
    jsonl_prompts = objective == "grpo" and str(cfg.data.path or "").endswith(".jsonl")
    if (cfg.data.source != "tokens" and not jsonl_prompts) or cfg.data.mixture:
        raise ConfigError(f"train.objective={objective} trains on {what}: set data.source=tokens and data.path to a "
                          f"`{how}` output (no data.mixture)" + (", or a JSONL file of prompts" if objective == "grpo"
                                                                 else ""))
    if cfg.train.eval_every:
        raise ConfigError(f"train.eval_every: evaluation of train.objective={objective} is not supported yet; set "
                          "train.eval_every=0")
    if objective == "dpo":
        if cfg.dpo.beta <= 0:
            raise ConfigError(f"dpo.beta: must be > 0, got {cfg.dpo.beta}")
        if not 0 <= cfg.dpo.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing: must be in [0, 0.5), got {cfg.dpo.label_smoothing}")
        return
    g = cfg.grpo
    at_least_one([("grpo.group_size", g.group_size), ("grpo.max_new_tokens", g.max_new_tokens),
                  ("grpo.epochs_per_batch", g.epochs_per_batch)])
    if g.reward is None or ":" not in g.reward:
        raise ConfigError(f"grpo.reward: give the reward function as path/to/file.py:function, got {g.reward}")
    if g.group_size < 2 or cfg.train.global_batch_size % g.group_size:
        raise ConfigError(f"grpo.group_size={g.group_size} must be >= 2 and divide train.global_batch_size="
                          f"{cfg.train.global_batch_size} (completions per step: prompts x group_size)")
    if g.max_new_tokens >= cfg.data.seq_len:
        raise ConfigError(f"grpo.max_new_tokens={g.max_new_tokens} must be below data.seq_len={cfg.data.seq_len} "
                          "(a prompt and its completion are one sequence)")
    if g.temperature < 0 or not 0 < g.top_p <= 1 or g.kl_coef < 0 or not 0 < g.clip < 1:
        raise ConfigError("grpo: temperature >= 0, 0 < top_p <= 1, kl_coef >= 0 and 0 < clip < 1, got "
                          f"{g.temperature}, {g.top_p}, {g.kl_coef}, {g.clip}")


def validate_watchdog(w: WatchdogConfig) -> None:
    for name in ("hang_factor", "hang_min_s", "startup_s", "straggler_factor"):
        if getattr(w, name) < 0:
            raise ConfigError(f"train.watchdog.{name}: must be >= 0, got {getattr(w, name)}")
    if 0 < w.straggler_factor <= 1:
        raise ConfigError(f"train.watchdog.straggler_factor: must be > 1 (or 0: off), got {w.straggler_factor}")
    at_least_one([("train.watchdog.straggler_logs", w.straggler_logs)])


def validate_pipeline(p: PipelineConfig) -> None:
    at_least_one([("train.pipeline.repeats", p.repeats)])


def validate_comm(c: CommConfig) -> None:
    at_least_one([("train.comm.sync_every", c.sync_every)])
    for axis in c.sync_axes:
        if axis not in MESH_AXES:
            raise ConfigError(f"train.comm.sync_axes: unknown mesh axis '{axis}'; mesh axes: {', '.join(MESH_AXES)}")


def validate_data(d: DataConfig) -> None:
    if d.mixture and d.source != "tokens":
        raise ConfigError(f"data.mixture needs data.source=tokens, got data.source={d.source}")
    if d.mixture and d.path is not None:
        raise ConfigError("data.path and data.mixture are both set; give one of them")
    if any(e.weight <= 0 for e in d.mixture):
        raise ConfigError(f"data.mixture: weights must be > 0, got {[e.weight for e in d.mixture]}")
    if d.source == "tokens" and d.path is None and not d.mixture:
        raise ConfigError("data.source=tokens needs data.path=DIR (a `shardtrain prepare --out DIR`) or data.mixture")


def validate_optimizer(o: OptimizerConfig, lora_rank: int = 0) -> None:
    for name, ok, want in [
        ("learning_rate", o.learning_rate > 0, "> 0, e.g. 3e-3"),
        ("b1", 0 <= o.b1 < 1, "in [0, 1), e.g. 0.9"),
        ("b2", 0 <= o.b2 < 1, "in [0, 1), e.g. 0.95"),
        ("weight_decay", o.weight_decay >= 0, ">= 0 (0 turns it off)"),
        ("grad_clip", o.grad_clip > 0, "> 0, e.g. 1.0"),
        ("warmup_steps", 0 <= o.warmup_steps <= MAX_STEPS, f">= 0 and <= {MAX_STEPS}"),
        ("decay_steps", o.decay_steps is None or 1 <= o.decay_steps <= MAX_STEPS,
         f">= 1 and <= {MAX_STEPS} (or null: train.steps)"),
        ("min_lr_ratio", 0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
        ("decay_fraction", 0 < o.decay_fraction <= 1, "in (0, 1], e.g. 0.2 (the last 20% of decay_steps)"),
    ]:
        if not ok:
            raise ConfigError(f"optimizer.{name}: must be {want}, got {getattr(o, name)}")
    if o.name == "muon" and lora_rank > 0:
        raise ConfigError("optimizer.name=muon does not combine with LoRA (model.lora.rank > 0): Muon orthogonalises "
                          "whole weight matrices, not low-rank adapters; use optimizer.name=adamw, adafactor or lion")


def validate_checkpoint(c: CheckpointConfig) -> None:
    at_least_one([("checkpoint.every_steps", c.every_steps), ("checkpoint.local.every_steps", c.local.every_steps)])
    for name, value, why in (("max_to_keep", c.max_to_keep, "0 would delete every checkpoint, the newest too"),
                             ("local.max_to_keep", c.local.max_to_keep, "0 would delete every local step"),
                             ("keep_period", c.keep_period, "unset (null) keeps no steps beyond max_to_keep")):
        if value is not None and value < 1:
            raise ConfigError(f"checkpoint.{name}: must be >= 1, got {value} ({why})")
    if c.local.directory is not None and is_url(c.local.directory):
        raise ConfigError(f"checkpoint.local.directory={c.local.directory}: must be a directory on each host "
                          "(e.g. /dev/shm/run or a local SSD), not a URL; checkpoint.directory is the persistent tier")
    if c.local.directory is not None and c.local.every_steps >= c.every_steps:
        raise ConfigError(f"checkpoint.local.every_steps={c.local.every_steps} must be smaller than the persistent "
                          f"checkpoint.every_steps={c.every_steps} (the local tier is the frequent one)")
    if not 0 <= c.writer_niceness <= 19:
        raise ConfigError(f"checkpoint.writer_niceness: must be 0 (no change) to 19 (lowest priority), "
                          f"got {c.writer_niceness}")


def validate_model(m: ModelConfig) -> None:
    sizes = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim"]
    mla = ["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    rope = ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
            "beta_slow", "attention_factor"]
    positive = [(f"model.{k}", getattr(m, k)) for k in [*sizes, "rope_theta", "rope_local_theta"]]
    positive += [(f"model.moe.{k}", getattr(m.moe, k)) for k in ("shared_expert_d_ff", "dense_d_ff")]
    positive += [(f"model.mla.{k}", getattr(m.mla, k)) for k in mla if m.mla is not None]
    positive += [(f"model.rope_scaling.{k}", getattr(m.rope_scaling, k)) for k in rope if m.rope_scaling is not None]
    for name, value in positive:
        if value is not None and value <= 0:
            raise ConfigError(f"{name}: must be > 0, got {value}")
    if m.rms_norm_eps < 0:
        raise ConfigError(f"model.rms_norm_eps: must be >= 0, got {m.rms_norm_eps}")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    if m.sliding_window is not None and m.sliding_window < 1:
        raise ConfigError(f"model.sliding_window: must be >= 1 (or null: the whole context), got {m.sliding_window}")
    if m.attention_chunk is not None and m.attention_chunk < 1:
        raise ConfigError(f"model.attention_chunk: must be >= 1 (or null), got {m.attention_chunk}")
    if m.layer_pattern and m.sliding_window is None and m.attention_chunk is None and "local" in m.layer_pattern:
        raise ConfigError(f"model.layer_pattern={list(m.layer_pattern)} has local layers but model.sliding_window "
                          "is null; set the window they use")
    for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
        if getattr(m, name) is not None and getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}: must be > 0 (or null: none), got {getattr(m, name)}")
    if m.attn_softcap is not None and m.attention == "cudnn":
        raise ConfigError("model.attention=cudnn cannot soft-cap attention scores (model.attn_softcap); "
                          "use attention=chunked or auto on a GPU")
    validate_moe(m.moe, m.n_layers)
    if m.mla is not None and m.n_kv_heads != m.n_heads:
        raise ConfigError(f"model.mla: latent attention has a key and value per head; set model.n_kv_heads="
                          f"{m.n_heads} (model.n_heads), not {m.n_kv_heads}")
    if m.mla is not None and (m.layer_pattern or m.qkv_bias or m.qk_norm or m.sliding_window):
        raise ConfigError("model.mla does not combine with model.layer_pattern, qkv_bias, qk_norm or sliding_window")
    validate_linear_attention(m)
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model} "
                          "(or set model.head_dim)")
    if m.attention == "cudnn" and m.head_size > 128:  # models.attention.CUDNN_MAX_HEAD_DIM
        raise ConfigError(f"model.attention=cudnn: jax's cuDNN flash attention takes heads of up to 128 channels, "
                          f"this model's have {m.head_size}; use attention=chunked or auto on a GPU")


def validate_linear_attention(m: ModelConfig) -> None:
    """Qwen3-Next's hybrid (model.linear_attention, model.rotary_fraction) belongs to model.name qwen3_next."""
    a = m.linear_attention
    if (a is not None) != (m.name == "qwen3_next"):
        raise ConfigError("model.linear_attention is set exactly when model.name is qwen3_next (got name "
                          f"{m.name!r}, linear_attention {'set' if a else 'null'})")
    if m.rotary_fraction != 1.0 and a is None:
        raise ConfigError(f"model.rotary_fraction={m.rotary_fraction}: only model.name qwen3_next rotates part "
                          "of each head; set it to 1.0")
    if a is None:
        return
    if not 0 < m.rotary_fraction <= 1 or int(m.head_size * m.rotary_fraction) % 2:
        raise ConfigError(f"model.rotary_fraction={m.rotary_fraction} must be in (0, 1] and leave an even number "
                          f"of rotating channels of the head's {m.head_size}")
    for k in ("full_attention_interval", "key_heads", "value_heads", "key_head_dim", "value_head_dim",
              "conv_kernel", "chunk"):
        if getattr(a, k) < 1:
            raise ConfigError(f"model.linear_attention.{k}: must be >= 1, got {getattr(a, k)}")
    if a.full_attention_interval < 2 or m.n_layers % a.full_attention_interval:
        raise ConfigError(f"model.linear_attention.full_attention_interval={a.full_attention_interval} must be "
                          f">= 2 and divide model.n_layers={m.n_layers}")
    if a.value_heads % a.key_heads:
        raise ConfigError(f"model.linear_attention.key_heads={a.key_heads} must divide value_heads={a.value_heads}")
    if m.moe.n_experts <= 1 or m.moe.first_dense_layers or m.moe.dense_layers:
        raise ConfigError("model.name qwen3_next: every layer's MLP is a mixture of experts; set model.moe.n_experts "
                          "> 1 and no first_dense_layers / dense_layers")


def validate_moe(e: MoeConfig, n_layers: int) -> None:
    if e.n_experts > 1 and e.router == "sigmoid":
        groups = e.n_groups >= 1 and e.n_experts % e.n_groups == 0 and 1 <= e.topk_groups <= e.n_groups
        if not groups or e.experts_per_token > e.topk_groups * (e.n_experts // e.n_groups):
            raise ConfigError(f"model.moe.n_groups={e.n_groups} must divide model.moe.n_experts={e.n_experts}, "
                              f"model.moe.topk_groups={e.topk_groups} be between 1 and n_groups, and their experts "
                              f"hold model.moe.experts_per_token={e.experts_per_token}")
    if e.n_experts > 1 and not all(0 <= i < n_layers for i in e.dense_layers):
        raise ConfigError(f"model.moe.dense_layers={list(e.dense_layers)}: each must be a layer index, 0 to "
                          f"{n_layers - 1}")
    if e.n_experts > 1 and not 0 <= e.first_dense_layers < n_layers:
        raise ConfigError(f"model.moe.first_dense_layers={e.first_dense_layers} must be between 0 and "
                          f"model.n_layers - 1 = {n_layers - 1}")
    if e.n_experts > 1 and not 1 <= e.experts_per_token <= e.n_experts:
        raise ConfigError(f"model.moe.experts_per_token={e.experts_per_token} must be between 1 and "
                          f"model.moe.n_experts={e.n_experts}")
    if e.n_experts < 0 or e.n_shared_experts < 0:
        raise ConfigError("model.moe.n_experts and model.moe.n_shared_experts must be >= 0")
    if e.capacity_factor is not None and e.capacity_factor <= 0:
        raise ConfigError(f"model.moe.capacity_factor={e.capacity_factor} must be > 0, or null for dropless routing")
    if e.receive_buffer <= 0:
        raise ConfigError(f"model.moe.receive_buffer={e.receive_buffer} must be > 0 (1.25: a quarter over "
                          "a balanced load)")


def validate_lora(m: ModelConfig, comm: CommConfig) -> None:
    """The adapter settings the config alone decides; which weights a model can adapt is the model's to
    say, checked where the model is known (parallel/sharding.check_adapters)."""
    lora = m.lora
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank: must be >= 0 (0: no adapters), got {lora.rank}")
    if lora.rank > 0 and (comm.sync != "every_step" or comm.grad_reduce_dtype != "float32"):
        raise ConfigError("model.lora.rank > 0 needs train.comm.sync=every_step and "
                          "train.comm.grad_reduce_dtype=float32 "
                          "(LoRA with local SGD or compressed gradients is not supported yet)")


def validate_allow_changes(keys: tuple[str, ...]) -> None:
    """checkpoint.allow_changes names config keys or sections."""
    known = config_keys(RunConfig)
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else " (e.g. model.activation, data.path, train.seed)"
            raise ConfigError(f"checkpoint.allow_changes: {shown(key, 100)} is not a config key{hint}")


def config_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a config class, sections included (model, model.moe, model.moe.n_experts, ...)."""
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        keys.append(prefix + name)
        section = next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)
        if section is not None:
            keys += config_keys(section, f"{prefix}{name}.")
    return keys


def validate_run_dir(run_dir: str | None) -> None:
    if is_url(run_dir):
        raise ConfigError(f"run_dir={run_dir}: must be a local directory (metrics, plots); put "
                          "checkpoints on GCS with checkpoint.directory=gs://BUCKET/PATH")


def validate_hardware(cfg: RunConfig, with_mesh: bool = True) -> None:
    """The hardware section, and (with_mesh) mesh.dcn against its slices or nodes: `plan` checks that
    once its flags (--chip, --topology, --slices) have replaced the config's."""
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
    chip = CHIPS.get(hw.chip)
    if chip is None or (chip.tpu_name is None and chip.gpu is None):
        raise ConfigError(f"hardware.topology={hw.topology}: needs hardware.chip to name a TPU (v4, v5e, v5p, v6e, "
                          "tpu7x) or a GPU (a100, h100, h200, b200)")
    dims = hw.topology.split("x")
    if chip.gpu is not None:
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ConfigError(f"hardware.topology={hw.topology!r}: a GPU topology is NODESxGPUS, e.g. 1x8 (one node "
                              "of 8 GPUs) or 2x8")
        if hw.slices != 1:
            raise ConfigError("hardware.slices: TPU slices only; GPU nodes are the first number of hardware.topology")
        nodes, dcn = int(dims[0]), math.prod(getattr(cfg.mesh.dcn, a) for a in MESH_AXES)
        if with_mesh and dcn > 1 and dcn != nodes:
            raise ConfigError(f"mesh.dcn: its product {dcn} must equal the {nodes} node(s) of hardware.topology="
                              f"{hw.topology} (the DCN axes run across the nodes)")
        return
    if not 2 <= len(dims) <= 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ConfigError(f"hardware.topology={hw.topology!r}: expected chips per dimension, e.g. 16x16 or 4x4x8")
    dcn = math.prod(getattr(cfg.mesh.dcn, a) for a in MESH_AXES)
    if with_mesh and dcn > 1 and dcn != hw.slices:
        raise ConfigError(f"mesh.dcn: its product {dcn} must equal hardware.slices={hw.slices} "
                          "(the DCN axes run across the slices)")


def validate_rules(rules: RulesConfig) -> None:
    for logical in dataclasses.fields(RulesConfig):
        for axis in mesh_axes(getattr(rules, logical.name)):
            if axis not in MESH_AXES:
                raise ConfigError(f"rules.{logical.name}: unknown mesh axis '{axis}'; "
                                  f"mesh axes: {', '.join(MESH_AXES)}")
