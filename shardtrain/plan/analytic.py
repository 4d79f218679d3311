"""A config's step and memory before compiling it: the analytical model `plan --search` ranks meshes
by, so that it compiles only the most promising (a 128-chip slice has hundreds of meshes; each
compile takes minutes), and that tune.py orders remat policies by. Per device, from the built
program's parameter shardings and the config:

  - compute: the model's FLOPs (`Program.flops_per_token`) over the devices, plus what the remat
    policy recomputes per layer and token (`RECOMPUTED` of `per_token_layer`), at the chip's peak,
    stretched by a pipeline's bubble;
  - communication, each collective's ring traffic at the bandwidth of its axes (DCN where an axis
    crosses slices or hosts, else ICI), as plan counts them:
      - FSDP: each weight shard gathered (again in the backward pass under any remat policy, which
        recomputes the gather) and its gradient reduce-scattered, in the compute dtype; gradients of
        weights replicated over a batch axis all-reduced there;
      - tensor parallelism: 4 all-reduces of a layer's activations per layer (2 forward, 2 backward),
        6 with remat;
      - context parallelism: the ring passes each layer's keys and values around once forward and
        twice backward (once more with remat);
      - expert parallelism: 4 all-to-alls of the routed rows per MoE layer (6 with remat);
      - pipeline: each micro-batch's activations between stages, forward and backward.
  - memory: the state's shards, a gradient of the parameters' shards (two with grad accumulation: one
    and their sum), and per layer and token the layer's input and the outputs the remat policy saves
    (`SAVED`).
Memory time (HBM bytes) is left out: it barely depends on the mesh. The model only orders meshes;
the compiled programs decide among the ones it keeps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from shardtrain import chips as chips_lib, step as step_lib
from shardtrain.config import MESH_AXES, RunConfig
from shardtrain.parallel import mesh as mesh_lib, sharding

BATCH_AXES = ("data", "fsdp", "expert", "context")
"""The axes that split the batch: a weight not sharded over one of them has its gradient reduced there."""
FITS_WITH_ROOM = 0.8
"""The share of the memory a mesh's guessed bytes may take to count as fitting with room: the guess
leaves out a layer's working set (its recompute, an MoE's dispatch buffers, the logits), a fifth or
more of the total on the shipped configs."""
RECOMPUTED = {"none": (), "minimal": ("attention",), "save_dot_except_mlp": ("attention", "mlp"),
              "save_qkv_proj": ("attention", "out", "mlp"), "full": ("attention", "out", "mlp", "qkv")}
"""The parts of a layer whose forward a remat policy runs again (a policy not named here: as full)."""
SAVED = {"none": ("qkv", "out", "mlp_in", "mlp_out", "attention"), "minimal": ("qkv", "out", "mlp_in", "mlp_out"),
         "save_dot_except_mlp": ("qkv", "out"), "save_qkv_proj": ("qkv",), "full": ()}
"""The outputs a remat policy keeps per layer besides the layer's input."""


def per_token_layer(cfg: RunConfig, tensor: int) -> tuple[dict[str, float], dict[str, float]]:
    """(forward FLOPs, saved activation elements) per token and layer on one device, by part: the
    q/k/v projections, the output projection, the MLP (its gate / up outputs `mlp_in`, its down
    output `mlp_out`) and attention (causal: half the T x T scores); heads and MLP units split over
    `tensor`."""
    m = cfg.model
    d, e, t = m.d_model, m.head_size, cfg.data.seq_len
    f = m.d_ff * (m.moe.experts_per_token if m.moe.n_experts > 1 else 1)
    qkv = (m.n_heads + 2 * m.n_kv_heads) * e / tensor
    flops = {"qkv": 2 * d * qkv, "out": 2 * m.n_heads * e * d / tensor, "mlp": 6 * d * f / tensor,
             "attention": 2 * t * m.n_heads * e / tensor}
    saved = {"qkv": qkv, "out": d, "mlp_in": 2 * f / tensor, "mlp_out": d, "attention": m.n_heads * e / tensor}
    return flops, saved


def spec_axes(sharding) -> tuple[str, ...]:
    return tuple(a for part in sharding.spec if part for a in ((part,) if isinstance(part, str) else part))


def predict(prog: step_lib.Program, chip: chips_lib.Chip) -> dict[str, float]:
    """{'compute_s', 'comm_s', 'step_s', 'device_bytes'} of `prog` on devices of `chip` (a per-device
    chip: `planner.per_device`)."""
    cfg, shape = prog.cfg, dict(prog.mesh.shape)
    n = math.prod(shape.values())
    dcn = {a for a in MESH_AXES if getattr(cfg.mesh.dcn, a) > 1} | mesh_lib.cross_granule_axes(prog.mesh)
    size = jnp.dtype(cfg.train.compute_dtype).itemsize
    remat = cfg.train.remat not in ("none", "minimal")  # the policies that run attention's collectives again

    def seconds(traffic: float, axes) -> float:
        return traffic / (chip.dcn_bandwidth if dcn.intersection(axes) else chip.ici_bandwidth)

    comm = 0.0
    for leaf in jax.tree.leaves(prog.abstract_state["params"]):
        axes = spec_axes(leaf.sharding)
        shard = math.prod(leaf.shape) * size / math.prod(shape[a] for a in axes)
        if "fsdp" in axes:  # gathered (again in the backward pass under remat), the gradient reduce-scattered
            comm += seconds((2 if cfg.train.remat == "none" else 3) * shard * (shape["fsdp"] - 1), ("fsdp",))
        replicas = [a for a in BATCH_AXES if a not in axes and shape[a] > 1]
        r = math.prod(shape[a] for a in replicas)
        comm += seconds(2 * shard * (r - 1) / r, replicas)

    m = cfg.model
    tokens = cfg.train.global_batch_size * cfg.data.seq_len / math.prod(shape[a] for a in BATCH_AXES)
    layers = m.n_layers / shape["pipeline"]
    activations = tokens * m.d_model * size
    t, ctx, e = shape["tensor"], shape["context"], shape["expert"]
    if t > 1:
        comm += seconds(layers * (6 if remat else 4) * 2 * activations * (t - 1) / t, ("tensor",))
    if ctx > 1:
        kv = tokens * 2 * m.n_kv_heads * m.head_size * size
        comm += seconds(layers * (4 if remat else 3) * kv * (ctx - 1), ("context",))
    if e > 1 and m.moe.n_experts > 1:
        moe_layers = (m.n_layers - m.moe.first_dense_layers) / shape["pipeline"]
        rows = activations * m.moe.experts_per_token * m.moe.receive_buffer
        comm += seconds(moe_layers * (6 if remat else 4) * rows * (e - 1) / e, ("expert",))
    if shape["pipeline"] > 1:
        comm += seconds(2 * activations, ("pipeline",))

    flops_part, saved_part = per_token_layer(cfg, t)
    recomputed = RECOMPUTED.get(cfg.train.remat, RECOMPUTED["full"])
    flops = (prog.flops_per_token * cfg.train.global_batch_size * cfg.data.seq_len / n
             + layers * tokens * sum(flops_part[p] for p in recomputed))
    bubble = prog.schedule.bubble_fraction if prog.schedule else 0.0
    compute = flops / chip.peak_flops / (1 - bubble)
    saved = m.d_model + sum(saved_part[p] for p in SAVED.get(cfg.train.remat, ()))
    gradients = sharding.shard_bytes(prog.abstract_state["params"]) * (2 if cfg.train.grad_accum_steps > 1 else 1)
    device_bytes = (sharding.shard_bytes(prog.abstract_state) + gradients
                    + layers * tokens / cfg.train.grad_accum_steps * saved * size)
    return {"compute_s": compute, "comm_s": comm, "step_s": compute + comm, "device_bytes": device_bytes}
