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
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import models
from shardtrain import comm, optim, pipeline, sharding
from shardtrain.blocks import scan_runner
from shardtrain.config import ConfigError, RunConfig


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

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        t = self.cfg.train
        return jax.ShapeDtypeStruct((t.global_batch_size, self.cfg.data.seq_len + 1), jnp.int32,
                                    sharding=self.batch_sharding)

    def param_count(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract_state["params"]))

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward + backward), as the model reports them (6N, the
        matmuls alone, for a model that does not)."""
        report = getattr(model_class(self.cfg), "flops_per_token", None)
        if report is None:
            return 6 * self.param_count()
        return report(self.cfg.model, self.param_count(), self.cfg.data.seq_len)

    def lower(self):
        return self.step.lower(self.abstract_state, self.abstract_batch())

    def local_rows(self) -> slice:
        """Rows of the global batch held by this process's devices (a contiguous block)."""
        index_map = self.batch_sharding.addressable_devices_indices_map(self.abstract_batch().shape)
        starts = [idx[0].start or 0 for idx in index_map.values()]
        stops = [idx[0].stop or self.cfg.train.global_batch_size for idx in index_map.values()]
        return slice(min(starts), max(stops))


def dtype(name: str):
    return jnp.dtype(name)


def model_class(cfg: RunConfig):
    """The model class that model.name names (ConfigError for an unknown name)."""
    try:
        return models.get(cfg.model.name)
    except models.UnknownModel as e:
        raise ConfigError(str(e)) from None


def abstract_model(cfg: RunConfig, constrain=models.no_constraint):
    cls = model_class(cfg)
    return nnx.eval_shape(lambda: cls(cfg.model, rngs=nnx.Rngs(0), constrain=constrain))


def cross_entropy(logits_btv, targets_bt):
    return optax.softmax_cross_entropy_with_integer_labels(logits_btv.astype(jnp.float32), targets_bt).mean()


# ----------------------------------------------------------------------------- the pieces of `build`


def blocks_runner(cfg: RunConfig, mesh: Mesh) -> Callable:
    """`run_blocks(blocks, x_btd) -> x_btd`: a pipeline over `pipeline` when that axis is > 1, else a scan."""
    return pipeline.runner(cfg, mesh) if mesh.shape["pipeline"] > 1 else scan_runner(cfg)


def abstract_params(cfg: RunConfig, constrain) -> tuple[Any, dict, dict]:
    """(graphdef, parameter ShapeDtypeStructs in train.param_dtype, their logical axis names)."""
    graphdef, state = nnx.split(abstract_model(cfg, constrain))
    names = sharding.logical_names(state)
    param_dtype = dtype(cfg.train.param_dtype)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype), nnx.to_pure_dict(state))
    return graphdef, shapes, names


def state_shardings(cfg: RunConfig, mesh: Mesh, tx: optax.GradientTransformation, params: dict,
                    names: dict) -> dict:
    """Shardings of the train state: parameters by the rules, optimizer state like its parameters
    (`jax.jit(tx.init)` alone would replicate it), scalars replicated."""
    replicated = NamedSharding(mesh, P())
    param_shardings = sharding.named(mesh, sharding.param_specs(params, names, cfg.rules, mesh))
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings,
                                          transform_non_params=lambda _: replicated)
    return {"params": param_shardings, "opt": opt_shardings, "step": replicated}


def batch_sharding(cfg: RunConfig, mesh: Mesh) -> NamedSharding:
    """The (global batch, seq_len + 1) token batch: rows by rules.batch."""
    return NamedSharding(mesh, sharding.spec_for(
        ("batch", None), cfg.rules, mesh, shape=(cfg.train.global_batch_size, cfg.data.seq_len + 1),
        what="batch (train.global_batch_size, data.seq_len + 1)"))


def with_shardings(shapes, shardings):
    """ShapeDtypeStructs carrying their shardings (the state without allocating it)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def init_fn(cfg: RunConfig, tx: optax.GradientTransformation) -> Callable:
    """key -> {params, opt, step}: the model initialised from `key`, in train.param_dtype."""
    def init(key):
        params = nnx.to_pure_dict(nnx.split(model_class(cfg)(cfg.model, rngs=nnx.Rngs(params=key)))[1])
        params = jax.tree.map(lambda p: p.astype(dtype(cfg.train.param_dtype)), params)
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    return init


def loss_fn(cfg: RunConfig, graphdef, run_blocks: Callable) -> Callable:
    """(params, tokens_bt) -> mean next-token cross-entropy, computed in train.compute_dtype:
    embed -> run_blocks -> head."""
    compute_dtype = dtype(cfg.train.compute_dtype)

    def loss(params, tokens_bt):
        model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(compute_dtype), params))
        x_btd = run_blocks(model.blocks, model.embed(tokens_bt[:, :-1]))
        return cross_entropy(model.head(x_btd), tokens_bt[:, 1:])
    return loss


def make_loss_and_grads(cfg: RunConfig, run_blocks: Callable, constrain) -> Callable:
    """(params, tokens_bt) -> (loss, grads): mean over train.grad_accum_steps micro-batches (= the full
    batch's), activations constrained by `constrain` (comm.py passes its own, per replica)."""
    loss = loss_fn(cfg, nnx.split(abstract_model(cfg, constrain))[0], run_blocks)
    accum = cfg.train.grad_accum_steps

    def loss_and_grads(params, tokens_bt):
        if accum == 1:
            return jax.value_and_grad(loss)(params, tokens_bt)
        micro_abt = tokens_bt.reshape(accum, -1, tokens_bt.shape[-1])  # (A, B/A, T+1)

        def body(carry, micro_bt):
            value, grads = jax.value_and_grad(loss)(params, constrain(micro_bt, ("batch", None)))
            return jax.tree.map(jnp.add, carry, (value, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        total = jax.lax.scan(body, zeros, micro_abt)[0]
        return jax.tree.map(lambda x: x / accum, total)
    return loss_and_grads


def update_fn(cfg: RunConfig, tx: optax.GradientTransformation) -> Callable:
    """(state, loss, grads) -> (state, metrics): applies reduced gradients; params, opt and step
    advance, other state entries pass through."""
    lr = optim.schedule(cfg)

    def update(state, loss, grads):
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr(state["step"])}
        return {**state, "params": params, "opt": opt, "step": state["step"] + 1}, metrics
    return update


# ----------------------------------------------------------------------------- build


def build(cfg: RunConfig, mesh: Mesh) -> Program:
    """The one compiled train step of `cfg` on `mesh` (trainer and planner both call this):

    1. abstract model: parameter shapes and logical names, nothing allocated;
    2. shardings: parameters by the rules, optimizer state like its parameters, the batch by rows;
    3. loss: embed -> blocks (scan or pipeline) -> head, and its gradients over the micro-batches;
    4. update: the optimizer step (comm.py wraps 3-4 for compressed reduction or local SGD);
    5. jit: `init` creates the state already sharded, `step` donates it.
    """
    run_blocks = blocks_runner(cfg, mesh)  # first: the pipeline's errors name layers, stages, repeats
    constrain = sharding.Constrain(cfg.rules, mesh)
    tx = optim.make(cfg)

    graphdef, params, names = abstract_params(cfg, constrain)                                 # 1
    shardings = state_shardings(cfg, mesh, tx, params, names)                                 # 2
    batch = batch_sharding(cfg, mesh)
    make_loss = functools.partial(make_loss_and_grads, cfg, run_blocks)                       # 3
    init, update = init_fn(cfg, tx), update_fn(cfg, tx)                                       # 4
    loss_and_grads = make_loss(constrain)

    def train_step(state, tokens_bt):
        return update(state, *loss_and_grads(state["params"], tokens_bt))

    if comm.enabled(cfg):  # compressed gradient reduction or local SGD: shardtrain/comm.py
        shardings, init, train_step = comm.build(cfg, mesh, comm.Base(shardings, init, update, make_loss))
    abstract_state = with_shardings(jax.eval_shape(init, jax.random.key(0)), shardings)

    return Program(                                                                           # 5
        cfg=cfg, mesh=mesh, graphdef=graphdef, param_names=names, state_shardings=shardings,
        batch_sharding=batch, abstract_state=abstract_state,
        init=jax.jit(lambda seed: init(jax.random.key(seed)), static_argnums=0, out_shardings=shardings),
        step=jax.jit(train_step, in_shardings=(shardings, batch),
                     out_shardings=(shardings, shardings["step"]), donate_argnums=0),
    )
