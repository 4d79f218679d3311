"""Builds the one jit-compiled, sharded train step. `train` and `plan` both call `build`, so the
planner's numbers are the trainer's.

Train state (a plain dict pytree, checkpointed as is):
  params: the model's parameters (pure nested dict, param_dtype, sharded by the rules)
  opt:    optax state, sharded exactly like the parameters
  step:   int32 scalar
  comm, replicas: only with compressed reduction / local SGD (see comm.py)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import models
from shardtrain import comm, data, optim, sharding
from shardtrain.config import ConfigError, RunConfig
from shardtrain.loss import cross_entropy, weighted_cross_entropy_sum

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # the activations models name with checkpoint_name go to host memory, everything else is recomputed
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input", "attention_out"],
        offload_src="device", offload_dst="pinned_host"),
}


@dataclasses.dataclass
class Program:
    """The compiled step and everything needed to feed it."""

    cfg: RunConfig
    mesh: Mesh
    graphdef: Any
    param_names: dict
    """Logical axis names of every parameter (same tree as params)."""
    state_shardings: dict
    batch_sharding: NamedSharding
    abstract_state: dict
    """ShapeDtypeStructs with shardings: the state without allocating it."""
    init: Callable
    """jitted seed -> state, created already sharded."""
    step: Callable
    """jitted (state, batch) -> (state, metrics), state donated."""

    loss_sums: Callable
    """(params, batch) -> (summed token loss, counted tokens), unjitted (evaluate.py jits it)."""

    def abstract_batch(self):
        """The global batch: int32 (B, T+1) tokens, or for packed data a dict of three of them."""
        t = self.cfg.train
        x = jax.ShapeDtypeStruct((t.global_batch_size, self.cfg.data.seq_len + 1), jnp.int32,
                                 sharding=self.batch_sharding)
        return {k: x for k in PACKED_FIELDS} if data.packed(self.cfg) else x

    def batch_shape(self) -> tuple[int, int]:
        return (self.cfg.train.global_batch_size, self.cfg.data.seq_len + 1)

    def device_batch(self, local_batch):
        """This process's rows (numpy, as data.batches yields them) -> the global device batch."""
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
            self.batch_sharding, x, self.batch_shape()), local_batch)

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


PACKED_FIELDS = ("tokens", "segment_ids", "positions")


def unpack(batch):
    """A batch -> (inputs_bt, targets_bt, segment_ids_bt, positions_bt, weights_bt).

    Unpacked (an int array): every position counts, segment ids and positions are None. Packed
    (a dict): position t is masked when its input and target lie in different documents (the
    input is an EOS, the target the next document's first token); EOS itself is predicted."""
    if not isinstance(batch, dict):
        return batch[:, :-1], batch[:, 1:], None, None, jnp.ones(batch[:, 1:].shape, jnp.float32)
    tokens, seg = batch["tokens"], batch["segment_ids"]
    weights_bt = (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
    return tokens[:, :-1], tokens[:, 1:], seg[:, :-1], batch["positions"][:, :-1], weights_bt


def dtype(name: str):
    return jnp.dtype(name)


def abstract_model(cfg: RunConfig, constrain=models.no_constraint):
    cls = models.get(cfg.model.name)
    return nnx.eval_shape(lambda: cls(cfg.model, rngs=nnx.Rngs(0), constrain=constrain))


def scan_runner(cfg: RunConfig) -> Callable:
    """Runs the stacked blocks with lax.scan, each layer rematerialised by the configured policy."""
    policy = REMAT_POLICIES.get(cfg.train.remat)
    wrap = (lambda f: jax.checkpoint(f, policy=policy)) if policy else (lambda f: f)
    return lambda blocks, x, segment_ids=None, positions=None: models.scan_blocks(
        blocks, x, wrap=wrap, segment_ids=segment_ids, positions=positions, unroll=cfg.train.scan_unroll)


def build(cfg: RunConfig, mesh: Mesh) -> Program:
    run_blocks = scan_runner(cfg)
    if mesh.shape["pipeline"] > 1 and data.packed(cfg):
        raise ConfigError(f"data.source={cfg.data.source} packs documents with segment ids, which the pipeline "
                          "(mesh.pipeline > 1) does not carry yet; use mesh.pipeline=1")
    if mesh.shape["pipeline"] > 1:
        from shardtrain import pipeline
        run_blocks = pipeline.runner(cfg, mesh)  # first: its errors name layers, stages, repeats

    constrain = sharding.Constrain(cfg.rules, mesh)
    graphdef, abstract_params = nnx.split(abstract_model(cfg, constrain))
    names = sharding.logical_names(abstract_params)
    param_dtype, compute_dtype = dtype(cfg.train.param_dtype), dtype(cfg.train.compute_dtype)
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype),
                                   nnx.to_pure_dict(abstract_params))
    param_shardings = sharding.named(mesh, sharding.param_specs(abstract_params, names, cfg.rules, mesh))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, sharding.spec_for(
        ("batch", None), cfg.rules, mesh, shape=(cfg.train.global_batch_size, cfg.data.seq_len + 1),
        what="batch (train.global_batch_size, data.seq_len + 1)"))

    tx = optim.make(cfg)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731 - parameters without state (frozen by LoRA)
    opt_shardings = optax.tree_map_params(tx, lambda x, s: x if masked(x) else s, abstract_opt, param_shardings,
                                          transform_non_params=lambda _: replicated, is_leaf=masked)
    state_shardings = {"params": param_shardings, "opt": opt_shardings, "step": replicated}
    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  {"params": abstract_params, "opt": abstract_opt,
                                   "step": jax.ShapeDtypeStruct((), jnp.int32)}, state_shardings)

    def init(seed):
        cls = models.get(cfg.model.name)
        params = nnx.to_pure_dict(nnx.split(cls(cfg.model, rngs=nnx.Rngs(params=seed)))[1])
        params = jax.tree.map(lambda p: p.astype(param_dtype), params)
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def loss_sum(model, batch):
        """(summed cross-entropy over the counted positions, their number)."""
        inputs_bt, targets_bt, segment_ids_bt, positions_bt, weights_bt = unpack(batch)
        docs = {} if segment_ids_bt is None else {"segment_ids": segment_ids_bt, "positions": positions_bt}
        x_btd = run_blocks(model.blocks, model.embed(inputs_bt), **docs)
        return weighted_cross_entropy_sum(model.head, x_btd, targets_bt, weights_bt, cfg.train.loss_chunk), weights_bt.sum()

    def loss_sums(params, batch):
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
        return loss_sum(model, batch)

    def make_loss_and_grads(constrain):
        """loss_and_grads for the model with activations constrained by `constrain` (comm runs it per replica)."""
        graphdef = nnx.split(abstract_model(cfg, constrain))[0]

        def loss_fn(params, batch, denominator):
            """Summed token loss of `batch` / denominator (the whole step's counted tokens)."""
            model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
            return loss_sum(model, batch)[0] / denominator

        def loss_and_grads(params, batch):
            """Mean token loss and gradients over train.grad_accum_steps micro-batches (= the full batch's)."""
            accum = cfg.train.grad_accum_steps
            denominator = jnp.maximum(unpack(batch)[-1].sum(), 1.0)
            if accum == 1:
                return jax.value_and_grad(loss_fn)(params, batch, denominator)
            # (B, T+1) -> (A, B/A, T+1) for each field of the batch
            micro = jax.tree.map(lambda x: x.reshape(accum, -1, x.shape[-1]), batch)

            def body(carry, micro_batch):
                micro_batch = jax.tree.map(lambda x: constrain(x, ("batch", None)), micro_batch)
                loss, grads = jax.value_and_grad(loss_fn)(params, micro_batch, denominator)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            return jax.lax.scan(body, zeros, micro)[0]
        return loss_and_grads

    lr = optim.schedule(cfg)

    def update(state, loss, grads):
        """Applies reduced gradients: params, opt and step advance; other state entries pass through."""
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr(state["step"])}
        return {**state, "params": params, "opt": opt, "step": state["step"] + 1}, metrics

    loss_and_grads = make_loss_and_grads(constrain)

    def train_step(state, batch):
        return update(state, *loss_and_grads(state["params"], batch))

    if comm.enabled(cfg):  # compressed gradient reduction or local SGD: shardtrain/comm.py
        state_shardings, init, train_step = comm.build(cfg, mesh, comm.Base(
            state_shardings, init, update, make_loss_and_grads))
        abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                      jax.eval_shape(init, jax.random.key(0)), state_shardings)

    return Program(
        cfg=cfg, mesh=mesh, graphdef=graphdef, param_names=names, state_shardings=state_shardings,
        batch_sharding=batch_sharding, abstract_state=abstract_state, loss_sums=loss_sums,
        init=jax.jit(lambda seed: init(jax.random.key(seed)), static_argnums=0, out_shardings=state_shardings),
        step=jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, replicated), donate_argnums=0),
    )
