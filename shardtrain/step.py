"""Builds the one jit-compiled, sharded train step. `train` and `plan` both call `build`, so the
planner's numbers are the trainer's. `build` is also the single producer of what later code
needs: the `Program` it returns carries the parameter layout, the optimizer, the fresh-state
function, the pipeline schedule, the eval step and the model's FLOPs per token, each made once
(evaluation, checkpoints, `init_from`, metrics and the planner read them instead of rebuilding).

Train state (a plain dict pytree, checkpointed as is; spelled once, in `fresh_state_fn`):
  params: the model's parameters (pure nested dict, param_dtype, sharded by the rules)
  opt:    optax state, sharded exactly like the parameters
  (train.offload puts opt, and params, in the host's pinned memory: `offloaded`)
  step:   int32 scalar
  comm, replicas: only with compressed reduction / local SGD (see comm.py)
  reference: only with train.objective=dpo|grpo and a frozen reference: the starting params (dpo.py)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import models
from models import attention
from shardtrain import dpo, grpo, offload, optim
from shardtrain.config import ConfigError, RunConfig
from shardtrain.data import loader, preference
from shardtrain.loss import n_chunks, weighted_cross_entropy_sum
from shardtrain.parallel import comm, pipeline, schedules, sharding
from shardtrain.parallel.blocks import scan_runner


@dataclasses.dataclass
class Program:
    """The compiled step and everything later code needs from the build (computed once there)."""

    cfg: RunConfig
    mesh: Mesh
    layout: sharding.ParamLayout
    """The model's structure and its parameters' shapes, logical names and shardings."""
    tx: optax.GradientTransformation
    """The optimizer the step applies."""
    schedule: pipeline.Schedule | None
    """The pipeline's (stages, repeats, micro-batches); None without pipeline parallelism."""
    flops_per_token: float
    """Model FLOPs per trained token (forward + backward), as the model reports them (6N, the
    matmuls alone, for a model that does not)."""
    state_shardings: dict
    batch_sharding: NamedSharding
    abstract_state: dict
    """ShapeDtypeStructs with shardings: the state without allocating it."""
    init: Callable
    """jitted seed -> state, created already sharded."""
    fresh_state: Callable
    """jitted params -> state around them (step 0, fresh optimizer state), sharded; the params are
    donated."""
    step: Callable
    """jitted (state, batch) -> (state, metrics), state donated."""
    loss_sums: Callable
    """(params, batch) -> (summed token loss, counted tokens), unjitted."""
    eval_step: Callable
    """`loss_sums` jitted, both sums replicated (evaluate.py)."""
    loss_and_grads: Callable
    """jitted (params, batch) -> (losses, gradients) of the step, before any cross-replica
    reduction mode or update (tests compare meshes with it)."""

    def abstract_batch(self):
        """The global batch: int32 (B, T+1) tokens, or for packed data a dict of PACKED_FIELDS of them
        (preference pairs: of preference.PAIR_FIELDS)."""
        t = self.cfg.train
        x = jax.ShapeDtypeStruct((t.global_batch_size, self.cfg.data.seq_len + 1), jnp.int32,
                                 sharding=self.batch_sharding)
        if t.objective == "dpo":
            return {k: x for k in preference.PAIR_FIELDS}
        if t.objective == "grpo":  # prompt + completion rows (grpo.py)
            return {"tokens": x, "mask": x, "advantages": x.update(dtype=jnp.float32)}
        return {k: x for k in PACKED_FIELDS} if loader.packed(self.cfg) else x

    def generation_cache(self) -> dict:
        """train.objective=grpo: the KV cache the generator fills for a step's rows at full length
        (ShapeDtypeStructs with the rules' shardings, as generate.py lays it out); else {}."""
        if self.cfg.train.objective != "grpo":
            return {}
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.train.compute_dtype)
        shapes = self.layout.model_class.cache_layout(cfg.model, *self.batch_shape())
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, sharding.spec_for(
                    names, cfg.rules, self.mesh, shape=shape, what=f"KV cache {shape}")))
                for k, (shape, names) in shapes.items()}

    def batch_shape(self) -> tuple[int, int]:
        return (self.cfg.train.global_batch_size, self.cfg.data.seq_len + 1)

    def device_batch(self, local_batch):
        """This process's rows (numpy, as loader.batches yields them) -> the global device batch."""
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
            self.batch_sharding, x, self.batch_shape()), local_batch)

    def param_count(self) -> int:
        return param_count(self.layout)

    def lower(self):
        return self.step.lower(self.abstract_state, self.abstract_batch())

    def local_rows(self) -> slice:
        """Rows of the global batch held by this process's devices (a contiguous block)."""
        return self.rows_for(self.batch_sharding.addressable_devices)

    def rows_for(self, devices) -> slice:
        """Rows of the global batch held by `devices` (one process's: a contiguous block)."""
        index_map = self.batch_sharding.devices_indices_map(self.batch_shape())
        rows = [index_map[d][0] for d in devices]
        return slice(min(r.start or 0 for r in rows),
                     max(self.cfg.train.global_batch_size if r.stop is None else r.stop for r in rows))


PACKED_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")


def unpack(batch):
    """A batch -> (inputs_bt, targets_bt, segment_ids_bt, positions_bt, weights_bt).

    Unpacked (an int array): every position counts, segment ids and positions are None. Packed
    (a dict): position t is masked when its input and target lie in different documents (the
    input is an EOS, the target the next document's first token), or when the batch's loss_mask
    (optional; chat data) is 0 at the target (a prompt token); EOS itself is predicted."""
    if not isinstance(batch, dict):
        return batch[:, :-1], batch[:, 1:], None, None, jnp.ones(batch[:, 1:].shape, jnp.float32)
    tokens, seg = batch["tokens"], batch["segment_ids"]
    weights_bt = (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
    if "loss_mask" in batch:
        weights_bt = weights_bt * batch["loss_mask"][:, 1:].astype(jnp.float32)
    return tokens[:, :-1], tokens[:, 1:], seg[:, :-1], batch["positions"][:, :-1], weights_bt


def param_count(layout: sharding.ParamLayout, where: Callable | None = None) -> int:
    """The parameters of `layout`; with `where`, those whose key path `where(path)` accepts."""
    return sum(math.prod(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(layout.params)
               if where is None or where(path))


def flops_per_token(cfg: RunConfig, layout: sharding.ParamLayout) -> float:
    """Model FLOPs per trained token (forward + backward), as the model reports them (6N, the
    matmuls alone, for a model that does not)."""
    report = getattr(layout.model_class, "flops_per_token", None)
    n_params = param_count(layout)
    return 6 * n_params if report is None else report(cfg.model, n_params, cfg.data.seq_len)


# ----------------------------------------------------------------------------- the pieces of `build`


def pipeline_schedule(cfg: RunConfig, mesh: Mesh, constrain: sharding.Constrain) -> pipeline.Schedule | None:
    """(stages, repeats, micro-batches) of the pipeline over `pipeline` when that axis is > 1 (its
    errors name layers, stages, repeats), else None."""
    if mesh.shape["pipeline"] == 1:
        return None
    if constrain.size("seq") > 1:
        raise ConfigError("mesh.pipeline > 1 does not combine with context parallelism (mesh.context > 1) yet: the "
                          "ring attention's shard_map reorders each sequence across devices, which the stages' "
                          "micro-batches do not follow; use mesh.pipeline=1 or mesh.context=1")
    if cfg.model.linear_attention is not None:
        raise ConfigError("mesh.pipeline > 1 does not run model.name=qwen3_next yet: its blocks are groups of "
                          "DeltaNet and attention layers, which the stages do not split; use mesh.pipeline=1")
    schedule = pipeline.check(cfg, mesh)
    moe = cfg.model.moe
    if moe.n_experts > 1 and not schedule.explicit:
        raise ConfigError(f"train.pipeline.schedule={schedule.name} does not combine with MoE (model.moe.n_experts "
                          "> 1): its autodiff through the stage loop drops the router's auxiliary losses; use "
                          "train.pipeline.schedule=1f1b, interleaved_1f1b or zero_bubble")
    if moe.n_experts > 1 and (moe.router == "sigmoid" or moe.router_aux_loss_coef or moe.router_z_loss_coef):
        raise ConfigError(f"train.pipeline.schedule={schedule.name} with MoE needs model.moe.router_aux_loss_coef=0, "
                          "model.moe.router_z_loss_coef=0 and not model.moe.router=sigmoid for now: the schedule runs "
                          "micro-batch by micro-batch and returns no auxiliary losses or router loads (they are batch "
                          "statistics)")
    if schedule.explicit and comm.enabled(cfg):
        raise ConfigError(f"train.pipeline.schedule={schedule.name} does not combine with train.comm.grad_reduce_dtype "
                          "/ train.comm.sync (compressed reduction, local SGD) yet: comm.py differentiates each "
                          "replica's loss inside its own shard_map, where the schedule's shard_map over the whole mesh "
                          "cannot run; use train.pipeline.schedule=gpipe or circular")
    return schedule


def blocks_runner(cfg: RunConfig, mesh: Mesh, schedule: pipeline.Schedule | None) -> Callable | None:
    """`run_blocks(blocks, x_btd, **docs) -> x_btd`: the pipeline of `schedule`, or without one a scan;
    None for an explicit schedule (it runs embedding, blocks and head itself: `loss_sums_fn`)."""
    if schedule is not None and schedule.explicit:
        return None
    return scan_runner(cfg) if schedule is None else pipeline.runner(cfg, mesh, schedule)


def context_order(cfg: RunConfig, mesh: Mesh, constrain: sharding.Constrain) -> Callable | None:
    """Under context parallelism (`seq` split n ways, n > 1), `reorder(x_bt)`: x's positions in the
    causal load-balanced order (chunks i and 2n-1-i of 2n on device i; models/attention.py),
    split over `seq`; else None. The loss feeds every field of the batch in this order, positions
    included: the summed loss is the same in any order, so nothing is un-permuted."""
    n = constrain.size("seq")
    if n == 1:
        return None
    if cfg.model.linear_attention is not None:
        raise ConfigError("mesh.context > 1 does not run model.name=qwen3_next yet: its DeltaNet layers scan each "
                          "sequence in order, which context parallelism's load-balanced order breaks; "
                          "use mesh.context=1")
    if comm.enabled(cfg):
        raise ConfigError("mesh.context > 1 does not combine with train.comm.sync=local_sgd or a compressed "
                          "train.comm.grad_reduce_dtype yet; use mesh.context=1")
    if cfg.data.seq_len % (2 * n):
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} must be a multiple of 2 x the {n} ways rules.seq "
                          f"splits it (mesh.context): context parallelism gives each device two chunks")
    local, chunk = cfg.data.seq_len // n, cfg.train.loss_chunk
    if 0 < chunk < local and local % chunk:
        raise ConfigError(f"train.loss_chunk={chunk} must divide the {local} positions of data.seq_len="
                          f"{cfg.data.seq_len} each of the {n} context-parallel devices holds (or be >= {local}); "
                          f"e.g. train.loss_chunk={math.gcd(chunk, local)}")
    order_t = jnp.asarray(attention.load_balanced_order(cfg.data.seq_len, n))
    return lambda x_bt: constrain(x_bt[:, order_t], ("batch", "seq"))


def state_shardings(cfg: RunConfig, mesh: Mesh, tx: optax.GradientTransformation,
                    layout: sharding.ParamLayout) -> dict:
    """Shardings of the train state: parameters by the rules, optimizer state like its parameters
    (`optim.state_specs`; `jax.jit(tx.init)` alone would replicate it), scalars replicated; the
    entries train.offload names in pinned host memory."""
    replicated = NamedSharding(mesh, P())
    opt_shardings = sharding.named(mesh, optim.state_specs(tx, layout.params))
    shardings = {"params": layout.shardings, "opt": opt_shardings, "step": replicated}
    on_host = offloaded(cfg)
    return {k: jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), v) if k in on_host else v
            for k, v in shardings.items()}


def offloaded(cfg: RunConfig) -> tuple[str, ...]:
    """The state entries train.offload keeps in the host's pinned memory ("opt", "params")."""
    o = cfg.train.offload
    return (("opt",) if o.optimizer else ()) + (("params",) if o.params else ())


def to_device(state: dict, shardings: dict, keys) -> dict:
    """Inside the step: the state with entries `keys` (offloaded ones) brought to device memory."""
    return {**state, **{k: jax.device_put(state[k], jax.tree.map(lambda s: s.with_memory_kind("device"), shardings[k]))
                        for k in keys}}


def batch_sharding(cfg: RunConfig, mesh: Mesh) -> NamedSharding:
    """The (global batch, seq_len + 1) token batch: rows by rules.batch."""
    return NamedSharding(mesh, sharding.spec_for(
        ("batch", None), cfg.rules, mesh, shape=(cfg.train.global_batch_size, cfg.data.seq_len + 1),
        what="batch (train.global_batch_size, data.seq_len + 1)"))


def with_shardings(shapes, shardings):
    """ShapeDtypeStructs carrying their shardings (the state without allocating it)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def fresh_state_fn(tx: optax.GradientTransformation) -> Callable:
    """params -> {params, opt, step}: the train state around `params` at step 0, with a fresh
    optimizer state. The one place that spells the state's entries (comm.py adds its own)."""
    def fresh_state(params):
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    return fresh_state


def loss_sums_fn(cfg: RunConfig, graphdef, run_blocks: Callable | None, reorder: Callable | None = None,
                 pipelined: Callable | None = None) -> Callable:
    """(params, batch) -> (summed next-token cross-entropy over the counted positions, their number,
    the auxiliary losses the model reports: a dict, e.g. an MoE router's), computed in
    train.compute_dtype: embed -> run_blocks -> head (packed documents: see `unpack`). `reorder`
    (`context_order`) is applied to every field of the batch, positions included. `pipelined`
    (an explicit pipeline schedule, schedules.loss_sums) replaces embed -> run_blocks -> head."""
    compute_dtype = jnp.dtype(cfg.train.compute_dtype)

    def loss_sums(params, batch):
        inputs_bt, targets_bt, segment_ids_bt, positions_bt, weights_bt = unpack(batch)
        if pipelined is not None:
            docs = {k: v for k, v in (("segment_ids", segment_ids_bt), ("positions", positions_bt)) if v is not None}
            return pipelined(params, inputs_bt, targets_bt, weights_bt, docs), weights_bt.sum(), {}
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
        if reorder is not None:  # context parallelism: every field in the load-balanced order
            if positions_bt is None:
                positions_bt = jnp.broadcast_to(jnp.arange(inputs_bt.shape[1]), inputs_bt.shape)
            fields = (inputs_bt, targets_bt, segment_ids_bt, positions_bt, weights_bt)
            inputs_bt, targets_bt, segment_ids_bt, positions_bt, weights_bt = (
                None if x is None else reorder(x) for x in fields)
        docs = {k: v for k, v in (("segment_ids", segment_ids_bt), ("positions", positions_bt)) if v is not None}
        out = run_blocks(model.blocks, model.embed(inputs_bt), **docs)
        x_btd, aux = out if isinstance(out, tuple) else (out, {})
        return head_loss(cfg, model, x_btd, targets_bt, weights_bt), weights_bt.sum(), aux
    return loss_sums


def head_loss(cfg: RunConfig, model, x_btd, targets_bt, weights_bt, one_hot: bool = False):
    """The summed weighted cross-entropy of the model's head on the blocks' output x_btd, chunked by
    train.loss_chunk (`loss.weighted_cross_entropy_sum`; `one_hot`: see `loss.cross_entropy`)."""
    seq_shards = model.constrain.size("seq")
    head = model.head
    if n_chunks(x_btd.shape[1], cfg.train.loss_chunk, seq_shards) > 1:  # gathered once, not per chunk
        head = functools.partial(model.head, unembed_dv=model.unembedding())
    return weighted_cross_entropy_sum(head, x_btd, targets_bt, weights_bt, cfg.train.loss_chunk, seq_shards,
                                      one_hot=one_hot)


def loss_fn(cfg: RunConfig, loss_sums: Callable) -> Callable:
    """(params, batch, denominator=None) -> (objective, losses) from `loss_sums` (`loss_sums_fn`):
    `losses["loss"]` the summed token loss / denominator (default: the batch's own counted tokens,
    i.e. the mean), plus each auxiliary loss the model reports (an MoE router's) /
    train.grad_accum_steps; the objective is their sum, every entry is logged."""
    def loss(params, batch, denominator=None):
        total, count, aux = loss_sums(params, batch)
        losses = {"loss": total / (jnp.maximum(count, 1.0) if denominator is None else denominator),
                  **{k: v / cfg.train.grad_accum_steps for k, v in aux.items()}}
        return sum(v for v in losses.values() if jnp.ndim(v) == 0), losses
    return loss


def make_loss_and_grads(cfg: RunConfig, loss_sums: Callable, constrain) -> Callable:
    """(params, batch) -> (losses, grads): the mean losses (a dict: `loss` the token loss, and any
    auxiliary losses) and gradients over train.grad_accum_steps micro-batches (= the full batch's),
    each micro-batch constrained by `constrain` (the one `loss_sums`' model was built with)."""
    loss = loss_fn(cfg, loss_sums)
    grad_fn = jax.grad(loss, has_aux=True)
    accum = cfg.train.grad_accum_steps

    def loss_and_grads(params, batch):
        denominator = jnp.maximum(unpack(batch)[-1].sum(), 1.0)  # the whole step's counted tokens
        if accum == 1:
            grads, losses = grad_fn(params, batch, denominator)
            return losses, grads
        micro = jax.tree.map(lambda x: x.reshape(accum, -1, x.shape[-1]), batch)  # (B, T+1) -> (A, B/A, T+1)

        def body(carry, micro_batch):
            micro_batch = jax.tree.map(lambda x: constrain(x, ("batch", None)), micro_batch)
            grads, losses = grad_fn(params, micro_batch, denominator)
            return jax.tree.map(jnp.add, carry, (losses, grads)), None

        abstract_losses = jax.eval_shape(loss, params, jax.tree.map(lambda x: x[0], micro), denominator)[1]
        zeros = (jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_losses),
                 jax.tree.map(jnp.zeros_like, params))
        return jax.lax.scan(body, zeros, micro)[0]
    return loss_and_grads


def update_fn(cfg: RunConfig, tx: optax.GradientTransformation, nan_at: int | None = None,
              apply: Callable | None = None) -> Callable:
    """(state, losses, grads) -> (state, metrics): applies reduced gradients; params, opt and step
    advance, other state entries pass through. `losses`: the dict loss_and_grads returns (`loss`
    and any auxiliary losses), all logged. `nan_at`: a fault for tests (shardtrain/runtime/faults.py):
    that step's gradients are NaN. `apply`: (grads, opt, params) -> (params, opt), the optimizer
    applied (offload.py's streamed one), else tx's."""
    lr = optim.schedule(cfg)

    def apply_tx(grads, opt, params):
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt
    apply = apply or apply_tx

    def update(state, losses, grads):
        if nan_at is not None:
            poison = jnp.where(state["step"] == nan_at - 1, jnp.nan, 1.0)
            grads = jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
        params, opt = apply(grads, state["opt"], state["params"])
        stats = {k: v for k, v in losses.items() if jnp.ndim(v)}  # the model's state statistics
        if stats:
            params = models.get(cfg.model.name).update_state(cfg.model, params, stats)
        metrics = {**{k: v for k, v in losses.items() if k not in stats}, "grad_norm": optax.tree.norm(grads),
                   "lr": lr(state["step"])}
        return {**state, "params": params, "opt": opt, "step": state["step"] + 1}, metrics
    return update


def skipping_nonfinite(train_step: Callable, fetch: Callable = lambda state: state) -> Callable:
    """train.on_nonfinite=skip: a step whose loss or gradient norm is not finite leaves every state
    entry as it was (parameters, optimizer and communication state) but the step counter. `fetch`
    brings offloaded entries to the device (`to_device`)."""
    def step(state, batch):
        new, metrics = train_step(state, batch)
        state, new = fetch(state), fetch(new)
        ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        kept = {k: jax.tree.map(lambda n, o: jnp.where(ok, n, o), v, state[k]) for k, v in new.items() if k != "step"}
        return {**kept, "step": new["step"]}, metrics
    return step


def post_training_pieces(cfg: RunConfig, mesh: Mesh, layout: sharding.ParamLayout, run_blocks: Callable,
                         constrain, shardings: dict, fresh: Callable, update: Callable, lm_loss_and_grads) -> tuple:
    """train.objective=dpo|grpo: (state shardings, fresh state, train step, (params, batch) ->
    (values, grads): DPO's with the reference the params' own, else the lm one) around dpo.py's
    loss or grpo.py's update; a frozen reference (without LoRA) is a state entry `reference`,
    sharded like the params."""
    dpo.check(cfg, mesh)
    if comm.enabled(cfg):
        raise ConfigError(f"train.objective={cfg.train.objective} does not combine with train.comm.sync=local_sgd or "
                          "a compressed train.comm.grad_reduce_dtype yet")
    lm_fresh = fresh
    if dpo.holds_reference(cfg):
        shardings = {**shardings, "reference": layout.shardings}
        fresh = lambda params: {**lm_fresh(params), "reference": params}  # noqa: E731
    if cfg.train.objective == "grpo":
        grpo.load_reward(cfg.grpo.reward)  # a missing file or function fails before compiling
        return (shardings, fresh, grpo.make_step(cfg, dpo.token_logps_fn(cfg, layout.graphdef, run_blocks), update),
                lm_loss_and_grads)
    loss_and_grads = dpo.make_loss_and_grads(cfg, dpo.sequence_logps_fn(cfg, layout.graphdef, run_blocks), constrain)

    def train_step(state, batch):
        return update(state, *loss_and_grads(state["params"], dpo.reference_of(cfg, state), batch))

    def own_reference(params, batch):
        return loss_and_grads(params, dpo.reference_of(cfg, {"params": params, "reference": params}), batch)
    return shardings, fresh, train_step, own_reference


# ----------------------------------------------------------------------------- build


def build(cfg: RunConfig, mesh: Mesh, nan_at: int | None = None) -> Program:
    """The one compiled train step of `cfg` on `mesh` (trainer and planner both call this), and
    what later code needs of it, each made once:

    1. layout: the model traced once, abstractly: its structure, parameter shapes, names, shardings;
    2. shardings: optimizer state like its parameters, the batch by rows;
    3. loss: embed -> blocks (scan or pipeline) -> head, and its gradients over the micro-batches;
    4. update and fresh state: the optimizer step (comm.py wraps 3-4 for compressed reduction or
       local SGD, and adds its state entries);
    5. jit: `init` creates the state already sharded, `step` donates it, `eval_step` sums the loss.
    `nan_at`: a fault for tests (SHARDTRAIN_FAULT=nan@N) that makes step N's gradients NaN.
    """
    constrain = sharding.Constrain(cfg.rules, mesh)
    schedule = pipeline_schedule(cfg, mesh, constrain)  # first: the pipeline's errors name layers, stages, repeats
    run_blocks, reorder = blocks_runner(cfg, mesh, schedule), context_order(cfg, mesh, constrain)

    layout = sharding.param_layout(cfg, mesh)                                                 # 1
    tx = optim.make(cfg, layout.names)
    shardings = state_shardings(cfg, mesh, tx, layout)                                        # 2
    batch = batch_sharding(cfg, mesh)
    pipelined = (schedules.loss_sums(cfg, mesh, schedule, layout, functools.partial(head_loss, cfg))
                 if run_blocks is None else None)
    loss_sums = loss_sums_fn(cfg, layout.graphdef, run_blocks, reorder, pipelined)            # 3
    loss_and_grads = make_loss_and_grads(cfg, loss_sums, constrain)
    on_host, streamed = offloaded(cfg), offload.streams(cfg, constrain.platform)
    apply = offload.streamed_update(cfg, layout.names, layout.shardings, shardings["opt"]) if streamed else None
    fresh, update = fresh_state_fn(tx), update_fn(cfg, tx, nan_at, apply)                     # 4

    def train_step(state, batch):
        state = to_device(state, shardings, {"params"}.intersection(on_host))
        losses, grads = loss_and_grads(state["params"], batch)
        if "opt" in on_host and not streamed:  # brought in whole (offload.py streams it per layer)
            grads, opt = jax.lax.optimization_barrier((grads, state["opt"]))
            state = to_device({**state, "opt": opt}, shardings, ["opt"])
        return update(state, losses, grads)

    if cfg.train.objective != "lm":  # post-training, the reference in the state: dpo.py, grpo.py
        shardings, fresh, train_step, loss_and_grads = post_training_pieces(
            cfg, mesh, layout, run_blocks, constrain, shardings, fresh, update, loss_and_grads)

    def replica_loss_and_grads(replica_constrain):  # comm.py: a replica's activations leave out its axes,
        graphdef = nnx.split(sharding.abstract_model(cfg, replica_constrain))[0]  # so its own model
        return make_loss_and_grads(cfg, loss_sums_fn(cfg, graphdef, run_blocks, reorder, pipelined), replica_constrain)

    if comm.enabled(cfg) and cfg.model.moe.n_experts > 1 and cfg.model.moe.router == "sigmoid":
        raise ConfigError("model.moe.router=sigmoid (its balancing bias moves by the step's load) does not combine "
                          "with train.comm.sync=local_sgd or a compressed train.comm.grad_reduce_dtype yet")
    if comm.enabled(cfg) and cfg.model.moe.n_experts > 1 and mesh.shape["expert"] > 1:
        raise ConfigError("mesh.expert > 1 does not combine with train.comm.sync=local_sgd or a compressed "
                          "train.comm.grad_reduce_dtype yet; use mesh.expert=1")
    if comm.enabled(cfg) and on_host:
        raise ConfigError("train.offload does not combine with train.comm.sync=local_sgd or a compressed "
                          "train.comm.grad_reduce_dtype yet; use train.offload.optimizer=false, params=false")
    if comm.enabled(cfg):  # compressed gradient reduction or local SGD: shardtrain/parallel/comm.py
        shardings, fresh, train_step = comm.build(
            cfg, mesh, comm.PlainStep(shardings, layout.params, fresh, update, replica_loss_and_grads))
    if cfg.train.on_nonfinite == "skip":
        train_step = skipping_nonfinite(train_step, lambda state: to_device(state, shardings, on_host))

    def on_device(params):  # parameters train.offload.params keeps on the host, brought in
        return to_device({"params": params}, shardings, {"params"}.intersection(on_host))["params"]

    sums, replicated = (lambda p, b: loss_sums(on_device(p), b)[:2]), shardings["step"]

    return Program(                                                                           # 5
        cfg=cfg, mesh=mesh, layout=layout, tx=tx, schedule=schedule, flops_per_token=flops_per_token(cfg, layout),
        state_shardings=shardings, batch_sharding=batch,
        abstract_state=with_shardings(jax.eval_shape(fresh, layout.params), shardings),
        init=jax.jit(lambda seed: fresh(layout.init(jax.random.key(seed))), static_argnums=0, out_shardings=shardings),
        fresh_state=jax.jit(fresh, out_shardings=shardings, donate_argnums=0),
        step=jax.jit(train_step, in_shardings=(shardings, batch), out_shardings=(shardings, replicated),
                     donate_argnums=0),
        loss_sums=sums,
        eval_step=jax.jit(sums, in_shardings=(shardings["params"], batch), out_shardings=(replicated, replicated)),
        loss_and_grads=jax.jit(lambda p, b: loss_and_grads(on_device(p), b), in_shardings=(shardings["params"], batch),
                               out_shardings=(replicated, layout.shardings)),
    )
