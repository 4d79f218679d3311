"""The optax optimizer and learning-rate schedule from the config, and the sharding of its state.

`make`: optimizer.name (adamw, adafactor, muon, lion) after global-norm clipping, only the LoRA
adapters with model.lora.rank > 0. `schedule`: linear warmup, then cosine, wsd (warmup-stable-decay,
a linear decay over the last decay_fraction) or constant; `resolve_schedule` / `describe` keep it
across a resume and say it in one line. `state_specs`: every optimizer-state leaf's PartitionSpec,
derived from its parameter's (step.py turns them into the state's shardings).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from models import is_adapter
from shardtrain.config import ConfigError, OptimizerConfig, RunConfig

SCHEDULE_FIELDS = ("schedule", "learning_rate", "warmup_steps", "decay_steps", "decay_fraction", "min_lr_ratio")
"""The optimizer fields that make the learning-rate schedule."""


def decay_end(cfg: RunConfig) -> int:
    """The step at which the decay reaches its final value (optimizer.decay_steps, default train.steps)."""
    o = cfg.optimizer
    return max(o.decay_steps or cfg.train.steps, o.warmup_steps + 1)


def stable_end(cfg: RunConfig) -> int:
    """wsd: the step its decay starts at, decay_fraction of `decay_end` before it (never inside the warmup)."""
    end = decay_end(cfg)
    return max(end - max(round(cfg.optimizer.decay_fraction * end), 1), cfg.optimizer.warmup_steps)


def schedule(cfg: RunConfig) -> optax.Schedule:
    """Linear warmup from 0 to learning_rate over warmup_steps, then by optimizer.schedule: cosine
    decay to learning_rate x min_lr_ratio at `decay_end`; wsd: learning_rate until `stable_end`, then
    linear decay to learning_rate x min_lr_ratio at `decay_end`; constant: learning_rate. After
    `decay_end` the final value."""
    o = cfg.optimizer
    end, final = decay_end(cfg), o.learning_rate * o.min_lr_ratio
    if o.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=o.learning_rate, warmup_steps=o.warmup_steps, decay_steps=end, end_value=final)
    warmup = optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps)
    if o.schedule == "constant":
        return optax.join_schedules([warmup, optax.constant_schedule(o.learning_rate)], [o.warmup_steps])
    stable = stable_end(cfg)
    return optax.join_schedules(
        [warmup, optax.constant_schedule(o.learning_rate), optax.linear_schedule(o.learning_rate, final, end - stable)],
        [o.warmup_steps, stable])


def recorded_schedule(config: dict) -> dict:
    """The schedule fields of a checkpoint's recorded config (a dict); a field it lacks (recorded before
    the field existed) has its default, and a null decay_steps (recorded before the schedule was
    resolved at the run's start) is that run's train.steps."""
    o, default = config["optimizer"], OptimizerConfig()
    return {**{k: o.get(k, getattr(default, k)) for k in SCHEDULE_FIELDS},
            "decay_steps": o.get("decay_steps") or config["train"]["steps"]}


def check_resume(cfg: RunConfig, resumed: dict | None, directory: str) -> None:
    """A one-line ConfigError when the checkpoint the run resumes from (its meta, `resumed`) was written
    by another optimizer.name: its optimizer state has another structure. (A checkpoint recorded
    before optimizer.name existed was written by AdamW.)"""
    if resumed is None:
        return
    was = resumed["config"]["optimizer"].get("name", OptimizerConfig().name)
    if was != cfg.optimizer.name:
        raise ConfigError(
            f"optimizer.name={cfg.optimizer.name}: checkpoint step {resumed['step']} in {directory} holds {was}'s "
            f"optimizer state; resume with optimizer.name={was}, or start {cfg.optimizer.name} from its weights with "
            f"a fresh optimizer state: checkpoint.init_from={directory}/{resumed['step']} and another run_dir")


def resolve_schedule(cfg: RunConfig, resumed: dict | None) -> tuple[RunConfig, str]:
    """(cfg with a numeric optimizer.decay_steps, one line saying what the LR does in this run).

    The resolved schedule is part of the run's config, so it is recorded in run_dir/config.yaml and
    in every checkpoint's meta. `resumed`: the meta of the checkpoint the run continues from (None
    on a fresh start). With optimizer.decay_steps null a resumed run keeps the decay its checkpoint
    recorded, so raising train.steps continues at the final LR instead of stretching the decay
    over the new length; setting optimizer.decay_steps (or another schedule field) re-plans it, and
    the line says what changed."""
    start, before = (resumed["step"], recorded_schedule(resumed["config"])) if resumed else (0, None)
    decay = cfg.optimizer.decay_steps or (before["decay_steps"] if before else cfg.train.steps)
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, decay_steps=decay))
    changed = [f"{k} {before[k]} -> {getattr(cfg.optimizer, k)}"
               for k in SCHEDULE_FIELDS if before and before[k] != getattr(cfg.optimizer, k)]
    return cfg, describe(cfg, start, changed)


def describe(cfg: RunConfig, start: int = 0, changed: list[str] | None = None) -> str:
    """One line: the learning rate over steps start..train.steps (`changed`: schedule fields that
    differ from the ones the resumed checkpoint recorded)."""
    o, last = cfg.optimizer, cfg.train.steps
    lr, end = o.learning_rate, (o.warmup_steps if o.schedule == "constant" else decay_end(cfg))
    final = lr if o.schedule == "constant" else lr * o.min_lr_ratio
    phases = [(o.warmup_steps, f"linear warmup to {lr:.3g} at step {o.warmup_steps}")]  # (the step it ends at, ...)
    if o.schedule == "cosine":
        phases.append((end, f"cosine decay to {final:.3g} at step {end}"))
    if o.schedule == "wsd":
        phases += [(stable_end(cfg), f"{lr:.3g} to step {stable_end(cfg)}"),
                   (end, f"linear decay to {final:.3g} at step {end}")]
    text = [what for (until, what), (after, _) in zip(phases, [(0, ""), *phases]) if max(start, after) < until]
    text += [f"{final:.3g} from step {max(start, end)} to {last}"] if last > max(start, end) else []
    short = (f"; optimizer.warmup_steps={o.warmup_steps} is past train.steps={last}: the LR ends at "
             f"{float(schedule(cfg)(last)):.3g}, never reaching {lr:.3g}" if o.warmup_steps > last else
             f"; optimizer.warmup_steps={o.warmup_steps} >= optimizer.decay_steps={o.decay_steps}: the decay takes "
             "one step" if o.schedule != "constant" and o.warmup_steps >= (o.decay_steps or last) else "")
    if not start:
        return f"lr: {', then '.join(text)}{short}"
    why = (f"re-planned: {', '.join(changed)}" if changed else "the schedule recorded at the run's start" +
           ("" if o.schedule == "constant" else "; optimizer.decay_steps=N re-plans the decay"))
    return f"lr from step {start} ({float(schedule(cfg)(start)):.3g}): {', then '.join(text)} ({why}){short}"


def make(cfg: RunConfig, names: dict) -> optax.GradientTransformation:
    """optimizer.name after global-norm clipping (no weight decay on norm scales). `names`: the
    parameters' logical axis names (sharding.ParamLayout.names), which tell Muon its matrices. With
    LoRA adapters (model.lora.rank > 0) only they are updated (and clipped, and hold optimizer state)."""
    if cfg.model.lora.rank > 0:
        return optax.multi_transform(
            {"adapter": clipped(cfg, names), "frozen": optax.set_to_zero()},
            lambda params: jax.tree_util.tree_map_with_path(
                lambda path, _: "adapter" if is_adapter(path) else "frozen", params))
    return clipped(cfg, names)


def decayed(params) -> dict:
    """The weight-decay mask: every parameter but the norm scales and the MoE router's balancing
    bias (state the train step moves, models/moe.py `balance_bias`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(s in jax.tree_util.keystr(path) for s in ("norm", "router_bias")), params)


def clipped(cfg: RunConfig, names: dict) -> optax.GradientTransformation:
    """Global-norm clipping, then optimizer.name with the schedule (README: Optimizers and schedules)."""
    return optax.chain(clipping(cfg), unclipped(cfg, names))


def clipping(cfg: RunConfig) -> optax.GradientTransformation:
    """`clipped`'s first part: clipping by the global norm (its state is empty)."""
    return optax.clip_by_global_norm(cfg.optimizer.grad_clip)


def unclipped(cfg: RunConfig, names: dict) -> optax.GradientTransformation:
    """`clipped`'s second part: optimizer.name with the schedule."""
    o, lr = cfg.optimizer, schedule(cfg)
    if o.name == "adamw":
        return optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=decayed)
    if o.name == "lion":
        return optax.lion(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=decayed)
    if o.name == "adafactor":  # optax.adafactor(lr, multiply_by_parameter_scale=False), its weight decay x lr
        return optax.chain(optax.scale_by_factored_rms(), optax.clip_by_block_rms(1.0),
                           optax.add_decayed_weights(o.weight_decay, decayed), optax.scale_by_learning_rate(lr))
    dims = muon_matrices(names)
    return optax.contrib.muon(
        lr, weight_decay=o.weight_decay, adam_b1=o.b1, adam_b2=o.b2, consistent_rms=0.2,
        muon_weight_dimension_numbers=lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: dims[jax.tree_util.keystr(path)], params))


STACKED = ("layers", "experts")
"""Logical axes that stack independent matrices (scanned layers, experts): Muon's batch axes."""


def muon_matrices(names: dict) -> dict:
    """Parameter path -> how Muon sees that parameter as (a stack of) matrices, or None: AdamW.

    As Muon's authors run it, embeddings and the output head (a `vocab` axis) and parameters with
    fewer than two axes besides the STACKED ones (norm scales) go to AdamW. The other axes form
    one matrix, split where `embed` sits: `wq_dhe` is D x (H*E), `wo_hed` (H*E) x D; without an
    `embed` axis at either end, the first axis against the rest."""
    def matrix(n: tuple):
        axes = [i for i, a in enumerate(n) if a not in STACKED]
        if "vocab" in n or len(axes) < 2:
            return None
        embed = ("embed", "expert_embed")
        if n[axes[-1]] in embed and n[axes[0]] not in embed:
            return optax.contrib.MuonDimensionNumbers(reduction_axis=tuple(axes[:-1]), output_axis=(axes[-1],))
        return optax.contrib.MuonDimensionNumbers(reduction_axis=(axes[0],), output_axis=tuple(axes[1:]))
    leaves = jax.tree_util.tree_leaves_with_path(names, is_leaf=lambda x: isinstance(x, tuple))
    return {jax.tree_util.keystr(path): matrix(n) for path, n in leaves}


@dataclasses.dataclass(frozen=True)
class Owner:
    """The parameter an optimizer-state leaf belongs to (a pytree leaf: `state_specs` maps it)."""

    shape: tuple
    spec: P


def state_specs(tx: optax.GradientTransformation, params: dict):
    """The PartitionSpec of every leaf of `tx`'s state for `params` (ShapeDtypeStructs with shardings).

    A leaf in a parameter's place takes that parameter's spec when it has its shape (moments),
    the spec less the averaged-out axis for Adafactor's factored row and column statistics
    (`v_row` averages out the parameter's largest axis, `v_col` its second largest, as
    optax.scale_by_factored_rms picks them), and P() when it is a size-1 placeholder; leaves outside
    the parameters' places (counters, Muon's coefficients) are replicated. Any other shape is an
    error naming the leaf, never a silently replicated or mis-sharded state. MaskedNode (a
    parameter without state: frozen by LoRA, or on Muon's other side) stays as it is."""
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    opt_state = jax.eval_shape(tx.init, params)
    owners = optax.tree_map_params(tx, lambda x, p: x if masked(x) else Owner(tuple(p.shape), p.sharding.spec),
                                   opt_state, params, transform_non_params=lambda _: None, is_leaf=masked)

    def spec(path, leaf, owner: Owner | None) -> P:
        shape = tuple(leaf.shape)
        if owner is None:
            return P()
        if shape == owner.shape:
            return owner.spec
        if shape == (1,):
            return P()
        entries = (*owner.spec, *(None,) * (len(owner.shape) - len(owner.spec)))
        fields = {getattr(k, "name", None) for k in path} & {"v_row", "v_col"}
        if fields and len(owner.shape) >= 2:
            second, largest = (int(a) for a in np.argsort(owner.shape)[-2:])
            axis = largest if fields == {"v_row"} else second
            if shape == owner.shape[:axis] + owner.shape[axis + 1:]:
                return P(*entries[:axis], *entries[axis + 1:])
        raise ValueError(f"optimizer state {jax.tree_util.keystr(path)} {shape} of a parameter {owner.shape}: "
                         "no rule for its sharding (shardtrain/optim.py state_specs)")
    return jax.tree_util.tree_map_with_path(spec, opt_state, owners)
