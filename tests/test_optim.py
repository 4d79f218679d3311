"""The learning-rate schedule across a resume (optim.resolve_schedule): recorded at the run's start,
kept when train.steps grows, re-planned only by an explicit schedule field, and said in one line."""

import pytest

from shardtrain import config, optim


def resumed_from(*overrides, step: int) -> dict:
    """The meta of checkpoint `step` of a run started with `overrides` (its config as resolved then)."""
    cfg, _ = optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=2", *overrides]), None)
    return {"step": step, "config": config.to_dict(cfg)}


def test_more_steps_keep_the_recorded_decay_and_the_lr_stays_at_its_end():
    cfg, line = optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=2", "train.steps=30"]),
                                       resumed_from("train.steps=20", step=20))
    lr = optim.schedule(cfg)
    assert cfg.optimizer.decay_steps == 20
    assert [float(lr(s)) for s in range(20, 30)] == pytest.approx([3e-4] * 10) and float(lr(19)) > 3e-4
    assert line == ("lr from step 20 (0.0003): 0.0003 from step 20 to 30 (the schedule recorded at the run's "
                    "start; optimizer.decay_steps=N re-plans the decay)")


def test_an_explicit_decay_re_plans_and_says_what_changed():
    cfg, line = optim.resolve_schedule(
        config.load(None, ["optimizer.warmup_steps=2", "train.steps=40", "optimizer.decay_steps=40"]),
        resumed_from("train.steps=20", step=10))
    assert cfg.optimizer.decay_steps == 40
    assert line.startswith("lr from step 10 (0.00") and line.endswith(
        "cosine decay to 0.0003 at step 40 (re-planned: decay_steps 20 -> 40)")


def test_a_checkpoint_from_before_the_schedule_was_recorded_keeps_its_train_steps():
    meta = resumed_from("train.steps=20", step=20)
    meta["config"]["optimizer"]["decay_steps"] = None  # as checkpoints written before this was resolved
    cfg, _ = optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=2", "train.steps=50"]), meta)
    assert cfg.optimizer.decay_steps == 20


def test_a_fresh_run_resolves_decay_to_its_steps():
    cfg, line = optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=2", "train.steps=20"]), None)
    assert cfg.optimizer.decay_steps == 20
    assert line == "lr: linear warmup to 0.003 at step 2, then cosine decay to 0.0003 at step 20"
