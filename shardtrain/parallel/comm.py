"""Less communication across slow links: compressed gradient reduction and local SGD (DiLoCo).

`step.build` hands its pieces (`PlainStep`) to `build` here when `train.comm.grad_reduce_dtype` is not
float32 or `train.comm.sync` is local_sgd; the default (float32, every_step) keeps GSPMD's step as is.

Both modes run the per-replica part of the step inside `jax.shard_map`, manual over the *pure
data-parallel* axes (they shard the batch but no parameter: `data` with the default rules) and
auto over the others, whose reductions (FSDP, tensor) stay GSPMD's, in float32:

- `grad_reduce_dtype: bfloat16`: each replica's gradient is cast to bf16 and psum'd.
- `grad_reduce_dtype: int8`: a two-phase all-reduce with error feedback (as in 1-bit Adam /
  ZeRO++): each replica adds its residual, quantises (int8, one scale per tensor) and sends chunk
  j of every tensor to replica j (all_to_all); replica j dequantises and averages its chunk, adds
  its own residual, quantises again and all-gathers the int8 chunks. Both residuals (what
  quantisation dropped) stay in the state under `comm` and go into the next step, so nothing is
  lost over time: sum of applied gradients = sum of true gradients - current residuals.
  Each device sends 2(n-1)/n x (params / 4) bytes, a quarter of a float32 ring all-reduce.
- `sync: local_sgd` (DiLoCo): every replica along `train.comm.sync_axes` keeps its own parameters and
  optimizer state (`state["replicas"]`, a leading replica dimension sharded over those axes) and
  steps without any reduction over them; every `sync_every` steps the replicas' mean parameter
  delta from the outer parameters (`state["params"]`) is applied by outer Nesterov SGD (state in
  `state["opt"]`) and every replica restarts from the result. `grad_reduce_dtype: bfloat16`
  sends that delta in bf16.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardtrain.config import ConfigError, RulesConfig, RunConfig, mesh_axes
from shardtrain.parallel import sharding

F32 = jnp.float32


@dataclasses.dataclass
class PlainStep:
    """What `step.build` made for the plain synchronous step."""

    state_shardings: dict
    abstract_params: dict
    """The parameters' ShapeDtypeStructs (`step.Program.layout.params`)."""
    fresh_state: Callable
    """params -> {params, opt, step}: the state at step 0 around them (the entries modes here extend)."""
    update: Callable
    """(state, losses, grads) -> (state with params/opt/step advanced, metrics)."""
    make_loss_and_grads: Callable
    """constrain -> ((params, tokens_bt) -> (losses, grads)) of a model whose activations `constrain`
    constrains; losses: a dict, `loss` the cross-entropy."""


def enabled(cfg: RunConfig) -> bool:
    return cfg.train.comm.grad_reduce_dtype != "float32" or cfg.train.comm.sync != "every_step"


def data_parallel_axes(cfg: RunConfig, mesh: Mesh, param_shardings) -> tuple[str, ...]:
    """Mesh axes (size > 1) that shard the batch but no parameter: where gradients are all-reduced."""
    used = {a for s in jax.tree.leaves(param_shardings) for entry in s.spec for a in mesh_axes(entry)}
    return tuple(a for a in mesh_axes(cfg.rules.batch) if mesh.shape[a] > 1 and a not in used)


def replica_axes(cfg: RunConfig, mesh: Mesh, param_shardings) -> tuple[str, ...]:
    """The replica axes: sync_axes for local SGD, else the data-parallel axes.
    Raises ConfigError for combinations that are not supported."""
    t = cfg.train.comm
    dp = data_parallel_axes(cfg, mesh, param_shardings)
    if mesh.shape["pipeline"] > 1:
        raise ConfigError("train.comm.grad_reduce_dtype / train.comm.sync=local_sgd do not support mesh.pipeline > 1 "
                          "yet; set mesh.pipeline=1 or use the defaults (float32, every_step)")
    if t.sync == "local_sgd":
        if t.grad_reduce_dtype == "int8":
            raise ConfigError("train.comm.grad_reduce_dtype=int8 is not supported with train.comm.sync=local_sgd "
                              "(the outer delta can be sent as bfloat16); use float32 or bfloat16")
        for a in t.sync_axes:
            if mesh.shape[a] > 1 and a not in dp:
                raise ConfigError(f"train.comm.sync_axes: mesh axis '{a}' must shard the batch and no parameter "
                                  f"(pure data parallelism: {', '.join(dp) or 'none on this mesh'}); "
                                  f"change train.comm.sync_axes or the rules")
        return tuple(t.sync_axes)
    if not dp:
        raise ConfigError(f"train.comm.grad_reduce_dtype={t.grad_reduce_dtype} compresses the gradient reduction over "
                          "data-parallel mesh axes (sharding the batch, not the parameters), and this mesh has "
                          "none of size > 1; set mesh.data > 1 or train.comm.grad_reduce_dtype=float32")
    return dp


def replica_constrain(cfg: RunConfig, mesh: Mesh, axes: tuple[str, ...]) -> sharding.Constrain:
    """Activation constraints for one replica under `jax.vmap(..., spmd_axis_name=axes)`: the
    rules without `axes`, which the vmapped (replica) dimension takes."""
    rules = dataclasses.replace(cfg.rules, **{
        f.name: tuple(a for a in mesh_axes(getattr(cfg.rules, f.name)) if a not in axes) or None
        for f in dataclasses.fields(RulesConfig)})
    return sharding.Constrain(rules, mesh)


def _replica_sharding(s: NamedSharding, axes: tuple[str, ...]) -> NamedSharding:
    """The sharding of a per-replica copy: a leading dimension over `axes`, then the array's own."""
    return NamedSharding(s.mesh, P(axes, *s.spec))


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _expand(tree):
    return jax.tree.map(lambda x: x[None], tree)


# ----------------------------------------------------------------------------- int8 with feedback


def chunk_dim(shape, spec: P, mesh: Mesh, n: int, what: str) -> int:
    """The dimension an int8 tensor is split into n chunks along: the first whose size is divisible
    by n x its own shards (so chunks stay aligned with the FSDP/tensor sharding)."""
    for k, size in enumerate(shape):
        shards = sharding.axes_size(mesh, spec[k] if k < len(spec) else None)
        if size % (n * shards) == 0:
            return k
    raise ConfigError(f"train.comm.grad_reduce_dtype=int8: parameter {what} {tuple(shape)} has no dimension divisible "
                      f"by {n} (data-parallel replicas) x its shards; use bfloat16 or change the model size")


def quantize(x):
    """int8 values, their (per-tensor) scale, and the residual x - dequantised."""
    scale = jnp.max(jnp.abs(x)) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0).astype(F32)
    q = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
    return q, scale, x - q.astype(F32) * scale


def _split(x, k: int, n: int):
    return x.reshape(x.shape[:k] + (x.shape[k] // n, n) + x.shape[k + 1:])  # (.., D/n, n, ..): chunk j = rows i*n + j


def int8_mean(grads, worker, server, dims, axes, n: int):
    """Mean over `axes` of every gradient, moved as int8 (see the module docstring). Runs inside
    shard_map; `worker` / `server` are this replica's residuals (server: its own chunk of each
    tensor). Returns (means, worker, server)."""
    leaves, treedef = jax.tree.flatten(grads)
    w_leaves, s_leaves, k_leaves = (treedef.flatten_up_to(t) for t in (worker, server, dims))
    q1, scale1, w_new = zip(*(quantize(g.astype(F32) + r) for g, r in zip(leaves, w_leaves)))
    scales1 = jax.lax.all_gather(jnp.stack(scale1), axes)  # (n, tensors): one small collective for all scales
    owned = []
    for i, (q, k) in enumerate(zip(q1, k_leaves)):
        recv = jax.lax.all_to_all(_split(q, k, n), axes, k + 1, k + 1, tiled=True)  # [.., i, j, ..]: sender j's
        bshape = [1] * recv.ndim
        bshape[k + 1] = n
        owned.append(jnp.sum(recv.astype(F32) * scales1[:, i].reshape(bshape), axis=k + 1) / n)
    q2, scale2, s_new = zip(*(quantize(c + r) for c, r in zip(owned, s_leaves)))
    scales2 = jax.lax.all_gather(jnp.stack(scale2), axes)  # (n, tensors)
    means = []
    for i, (q, k, g) in enumerate(zip(q2, k_leaves, leaves)):
        full = jax.lax.all_gather(q, axes, axis=k + 1)  # [.., i, r, ..]: owner r's row i = row i*n + r
        bshape = [1] * full.ndim
        bshape[k + 1] = n
        means.append((full.astype(F32) * scales2[:, i].reshape(bshape)).reshape(g.shape).astype(g.dtype))
    unflat = lambda xs: jax.tree.unflatten(treedef, list(xs))  # noqa: E731
    return unflat(means), unflat(w_new), unflat(s_new)


# ----------------------------------------------------------------------------- the two step kinds


def replica_mean(mesh: Mesh, axes: tuple[str, ...], dtype: str, specs, dims=None) -> Callable:
    """(tree_r, comm) -> (mean over the leading replica dimension r, comm), moved over `axes` as
    `dtype` by collectives written in a shard_map manual over every mesh axis (each device reduces
    its own shard; `specs` are the arrays' PartitionSpecs without the replica dimension). `comm`
    holds the int8 residuals (else {})."""
    n = sharding.axes_size(mesh, axes)

    def body(tree_r, comm):
        local = _squeeze(tree_r)
        if dtype == "int8":
            c = _squeeze(comm)
            means, worker, server = int8_mean(local, c["worker"], c["server"], dims, axes, n)
            return means, _expand({"worker": worker, "server": server})
        mean = lambda x: (jax.lax.psum(x.astype(dtype), axes).astype(F32) / n).astype(x.dtype)  # noqa: E731
        return jax.tree.map(mean, local), comm

    replica_specs = jax.tree.map(lambda s: P(axes, *s), specs, is_leaf=lambda x: isinstance(x, P))
    comm_specs = {"worker": replica_specs, "server": replica_specs} if dtype == "int8" else {}
    return jax.shard_map(body, mesh=mesh, in_specs=(replica_specs, comm_specs), out_specs=(specs, comm_specs),
                         check_vma=False)


def build(cfg: RunConfig, mesh: Mesh, base: PlainStep) -> tuple[dict, Callable, Callable]:
    """(state_shardings, fresh_state(params) -> state, train_step(state, tokens_bt) -> (state, metrics)).

    One replica's work (a gradient, or an inner optimizer step) is `jax.vmap`ped over a leading
    replica dimension sharded over the replica axes (`spmd_axis_name`), so GSPMD keeps every
    replica on its own devices; only `replica_mean` communicates over those axes."""
    axes = replica_axes(cfg, mesh, base.state_shardings["params"])
    n = sharding.axes_size(mesh, axes)
    constrain = replica_constrain(cfg, mesh, axes)
    batch_spec = P(axes, *sharding.spec_for(("batch", None), constrain.rules, mesh))
    batch_sharding = NamedSharding(mesh, batch_spec)

    def split_batch(batch):  # (B, T+1) -> (R, B/R, T+1) per field: replica r's rows already sit on its devices
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x.reshape(n, -1, x.shape[-1]), batch_sharding), batch)

    make = local_sgd_step if cfg.train.comm.sync == "local_sgd" else reduced_step
    return make(cfg, mesh, base, axes, base.make_loss_and_grads(constrain), split_batch)


def reduced_step(cfg, mesh, base, axes, loss_and_grads, split_batch):
    """Synchronous step whose data-parallel gradient reduction moves grad_reduce_dtype values."""
    n = sharding.axes_size(mesh, axes)
    dtype = cfg.train.comm.grad_reduce_dtype
    state_shardings = dict(base.state_shardings)
    param_shardings = base.state_shardings["params"]
    replica_shardings = jax.tree.map(lambda s: _replica_sharding(s, axes), param_shardings)
    dims = None
    if dtype == "int8":
        dims = jax.tree_util.tree_map_with_path(
            lambda path, x, s: chunk_dim(x.shape, s.spec, mesh, n, sharding.path_str(path)),
            base.abstract_params, param_shardings)
        state_shardings["comm"] = {"worker": replica_shardings, "server": replica_shardings}
    mean = replica_mean(mesh, axes, dtype, jax.tree.map(lambda s: s.spec, param_shardings), dims)
    grads_r = jax.vmap(loss_and_grads, in_axes=(None, 0), spmd_axis_name=axes)

    def fresh_state(params):
        state = base.fresh_state(params)
        if dtype == "int8":
            zeros = lambda shape: jnp.zeros((n, *shape), F32)  # noqa: E731
            state["comm"] = {
                "worker": jax.tree.map(lambda p: zeros(p.shape), state["params"]),
                "server": jax.tree.map(lambda p, k: zeros(p.shape[:k] + (p.shape[k] // n,) + p.shape[k + 1:]),
                                       state["params"], dims)}
        return state

    def train_step(state, tokens_bt):
        loss_r, grads = grads_r(state["params"], split_batch(tokens_bt))  # each replica's own gradient
        grads, comm = mean(jax.lax.with_sharding_constraint(grads, replica_shardings), state.get("comm", {}))
        return base.update({**state, **({"comm": comm} if comm else {})}, jax.tree.map(jnp.mean, loss_r), grads)

    return state_shardings, fresh_state, train_step


def outer_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    t = cfg.train.comm
    return optax.sgd(t.outer_learning_rate, momentum=t.outer_momentum, nesterov=True)


def local_sgd_step(cfg, mesh, base, axes, loss_and_grads, split_batch):
    """DiLoCo: independent inner steps per replica, outer Nesterov SGD on the mean delta every H steps."""
    n = sharding.axes_size(mesh, axes)
    every = cfg.train.comm.sync_every
    outer_tx = outer_optimizer(cfg)
    param_shardings = base.state_shardings["params"]
    replicated = base.state_shardings["step"]
    state_shardings = {
        **base.state_shardings,
        "opt": optax.tree_map_params(outer_tx, lambda _, s: s, jax.eval_shape(outer_tx.init, base.abstract_params),
                                     param_shardings, transform_non_params=lambda _: replicated),
        "replicas": jax.tree.map(lambda s: _replica_sharding(s, axes),
                                 {"params": param_shardings, "opt": base.state_shardings["opt"]}),
    }
    mean = replica_mean(mesh, axes, cfg.train.comm.grad_reduce_dtype, jax.tree.map(lambda s: s.spec, param_shardings))

    def fresh_state(params):  # the outer optimizer's state; each replica a copy of the inner one's
        state = base.fresh_state(params)
        copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)),
                              {"params": state["params"], "opt": state["opt"]})
        return {**state, "opt": outer_tx.init(state["params"]), "replicas": copies}

    def inner(local, step, tokens_bt):  # one replica's optimizer step: no reduction over the replica axes
        loss, grads = loss_and_grads(local["params"], tokens_bt)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)  # (+ the replica axes, by vmap)
        new, metrics = base.update({**local, "step": step}, loss, grads)
        return {"params": new["params"], "opt": new["opt"]}, metrics

    inner_r = jax.vmap(inner, in_axes=(0, None, 0), spmd_axis_name=axes)

    def sync(local_params_r, params, opt):  # outer step: the mean delta moves once over the replica axes
        delta, _ = mean(jax.tree.map(lambda p, local_r: p[None] - local_r, params, local_params_r), {})
        updates, opt = outer_tx.update(delta, opt, params)
        params = optax.apply_updates(params, updates)
        return jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *p.shape)), params), params, opt

    def train_step(state, tokens_bt):
        local, metrics_r = inner_r(state["replicas"], state["step"], split_batch(tokens_bt))
        local = jax.lax.with_sharding_constraint(local, state_shardings["replicas"])
        step = state["step"] + 1
        local_params, params, opt = jax.lax.cond(step % every == 0, sync, lambda *args: args,
                                                 local["params"], state["params"], state["opt"])
        return ({"params": params, "opt": opt, "step": step, "replicas": {"params": local_params, "opt": local["opt"]}},
                {k: jnp.mean(v) for k, v in metrics_r.items()})

    return state_shardings, fresh_state, train_step

