"""Evaluation on the held-out split: a jitted, sharded forward pass (no gradients) over the first
train.eval_steps batches of the `eval` split, shared by training (train.eval_every) and
`shardtrain eval [CONFIG] CHECKPOINT`.

eval_loss is the token-weighted mean cross-entropy over every counted position of those batches
(packed data: the positions the training loss counts), eval_perplexity its exp. A split smaller than
those batches is read around again (its windows counted twice); the Evaluator says so once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import jax

from shardtrain import config as config_lib
from shardtrain.config import ConfigError, RunConfig
from shardtrain.data import loader, token_shards
from shardtrain.step import Program


class Evaluator:
    """The held-out loss of a program's parameters, through its `eval_step`."""

    def __init__(self, prog: Program, in_training: bool = True):
        self.prog = prog
        try:  # a missing eval split fails before anything is compiled
            opened = loader.sources(prog.cfg, "eval")
        except token_shards.EmptySplit as e:
            raise ConfigError(f"{e}, or train without evaluation: train.eval_every=0" if in_training else str(e)) \
                from None
        self.dataset = loader.eval_samples(prog.cfg, opened)
        line = rereads(prog.cfg, opened)
        if line and jax.process_index() == 0:  # (`shardtrain eval`'s stdout is its JSON row)
            print(line, file=sys.stdout if in_training else sys.stderr, flush=True)

    def __call__(self, params) -> dict[str, float]:
        cfg = self.prog.cfg
        total = count = 0.0
        batches = loader.batches(self.dataset, cfg.train.global_batch_size, self.prog.local_rows(), 0,
                                 cfg.train.eval_steps, loader.read_threads(cfg))
        sums = [self.prog.eval_step(params, self.prog.device_batch(batch)) for _, batch in batches]
        for loss_sum, n in sums:
            total, count = total + float(loss_sum), count + float(n)
        loss = total / max(count, 1.0)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": count}


def rereads(cfg: RunConfig, opened: list) -> str | None:
    """A line when an evaluation reads more windows than the held-out split (a mixture: one of its
    datasets, by its weight) holds, so that it wraps around and counts some of them twice."""
    batch = cfg.train.global_batch_size
    reads = cfg.train.eval_steps * batch
    weights = [e.weight for e in cfg.data.mixture] or [1.0]
    names = [f" of {e.path}" for e in cfg.data.mixture] or [""]
    for split, weight, name in zip(opened, weights, names):
        share = weight / sum(weights)
        if math.ceil(reads * share) > len(split):
            fits = max(int(len(split) / share) // batch, 1)
            return (f"eval: each evaluation reads {reads} windows (train.eval_steps={cfg.train.eval_steps} x "
                    f"train.global_batch_size={batch}), but the held-out split{name} has {len(split)}: it reads "
                    f"some twice and counts their tokens again; train.eval_steps={fits} reads each at most once")
    return None


def main(cfg: RunConfig, checkpoint_path: str) -> int:
    """`shardtrain eval [CONFIG] CHECKPOINT`: prints one JSON line {step, eval_loss, eval_perplexity}."""
    from shardtrain import step as step_lib
    from shardtrain.checkpoint import listing, manager
    from shardtrain.parallel import mesh as mesh_lib
    directory, step = listing.locate(checkpoint_path)
    directory = config_lib.absolute(directory)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, directory=directory))
    loader.eval_samples(cfg)  # data errors before compiling
    prog = step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    evaluator = Evaluator(prog, in_training=False)
    ckpt = manager.Checkpointer(prog.cfg, prog.abstract_state, prog.mesh.shape)
    try:
        if step is None:
            step = ckpt.latest_step()
            if step is None:
                raise ConfigError(f"no committed checkpoint in {directory}")
        state, _ = ckpt.restore_given(step)
    finally:
        ckpt.close()
    row = {"step": step, **evaluator(state["params"])}
    if jax.process_index() == 0:
        print(json.dumps(row), flush=True)
    return 0
