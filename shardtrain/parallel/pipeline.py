"""Pipeline parallelism over the `pipeline` mesh axis: GPipe and circular (interleaved) schedules.

The stacked blocks (leading axis `layers`, L layers) are split into P stages x v repeats groups
of Lg = L / (P v) consecutive layers; group g = r P + p runs on stage p (v = 1: GPipe, each stage
holds one contiguous group; v > 1: circular, each stage holds v non-adjacent groups). The batch
is split into M micro-batches that flow around the ring of stages inside one
`jax.shard_map` that is manual over `pipeline` only (data, fsdp and tensor stay automatic inside
each stage), with `jax.lax.ppermute` passing activations to the next stage.

Schedule (MaxText's circular pipeline; GPipe is v = 1): at iteration t stage p works on
micro-batch (t - p) mod M in repeat (t - p) // M, so micro-batch m meets group r P + p at
t = r M + m + p. Stage P-1's output goes around the ring to stage 0, which parks it in a
buffer of M micro-batches (initially the inputs) until its next repeat starts, and which holds
the final outputs at the end. T = v M + P - 1 iterations of Lg layers each, of which v M are
useful per stage: bubble fraction (P - 1) / (v M + P - 1). Needs M >= P when v > 1.
Gradients come from autodiff through the loop (all forwards, then all backwards).

Layer placement: parameters stay stored in the model's own layer order (checkpoints and init do
not depend on the schedule), sharded contiguously over `pipeline`. For v > 1 the runner regroups
them each step, (L,) -> (v, P, Lg) -> (P, v, Lg), which XLA turns into an all-to-all of the
block parameters over `pipeline` (and one of their gradients back), never a gather of the stack.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardtrain.config import ConfigError, RunConfig
from shardtrain.parallel import sharding, timetable
from shardtrain.parallel.blocks import scan_runner

AXIS = "pipeline"


def _repeats(cfg: RunConfig) -> int:
    return cfg.train.pipeline.repeats if cfg.train.pipeline.schedule in ("circular", "interleaved_1f1b") else 1


def _rows_per_replica(cfg: RunConfig, mesh: Mesh) -> int:
    """Rows of one gradient-accumulation chunk held by one data-parallel replica (batch ways)."""
    ways = sharding.axes_size(mesh, sharding.spec_for(("batch",), cfg.rules, mesh)[0])
    return cfg.train.global_batch_size // cfg.train.grad_accum_steps // ways


def microbatches(cfg: RunConfig, mesh: Mesh) -> int:
    """train.pipeline.microbatches, or by default the largest M <= 4 P dividing each replica's rows
    (bubble (P-1)/(vM+P-1) <= 1/5 for GPipe), and at least P for the circular schedule."""
    if cfg.train.pipeline.microbatches is not None:
        return cfg.train.pipeline.microbatches
    stages, rows = mesh.shape[AXIS], _rows_per_replica(cfg, mesh)
    return max([m for m in range(1, 4 * stages + 1) if rows % m == 0] or [1])


class Schedule(NamedTuple):
    """A checked pipeline schedule (`check`); step.build computes it once, `Program.schedule`."""

    stages: int
    """P: the size of the `pipeline` mesh axis."""
    repeats: int
    """v: groups of layers per stage (1: GPipe; > 1: circular)."""
    microbatches: int
    """M: the micro-batches each data replica's rows are cut into."""
    name: str = "gpipe"
    """train.pipeline.schedule: `gpipe` / `circular` (autodiff through the loop, here) or one of
    `timetable.SCHEDULES` (explicit forwards and backwards, schedules.py)."""

    @property
    def explicit(self) -> bool:
        """Built by schedules.py from a timetable (1F1B, interleaved 1F1B, zero-bubble)."""
        return self.name in timetable.SCHEDULES

    @property
    def bubble_fraction(self) -> float:
        """Ideal idle fraction of the schedule: (P - 1) / (v M + P - 1) for GPipe and circular; the
        timetable's idle slots for the explicit schedules (every F, B and W one slot)."""
        if self.explicit:
            return self.timetable().bubble_fraction()
        return (self.stages - 1) / (self.repeats * self.microbatches + self.stages - 1)

    def timetable(self) -> timetable.Timetable:
        return timetable.timetable(self.name, self.stages, self.microbatches, self.repeats)

    @property
    def live_microbatches(self) -> int:
        """The most micro-batches whose activations one stage holds at once: all M (times v) for
        GPipe and circular, the timetable's bound for the explicit schedules."""
        return self.timetable().live if self.explicit else self.repeats * self.microbatches


def check(cfg: RunConfig, mesh: Mesh) -> Schedule:
    """(stages P, repeats v, micro-batches M); ConfigError for a layout that does not divide."""
    t, stages, layers = cfg.train, mesh.shape[AXIS], cfg.model.n_layers
    v = _repeats(cfg)
    if layers % (stages * v):
        raise ConfigError(
            f"model.n_layers={layers} does not split evenly into mesh.pipeline={stages} stages x "
            f"train.pipeline.repeats={v} repeats ({stages * v} groups of layers); make n_layers a "
            f"multiple of {stages * v} or change mesh.pipeline / train.pipeline.repeats")
    group, pattern = layers // (stages * v), len(cfg.model.layer_pattern)
    if pattern > 1 and group % pattern:
        raise ConfigError(
            f"each pipeline stage runs {group} consecutive layers, not a multiple of model.layer_pattern's "
            f"{pattern} kinds: every stage's layers must start at the pattern's start; change mesh.pipeline / "
            "train.pipeline.repeats")
    m = microbatches(cfg, mesh)
    batch = t.global_batch_size // t.grad_accum_steps
    rows = _rows_per_replica(cfg, mesh)
    if m < 1 or rows % m:
        raise ConfigError(
            f"train.pipeline.microbatches={m} must divide the {rows} rows per data replica (train.global_batch_size="
            f"{t.global_batch_size} / train.grad_accum_steps={t.grad_accum_steps} = {batch}, split "
            f"{batch // max(rows, 1)} ways by rules.batch); choose a divisor of {rows}")
    name = t.pipeline.schedule
    if v > 1 and m < stages:
        raise ConfigError(f"train.pipeline.microbatches={m} must be >= mesh.pipeline={stages} for the {name} "
                          f"schedule; raise train.pipeline.microbatches or train.global_batch_size")
    if name == "interleaved_1f1b" and m % stages:
        raise ConfigError(f"train.pipeline.microbatches={m} must be a multiple of mesh.pipeline={stages} for the "
                          f"interleaved_1f1b schedule (it runs P micro-batches per repeat at a time)")
    return Schedule(stages, v, m, name)


def bubble_fraction(cfg: RunConfig, mesh: Mesh) -> float:
    """Ideal idle fraction of the schedule: (P - 1) / (v M + P - 1)."""
    return check(cfg, mesh).bubble_fraction


def runner(cfg: RunConfig, mesh: Mesh, schedule: Schedule | None = None):
    """`run_blocks(blocks, x_btd, **docs) -> x_btd`: the stacked blocks as a pipeline over `pipeline`
    by `schedule` (default: `check(cfg, mesh)`). Packed documents (`docs`: segment_ids_bt,
    positions_bt) are cut into the same micro-batches, held by every stage, and stage p reads those
    of the micro-batch it is working on."""
    stages, v, m_count = (schedule or check(cfg, mesh))[:3]
    group = cfg.model.n_layers // (stages * v)
    run_group = scan_runner(cfg)
    ring = [(i, (i + 1) % stages) for i in range(stages)]
    batch_axes = sharding.spec_for(("batch",), cfg.rules, mesh)[0]

    def run(blocks, x_btd, **docs):
        graphdef, state = nnx.split(blocks)
        # (L, ...) -> (P, v, Lg, ...): stage p holds groups r P + p (a no-op regrouping when v = 1)
        staged = jax.tree.map(lambda w: w.reshape(v, stages, group, *w.shape[1:]).swapaxes(0, 1), state)
        b, t, d = x_btd.shape
        # micro-batch m = rows i M + m: each device's rows stay local
        x_mbtd = x_btd.reshape(b // m_count, m_count, t, d).swapaxes(0, 1)  # (M, B/M, T, D)
        x_mbtd = jax.lax.with_sharding_constraint(x_mbtd, NamedSharding(mesh, P(None, batch_axes)))
        docs_mbt = {k: jax.lax.with_sharding_constraint(
            doc_bt.reshape(b // m_count, m_count, t).swapaxes(0, 1), NamedSharding(mesh, P(None, batch_axes)))
            for k, doc_bt in docs.items()}

        def pipeline(staged, x_mbtd, docs_mbt):
            staged = jax.tree.map(lambda w: w[0], staged)  # (v, Lg, ...) on this stage
            stage = jax.lax.axis_index(AXIS)
            buffer_mbtd = jax.lax.pcast(x_mbtd, (AXIS,), to="varying").astype(dtype)

            def iteration(carry, step):
                buffer_mbtd, out_btd = carry
                recv_btd = jax.lax.ppermute(out_btd, AXIS, ring)
                # stage 0 parks what stage P-1 finished (micro-batch (step - P) mod M) until reused
                slot = (step - stages) % m_count
                keep = (stage == 0) & (step >= stages)
                buffer_mbtd = buffer_mbtd.at[slot].set(jnp.where(keep, recv_btd, buffer_mbtd[slot]))
                in_btd = jnp.where(stage == 0, buffer_mbtd[step % m_count], recv_btd)
                repeat = jnp.clip((step - stage) // m_count, 0, v - 1)
                layers = jax.tree.map(lambda w: w[repeat], staged)
                # this stage works on micro-batch (step - stage) mod M: its documents
                docs_bt = {k: v[(step - stage) % m_count] for k, v in docs_mbt.items()}
                return (buffer_mbtd, run_group(nnx.merge(graphdef, layers), in_btd, **docs_bt)), None

            out_btd = jnp.zeros_like(buffer_mbtd[0])
            steps = jnp.arange(v * m_count + stages - 1)
            buffer_mbtd, out_btd = jax.lax.scan(iteration, (buffer_mbtd, out_btd), steps)[0]
            # the last micro-batch's final output is still on stage P-1
            recv_btd = jax.lax.ppermute(out_btd, AXIS, ring)
            buffer_mbtd = buffer_mbtd.at[m_count - 1].set(recv_btd)
            return jax.lax.psum(jnp.where(stage == 0, buffer_mbtd, 0).astype(jnp.float32), AXIS)

        # The two all-reduces over `pipeline` (the outputs, and the inputs' cotangent) run in f32:
        # in bf16 XLA's CPU compiler aborts in AllReducePromotion ("Invalid binary instruction opcode copy").
        # check_vma=False: splash attention's Pallas kernel (TPU) returns cotangents that do not say they vary
        # over `pipeline` (jax 0.12), which the check refuses; tests/parallel/test_pipeline.py checks the
        # gradients against the plain step's.
        dtype = x_mbtd.dtype
        y_mbtd = jax.shard_map(pipeline, mesh=mesh, in_specs=(P(AXIS), P(), P()), out_specs=P(),
                               axis_names={AXIS}, check_vma=False)(staged, x_mbtd.astype(jnp.float32), docs_mbt)
        return y_mbtd.astype(dtype).swapaxes(0, 1).reshape(b, t, d)

    return run
