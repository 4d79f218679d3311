"""The optax optimizer and learning-rate schedule from the config."""

from __future__ import annotations

import dataclasses

import jax
import optax

from models import is_adapter
from shardtrain.config import RunConfig

SCHEDULE_FIELDS = ("learning_rate", "warmup_steps", "decay_steps", "min_lr_ratio")
"""The optimizer fields that make the learning-rate schedule."""


def decay_end(cfg: RunConfig) -> int:
    """The step at which the cosine decay reaches its final value (optimizer.decay_steps, default train.steps)."""
    o = cfg.optimizer
    return max(o.decay_steps or cfg.train.steps, o.warmup_steps + 1)


def schedule(cfg: RunConfig) -> optax.Schedule:
    """Linear warmup to learning_rate, cosine decay to learning_rate x min_lr_ratio at `decay_end`,
    that value after it."""
    o = cfg.optimizer
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.learning_rate, warmup_steps=o.warmup_steps,
        decay_steps=decay_end(cfg), end_value=o.learning_rate * o.min_lr_ratio)


def recorded_schedule(config: dict) -> dict:
    """The schedule fields of a checkpoint's recorded config (a dict); a null decay_steps (recorded
    before the schedule was resolved at the run's start) is that run's train.steps."""
    o = config["optimizer"]
    return {**{k: o.get(k) for k in SCHEDULE_FIELDS}, "decay_steps": o.get("decay_steps") or config["train"]["steps"]}


def resolve_schedule(cfg: RunConfig, resumed: dict | None) -> tuple[RunConfig, str]:
    """(cfg with a numeric optimizer.decay_steps, one line saying what the LR does in this run).

    The resolved schedule is part of the run's config, so it is recorded in run_dir/config.yaml and
    in every checkpoint's meta. `resumed`: the meta of the checkpoint the run continues from (None
    on a fresh start). With optimizer.decay_steps null a resumed run keeps the decay its checkpoint
    recorded, so raising train.steps continues at the final LR instead of stretching the cosine
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
    o, end, last = cfg.optimizer, decay_end(cfg), cfg.train.steps
    final = o.learning_rate * o.min_lr_ratio
    phases = [f"linear warmup to {o.learning_rate:.3g} at step {o.warmup_steps}"] if start < o.warmup_steps else []
    phases += [f"cosine decay to {final:.3g} at step {end}"] if start < end else []
    phases += [f"{final:.3g} from step {max(start, end)} to {last}"] if last > max(start, end) else []
    if not start:
        return f"lr: {', then '.join(phases)}"
    why = (f"re-planned: {', '.join(changed)}" if changed else
           "the schedule recorded at the run's start; optimizer.decay_steps=N re-plans the decay")
    return f"lr from step {start} ({float(schedule(cfg)(start)):.3g}): {', then '.join(phases)} ({why})"


def make(cfg: RunConfig) -> optax.GradientTransformation:
    """AdamW (no weight decay on norm scales) after global-norm clipping. With LoRA adapters
    (model.lora.rank > 0) only they are updated (and clipped, and hold optimizer state)."""
    if cfg.model.lora.rank > 0:
        return optax.multi_transform(
            {"adapter": adamw(cfg), "frozen": optax.set_to_zero()},
            lambda params: jax.tree_util.tree_map_with_path(
                lambda path, _: "adapter" if is_adapter(path) else "frozen", params))
    return adamw(cfg)


def adamw(cfg: RunConfig) -> optax.GradientTransformation:
    o = cfg.optimizer
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(schedule(cfg), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay,
                    mask=lambda params: jax.tree_util.tree_map_with_path(
                        lambda path, _: "norm" not in jax.tree_util.keystr(path), params)),
    )
