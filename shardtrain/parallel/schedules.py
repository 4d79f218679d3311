"""Explicit pipeline schedules (1F1B, interleaved 1F1B, zero-bubble ZB-H1): the forward and the
backward of each micro-batch run where the timetable puts them, instead of autodiff through a loop.

`loss_sums(cfg, mesh, schedule, graphdef)` returns `(params, inputs, targets, weights, docs) ->
summed token loss` whose gradient is computed by the schedule itself (a `jax.custom_vjp`: the
forward pass runs the whole schedule, forwards and backwards, and keeps the parameters' gradients;
the backward pass scales them), so grad accumulation, the optimizer and the planner are unchanged.

Inside one `jax.shard_map` manual over `pipeline` (data, fsdp, tensor automatic within a stage) a
`lax.scan` runs the timetable's slots (`timetable.py`); in each slot each stage switches on its own
operation (`lax.switch`, so a stage's bubble computes nothing):
- F: `jax.vjp` of its group of layers on the micro-batch; the residuals that depend on the
  micro-batch go into stage-local buffers of `window` slots (about P micro-batches for 1F1B), those
  computable from the parameters alone (the weights themselves, reshaped, cast) are recomputed at
  the backward instead of held per micro-batch (`_Residuals`). Virtual stage 0 first embeds the
  micro-batch's tokens (the embedding runs on stage 0 only); the last one applies the head and the
  loss and their backward right away (on the last stage only), which gives the micro-batch's
  output cotangent.
- B: the backward from the held residuals and the received cotangent: its input cotangent goes to
  the previous stage; for 1F1B it also adds the weight gradient; on virtual stage 0 it is the
  embedding's backward.
- W (zero-bubble): the weight gradient of a micro-batch whose B ran earlier, placed in the bubble;
  B and W split the stage's backward by data dependence (`_WeightSplit`), so neither redoes the other.
Each slot ends with two `ppermute`s: F's output to the next stage, B's input cotangent to the
previous one; the receiver parks them in its buffers until the timetable uses them.

Layer placement as in pipeline.py: group r P + p of Lg layers on stage p (v > 1: interleaved).
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.interpreters import partial_eval as pe  # no public API splits a jaxpr by known inputs
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from shardtrain.config import RunConfig
from shardtrain.parallel import sharding, timetable as tt
from shardtrain.parallel.blocks import scan_runner

AXIS = "pipeline"


class _Residuals:
    """The residuals of `jax.vjp(fn, params, x, docs)`, split by what they depend on: `held` (a
    micro-batch's) and `known` (the parameters' alone, recomputed by `known_fn(params)`)."""

    def __init__(self, fn, params, x, docs):
        def leaves(params, x, docs):
            return jax.tree.leaves(jax.vjp(fn, params, x, docs)[1])
        abstract = jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], params, x, docs)
        self.treedef = jax.tree.structure(abstract)
        self.avals = jax.tree.leaves(abstract)
        closed = jax.make_jaxpr(leaves)(params, x, docs)
        unknowns = [False] * len(jax.tree.leaves(params)) + [True] * len(jax.tree.leaves((x, docs)))
        known, _, self.held_mask, _ = pe.partial_eval_jaxpr_nounits(closed, unknowns, instantiate=False)
        n_known = self.held_mask.count(False)
        self._known = lambda params: jax.extend.core.jaxpr_as_fun(known)(*jax.tree.leaves(params))[:n_known]

    def held(self, vjp_fn) -> list:
        return [leaf for leaf, held in zip(jax.tree.leaves(vjp_fn), self.held_mask) if held]

    def held_avals(self) -> list:
        return [a for a, held in zip(self.avals, self.held_mask) if held]

    def vjp_fn(self, params, held):
        known, held = iter(self._known(params)), iter(held)
        return jax.tree.unflatten(self.treedef, [next(held) if h else next(known) for h in self.held_mask])


class _WeightSplit:
    """Zero-bubble's backward in two, split by data dependence: B computes the input cotangent (and
    the weight gradients that come with it), W the other weight gradients. The held residuals the
    input cotangent does not need (a matmul's input, needed only for its weight's gradient) are
    `deferred`: everything computed from them goes to W, and what W needs of B's work (the
    cotangents inside the layers) B returns (`w_avals`), held until W; nothing is computed twice."""

    def __init__(self, residuals: _Residuals, params, ct_aval):
        def backward(params, held, ct):
            d_params, d_x, _ = residuals.vjp_fn(params, held)(ct)
            return d_params, d_x
        held_avals = residuals.held_avals()
        closed = jax.make_jaxpr(backward)(params, held_avals, ct_aval)
        n_params, n_held = len(jax.tree.leaves(params)), len(held_avals)

        def unknowns(deferred):
            return [False] * n_params + [i in deferred for i in range(n_held)] + [False]
        self.deferred: list[int] = []
        for i in range(n_held):  # defer each residual the input cotangent can do without
            if not pe.partial_eval_jaxpr_nounits(closed, unknowns({*self.deferred, i}), instantiate=False)[2][-1]:
                self.deferred.append(i)
        known, unknown, self.out_unknown, self.w_avals = pe.partial_eval_jaxpr_nounits(
            closed, unknowns(set(self.deferred)), instantiate=False)
        self._known, self._unknown = jax.extend.core.jaxpr_as_fun(known), jax.extend.core.jaxpr_as_fun(unknown)
        self.d_params_tree = jax.tree.structure(params)

    def input_grad(self, params, held, ct):
        """(input cotangent, the weight gradients B computes (zeros for W's), what W needs)."""
        kept = [h for i, h in enumerate(held) if i not in self.deferred]
        outs = self._known(*jax.tree.leaves(params), *kept, ct)
        n_known = self.out_unknown.count(False)
        known_outs, w_inputs = iter(outs[:n_known]), outs[n_known:]
        leaves = [None if unknown else next(known_outs) for unknown in self.out_unknown]
        zeros = [jnp.zeros(p.shape, p.dtype) for p in jax.tree.leaves(params)]
        d_params = [z if d is None else d for d, z in zip(leaves[:-1], zeros)]
        return leaves[-1], jax.tree.unflatten(self.d_params_tree, d_params), w_inputs

    def weight_grad(self, params, held, w_inputs):
        """The weight gradients W computes (zeros for B's)."""
        outs = iter(self._unknown(*w_inputs, *[held[i] for i in self.deferred]))
        d_params = [next(outs) if unknown else jnp.zeros(p.shape, p.dtype)
                    for unknown, p in zip(self.out_unknown[:-1], jax.tree.leaves(params))]
        return jax.tree.unflatten(self.d_params_tree, d_params)


def loss_sums(cfg: RunConfig, mesh: Mesh, schedule, layout: sharding.ParamLayout, head_loss):
    """(params, inputs_bt, targets_bt, weights_bt, docs) -> the summed weighted token loss, its
    gradient by `schedule`'s timetable (module docstring). `head_loss(model, x_btd, targets_bt,
    weights_bt, one_hot)`: the loss of the model's head on the blocks' output (step.head_loss)."""
    graphdef = layout.graphdef
    stages, v, m_count = schedule.stages, schedule.repeats, schedule.microbatches
    table = tt.timetable(schedule.name, stages, m_count, v)
    group, last = cfg.model.n_layers // (stages * v), stages * v - 1
    compute_dtype = jnp.dtype(cfg.train.compute_dtype)
    run_group = scan_runner(cfg)
    batch_axes = sharding.spec_for(("batch",), cfg.rules, mesh)[0]
    split_w = schedule.name == "zero_bubble"
    vocab_split = sharding.Constrain(cfg.rules, mesh).size("vocab") > 1
    fwd_ring = [(i, (i + 1) % stages) for i in range(stages)]
    bwd_ring = [((i + 1) % stages, i) for i in range(stages)]

    constrain = sharding.Constrain(cfg.rules, mesh)
    batch_split = sum(mesh.shape[a] > 1 for a in sharding.mesh_axes(batch_axes))

    def lookup_tables(outer):
        """The embedding table whole along d_model (its vocabulary split as before) where the batch is
        split over several mesh axes: from a table split along d_model over fsdp, with the tokens
        split over data x fsdp, XLA's SPMD partitioner aborts on the lookup's gather inside the
        shard_map (`Check failed: partition_group_list.num_replica_groups() * ...`, jax 0.12, CPU)."""
        return {k: constrain(w, ("vocab", None)) if batch_split > 1 and layout.names[k][:1] == ("vocab",) else w
                for k, w in outer.items()}

    def like_stage_weights(tree):
        """A stage's block weight gradients, (..., Lg, ...) per leaf, split as the weights are (FSDP,
        tensor). Left to propagation, the TPU compiler builds a micro-batch's weight gradients whole
        and all-reduces them."""
        def one(names, w):
            return constrain(w, (None,) * (w.ndim - len(names) + 1) + tuple(names[1:]))
        return jax.tree.map(one, layout.names["blocks"], tree, is_leaf=lambda x: isinstance(x, tuple))

    def micro(x_b):  # (B, ...) -> (M, B/M, ...): micro-batch m = rows i M + m, each device's rows stay local
        b = x_b.shape[0]
        x_mb = x_b.reshape(b // m_count, m_count, *x_b.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x_mb, NamedSharding(mesh, P(None, batch_axes)))

    def schedule_grads(params, inputs_bt, targets_bt, weights_bt, docs):
        """(loss sum, gradients of params) by the timetable."""
        blocks, outer = params["blocks"], {k: w for k, w in params.items() if k != "blocks"}
        outer = lookup_tables(outer)
        # (L, ...) -> (P, v, Lg, ...): stage p holds groups r P + p
        staged = jax.tree.map(lambda w: w.reshape(v, stages, group, *w.shape[1:]).swapaxes(0, 1), blocks)
        data = {"inputs": micro(inputs_bt), "targets": micro(targets_bt), "weights": micro(weights_bt),
                "docs": {k: micro(d) for k, d in docs.items()}}
        d_staged, d_outer, total = jax.shard_map(
            functools.partial(_run, table, graphdef, run_group, functools.partial(head_loss, one_hot=vocab_split),
                              compute_dtype, split_w, fwd_ring, bwd_ring, last, like_stage_weights),
            mesh=mesh, in_specs=(P(AXIS), P(), P()), out_specs=(P(AXIS), P(), P()), axis_names={AXIS},
            check_vma=False)(staged, outer, data)
        d_blocks = jax.tree.map(lambda g, w: g.swapaxes(0, 1).reshape(w.shape).astype(w.dtype), d_staged, blocks)
        d_outer = jax.tree.map(lambda g, w: g.astype(w.dtype), d_outer, outer)
        return total, {**d_outer, "blocks": d_blocks}

    @jax.custom_vjp
    def total(params, inputs_bt, targets_bt, weights_bt, docs):
        return schedule_grads(params, inputs_bt, targets_bt, weights_bt, docs)[0]

    def total_fwd(params, inputs_bt, targets_bt, weights_bt, docs):
        value, grads = schedule_grads(params, inputs_bt, targets_bt, weights_bt, docs)
        return value, (grads, inputs_bt, targets_bt, weights_bt, docs)

    def total_bwd(saved, g):
        grads, *rest = saved
        zero = lambda x: (np.zeros(x.shape, jax.dtypes.float0) if jnp.issubdtype(x.dtype, jnp.integer)  # noqa: E731
                          else jnp.zeros_like(x))
        return (jax.tree.map(lambda d: (d * g).astype(d.dtype), grads), *jax.tree.map(zero, rest))

    total.defvjp(total_fwd, total_bwd)
    return total


def _run(table, graphdef, run_group, model_head_loss, compute_dtype, split_w, fwd_ring, bwd_ring, last,
         like_stage_weights, staged, outer, data):
    """One stage's part of the schedule (inside shard_map): (its blocks' gradients (1, v, Lg, ...),
    the embedding/head gradients summed over stages, the loss sum)."""
    staged = jax.tree.map(lambda w: w[0].astype(compute_dtype), staged)  # (v, Lg, ...) on this stage
    outer_c = jax.tree.map(lambda w: w.astype(compute_dtype), outer)
    stage = jax.lax.axis_index(AXIS)
    stages = len(fwd_ring)
    window, v = table.window, table.repeat.max() + 1

    def model_of(outer_c, group_blocks):
        return nnx.merge(graphdef, {**outer_c, "blocks": group_blocks})

    def embed(outer_c, tokens_bt):
        return model_of(outer_c, jax.tree.map(lambda w: w[0], staged)).embed(tokens_bt)

    def head_loss(outer_c, x_btd, targets_bt, weights_bt):
        return model_head_loss(model_of(outer_c, jax.tree.map(lambda w: w[0], staged)), x_btd, targets_bt, weights_bt)

    take = lambda tree, i: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
    group0 = take(staged, 0)
    blocks_graphdef = nnx.split(model_of(outer_c, group0).blocks)[0]

    @jax.custom_vjp
    def split_cotangent(group_blocks):  # the identity, whose cotangent is split as the weights are
        return group_blocks
    split_cotangent.defvjp(lambda w: (w, None), lambda _, ct: (like_stage_weights(ct),))

    def blocks_fn(group_blocks, x_btd, docs_bt):
        group_blocks = split_cotangent(group_blocks)
        out = run_group(nnx.merge(blocks_graphdef, group_blocks), x_btd, **docs_bt)
        return out[0] if isinstance(out, tuple) else out  # an MoE's auxiliary losses: 0 (step.pipeline_schedule)

    x_aval = jax.eval_shape(embed, outer_c, data["inputs"][0])
    docs0 = take(data["docs"], 0)
    x_spec = jax.ShapeDtypeStruct(x_aval.shape, x_aval.dtype)
    residuals = _Residuals(blocks_fn, group0, x_spec, docs0)
    split = _WeightSplit(residuals, group0, x_spec) if split_w else None
    # held per micro-batch: the forward's residuals, then (zero-bubble) what B leaves for W
    n_res = len(residuals.held_avals())
    held_avals = [*residuals.held_avals(), *(split.w_avals if split else [])]
    x_zero = jnp.zeros(x_aval.shape, x_aval.dtype)

    def f32_zeros(tree):
        return jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), tree)

    # operands of every branch: (r, m, x_in, ct_in, held residuals, d_staged, d_outer, total)
    def idle(r, m, x_in, ct_in, held, d_staged, d_outer, total):
        return x_zero, x_zero, held, x_zero, d_staged, d_outer, total

    def forward(first, is_last):
        def run(r, m, x_in, ct_in, held, d_staged, d_outer, total):
            if first:
                x_in = embed(outer_c, data["inputs"][m])
            out, vjp_fn = jax.vjp(blocks_fn, take(staged, r), x_in, take(data["docs"], m))
            ct_out = x_zero
            if is_last:
                value, (d_head, ct_out) = jax.value_and_grad(head_loss, argnums=(0, 1))(
                    outer_c, out, data["targets"][m], data["weights"][m])
                total = total + value
                d_outer = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), d_outer, d_head)
                out = x_zero
            return (out, x_zero, [*residuals.held(vjp_fn), *held[n_res:]], ct_out.astype(x_zero.dtype), d_staged,
                    d_outer, total)
        return run

    def add_group(d_staged, r, d_group):
        return jax.tree.map(lambda a, b: a.at[r].add(b.astype(jnp.float32)), d_staged, d_group)

    def backward(first):
        def run(r, m, x_in, ct_in, held, d_staged, d_outer, total):
            if split is None:
                d_group, d_x, _ = residuals.vjp_fn(take(staged, r), held)(ct_in)
            else:  # zero-bubble: the input cotangent now, most weight gradients at W
                d_x, d_group, w_inputs = split.input_grad(take(staged, r), held[:n_res], ct_in)
                held = [*held[:n_res], *w_inputs]
            d_staged = add_group(d_staged, r, d_group)
            if first:  # the embedding's backward
                d_embed = jax.vjp(lambda o: embed(o, data["inputs"][m]), outer_c)[1](d_x)[0]
                d_outer = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), d_outer, d_embed)
            return x_zero, (x_zero if first else d_x), held, x_zero, d_staged, d_outer, total
        return run

    def weight(r, m, x_in, ct_in, held, d_staged, d_outer, total):
        d_staged = add_group(d_staged, r, split.weight_grad(take(staged, r), held[:n_res], held[n_res:]))
        return x_zero, x_zero, held, x_zero, d_staged, d_outer, total

    branches = [idle, forward(False, False), forward(True, False), forward(False, True), backward(False),
                backward(True), weight if split else idle]  # by kind: timetable.IDLE ... W
    if last == 0:
        raise AssertionError("a single virtual stage is not a pipeline")
    kind_t, micro_t, repeat_t = (jnp.asarray(a) for a in (table.kind, table.micro, table.repeat))
    prev = lambda a, t, p: jnp.where(t > 0, a[jnp.maximum(t - 1, 0), p], 0)  # noqa: E731

    def slot(carry, t):
        acts, cts, held_buf, send_f, send_b, d_staged, d_outer, total = carry
        recv_f = jax.lax.ppermute(send_f, AXIS, fwd_ring)
        recv_b = jax.lax.ppermute(send_b, AXIS, bwd_ring)
        # what arrived: the previous stage's F output / the next stage's B input cotangent of slot t - 1
        src_f, src_b = (stage - 1) % stages, (stage + 1) % stages
        kf, kb = prev(kind_t, t, src_f), prev(kind_t, t, src_b)
        got_f = (kf == tt.F) | (kf == tt.F_FIRST)
        got_b = kb == tt.B  # B_FIRST (virtual stage 0) sends nothing
        rf = prev(repeat_t, t, src_f) + jnp.where(stage == 0, 1, 0)
        rb = prev(repeat_t, t, src_b) - jnp.where(stage == stages - 1, 1, 0)
        mf, mb = prev(micro_t, t, src_f) % window, prev(micro_t, t, src_b) % window
        rf, rb = jnp.clip(rf, 0, v - 1), jnp.clip(rb, 0, v - 1)
        acts = acts.at[rf, mf].set(jnp.where(got_f, recv_f, acts[rf, mf]))
        cts = cts.at[rb, mb].set(jnp.where(got_b, recv_b, cts[rb, mb]))
        kind, m, r = kind_t[t, stage], micro_t[t, stage], repeat_t[t, stage]
        w = m % window
        held = [h[r, w] for h in held_buf]
        out, d_x, new_held, ct_out, d_staged, d_outer, total = jax.lax.switch(
            kind, branches, r, m, acts[r, w], cts[r, w], held, d_staged, d_outer, total)
        writes = (kind == tt.F) | (kind == tt.F_FIRST) | (kind == tt.F_LAST)
        if split is not None:  # B writes what it leaves for W
            writes = writes | (kind == tt.B) | (kind == tt.B_FIRST)
        held_buf = [h.at[r, w].set(jnp.where(writes, n, h[r, w])) for h, n in zip(held_buf, new_held)]
        cts = cts.at[r, w].set(jnp.where(kind == tt.F_LAST, ct_out, cts[r, w]))
        return (acts, cts, held_buf, out, d_x, d_staged, d_outer, total), None

    buf = jnp.zeros((v, window, *x_aval.shape), x_aval.dtype)
    held_buf = [jnp.zeros((v, window, *a.shape), a.dtype) for a in held_avals]
    carry = (buf, buf, held_buf, x_zero, x_zero,
             f32_zeros(staged), f32_zeros(outer), jnp.zeros((), jnp.float32))
    carry = jax.lax.scan(slot, carry, jnp.arange(table.slots))[0]
    *_, d_staged, d_outer, total = carry
    d_outer = jax.lax.psum(d_outer, AXIS)
    total = jax.lax.psum(total, AXIS)
    return jax.tree.map(lambda g: g[None], d_staged), d_outer, total
