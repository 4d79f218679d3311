"""Orbax async checkpoints: save the train state and run metadata, restore into any mesh.

A checkpoint at step N holds the state after N updates (params, optimizer state, step) and a
JSON `meta` item: the data position in global samples, the mesh it was written from and the
resolved config. Randomness derives from (train.seed, step), so no RNG state is needed beyond
the step. Restoring targets the shardings of the *current* config, so a run resumes onto any mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import orbax.checkpoint as ocp

from shardtrain import config as config_lib
from shardtrain.step import Program


class Checkpointer:
    def __init__(self, prog: Program):
        cfg = prog.cfg
        self.prog, self.cfg = prog, cfg
        c = cfg.checkpoint
        options = ocp.CheckpointManagerOptions(
            max_to_keep=c.max_to_keep, keep_period=c.keep_period, enable_async_checkpointing=True, create=True)
        self.manager = ocp.CheckpointManager(cfg.checkpoint_dir(), options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, step: int) -> tuple[dict, dict]:
        """The state (already in this run's shardings) and metadata saved at `step`."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(self.prog.abstract_state), meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def save(self, step: int, state: dict) -> None:
        """Starts an async save of `state` (after `step` updates); returns once arrays are copied."""
        meta = {
            "step": step,
            "data_position": step * self.cfg.train.global_batch_size,
            "mesh": dict(self.prog.mesh.shape),
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "config": dataclasses.asdict(self.cfg),
        }
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        """Blocks until every pending save is committed; raises if one failed."""
        self.manager.wait_until_finished()
        self.manager.check_for_errors()

    def close(self) -> None:
        self.manager.close()


def start_step_from(meta: dict, cfg: config_lib.RunConfig) -> int:
    position, batch = meta["data_position"], cfg.train.global_batch_size
    if position % batch:
        raise config_lib.ConfigError(
            f"train.global_batch_size={batch} does not divide the checkpoint's data position ({position} samples)")
    return position // batch
