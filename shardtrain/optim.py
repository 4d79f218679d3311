"""The optax optimizer and learning-rate schedule from the config."""

from __future__ import annotations

import jax
import optax

from models import is_adapter
from shardtrain.config import RunConfig


def schedule(cfg: RunConfig) -> optax.Schedule:
    o = cfg.optimizer
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.learning_rate, warmup_steps=o.warmup_steps,
        decay_steps=max(o.decay_steps or cfg.train.steps, o.warmup_steps + 1),
        end_value=o.learning_rate * o.min_lr_ratio)


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
