"""Mixture of experts: routing against a naive dense mixture, expert parallelism against one device,
and the compiled program's collectives."""

import math

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models import contract, moe as moe_lib
from shardtrain import chips, config, step as step_lib
from shardtrain.parallel import mesh as mesh_lib
from shardtrain.plan import hlo, planner, topology

SMALL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64", "model.n_layers=2",
         "model.moe.n_experts=4", "model.moe.experts_per_token=2", "data.seq_len=32", "train.global_batch_size=8",
         "data.source=synthetic"]


def layer_and_input(*overrides, t=16):
    cfg = config.load(None, [*SMALL, *overrides]).model
    layer = moe_lib.Moe(cfg, rngs=nnx.Rngs(params=0), constrain=contract.no_constraint)
    h_btd = jax.random.normal(jax.random.key(1), (2, t, cfg.d_model))
    return cfg, layer, h_btd


def naive_mixture(layer, cfg, h_btd, capacity=None):
    """Each token through each of its top-k experts one by one, weighted by its softmax
    probabilities (renormalised over the k with norm_topk_prob); with `capacity`, an expert takes
    only its first `capacity` assignments in (token, k) order."""
    h_nd = np.asarray(h_btd, np.float64).reshape(-1, cfg.d_model)
    probs = np.exp(h_nd @ np.asarray(layer.router_de[...], np.float64))
    probs /= probs.sum(-1, keepdims=True)
    wg, wu, wd = (np.asarray(w[...], np.float64) for w in (layer.w_gate_edf, layer.w_up_edf, layer.w_down_efd))
    out = np.zeros_like(h_nd)
    taken = np.zeros(cfg.moe.n_experts, int)
    for n, x in enumerate(h_nd):
        top = np.argsort(-probs[n], kind="stable")[:cfg.moe.experts_per_token]
        for e in top:
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                continue
            g, u = x @ wg[e], x @ wu[e]
            weight = probs[n, e] / (probs[n, top].sum() if cfg.moe.norm_topk_prob else 1.0)
            out[n] += weight * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    if cfg.moe.n_shared_experts:
        g, u = h_nd @ np.asarray(layer.shared_w_gate_df[...]), h_nd @ np.asarray(layer.shared_w_up_df[...])
        shared = (g / (1 + np.exp(-g)) * u) @ np.asarray(layer.shared_w_down_fd[...])
        if cfg.moe.shared_expert_gate:
            shared /= 1 + np.exp(-h_nd @ np.asarray(layer.shared_expert_gate_d1[...]))
        out += shared
    return out.reshape(h_btd.shape)


QWEN2_MOE = ("model.moe.n_shared_experts=1", "model.moe.shared_expert_d_ff=48", "model.moe.shared_expert_gate=true",
             "model.moe.norm_topk_prob=false")


@pytest.mark.parametrize("overrides", [(), QWEN2_MOE, ("model.moe.receive_buffer=0.3",)])
def test_dropless_routing_is_the_dense_mixture_of_each_tokens_top_k_experts(overrides):
    """receive_buffer 0.3: the experts take 0.3 x 64 of the 64 assignments per round, so 4 rounds."""
    cfg, layer, h_btd = layer_and_input(*overrides)
    out_btd, aux = jax.jit(layer)(h_btd)
    np.testing.assert_allclose(np.asarray(out_btd), naive_mixture(layer, cfg, h_btd), atol=1e-5)
    assert set(aux) == {"moe_aux_loss", "router_z_loss"}


def test_capacity_drops_assignments_past_each_experts_capacity_in_token_order():
    cfg, layer, h_btd = layer_and_input("model.moe.capacity_factor=0.25", t=16)
    cap = moe_lib.capacity(cfg, 2 * 16 * cfg.moe.experts_per_token)
    assert cap == 4  # 0.25 x 64 assignments / 4 experts
    np.testing.assert_allclose(np.asarray(jax.jit(layer)(h_btd)[0]), naive_mixture(layer, cfg, h_btd, cap), atol=1e-5)


def program(*overrides, devices=None):
    cfg = config.load(None, [*SMALL, *overrides])
    return step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))


def assert_same_losses_and_grads(reference, other, batch):
    """Losses and gradients of `other`'s step (before any update) = `reference`'s, to 1e-5;
    returns (reference's losses, other's compiled loss_and_grads)."""
    params = reference.init(0)["params"]
    params_b = jax.device_put(params, other.state_shardings["params"])
    batch_b = jax.device_put(batch, other.batch_sharding)
    compiled = other.loss_and_grads.lower(params_b, batch_b).compile()
    losses_a = assert_same(reference.loss_and_grads(params, jax.device_put(batch, reference.batch_sharding)),
                           compiled(params_b, batch_b))
    return losses_a, compiled


def assert_same(losses_and_grads_a, losses_and_grads_b):
    """The same losses (rtol 1e-5) and gradients (atol 1e-5 x the largest); returns the first losses."""
    (losses_a, grads_a), (losses_b, grads_b) = losses_and_grads_a, losses_and_grads_b
    assert set(losses_a) == set(losses_b)
    for k in losses_a:
        np.testing.assert_allclose(np.asarray(losses_b[k]), np.asarray(losses_a[k]), rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * max(1.0, float(np.abs(a).max())))
    return losses_a


@pytest.mark.slow
def test_expert_and_context_parallel_losses_gradients_and_collectives():
    """The Qwen2-MoE router (gated shared expert, raw top-k weights) on expert x context x fsdp:
    losses and gradients = one device's; tokens reach their experts by all-to-all over `expert`
    (the only all-gathers over it are of the other weights, FSDP-sharded over fsdp x expert), attention
    passes key/value blocks by collective-permute over `context` (no all-gather over it). Tensor
    parallelism inside the experts: tests/hf/test_hf_parity.py's expert x fsdp x tensor parity; expert=4: the
    acceptance's losses."""
    batch = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
    sized = (*QWEN2_MOE, "model.d_ff=80")  # an expert weight's size differs from every other weight's
    one = program(*sized, devices=jax.devices()[:1])
    # the one-hot embedding: a gather from the fsdp-sharded table makes XLA all-gather its rows
    other = program(*sized, "mesh.expert=2", "mesh.context=2", "mesh.fsdp=2", "model.embed=one_hot")
    losses, compiled = assert_same_losses_and_grads(one, other, batch)
    assert float(losses["moe_aux_loss"]) > 0 and float(losses["router_z_loss"]) > 0
    colls = hlo.collectives(compiled.as_text(), dict(other.mesh.shape))
    assert any(c.kind.startswith("all-to-all") and c.axes == ("expert",) for c in colls), colls
    assert any(c.kind.startswith("collective-permute") and c.axes == ("context",) for c in colls), colls
    # each weight's bytes per layer, by its logical names: expert weights carry `experts`
    names = jax.tree.leaves(one.layout.names, is_leaf=lambda n: isinstance(n, tuple))
    layer_bytes = [("experts" in n, math.prod(d for d, a in zip(x.shape, n) if a != "layers") * x.dtype.itemsize)
                   for n, x in zip(names, jax.tree.leaves(one.abstract_state["params"]))]
    expert_bytes = {b for is_expert, b in layer_bytes if is_expert}
    other_bytes = {b for is_expert, b in layer_bytes if not is_expert}
    assert expert_bytes and not expert_bytes & other_bytes
    gathered = [c for c in colls if c.kind.startswith("all-gather") and {"expert", "context"} & set(c.axes)]
    assert gathered and all(c.bytes in other_bytes and "context" not in c.axes for c in gathered), gathered


@pytest.mark.slow
def test_bounded_dropless_dispatch_on_expert_x_fsdp_equals_one_device_for_any_routing():
    """Dropless routing on expert 4 x fsdp 2 with receive buffers of a quarter of a balanced load
    (16 of each device's 64 assignments per round: 4 rounds when balanced, 16 when every token
    picks experts 0 and 1, both on the first expert shard): losses and gradients = one device's
    (dropless in one round there, itself the dense mixture: the test above), for uniform, skewed
    and all-to-one routing (a router bias on experts 0 and 1)."""
    moe = ["model.moe.router=sigmoid", "model.moe.n_experts=8", "model.moe.n_groups=1", "model.moe.topk_groups=1"]
    one = program(*moe, devices=jax.devices()[:1])
    other = program(*moe, "mesh.expert=4", "mesh.fsdp=2", "model.moe.receive_buffer=0.25")
    batch = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
    params = one.init(0)["params"]
    bias = params["blocks"]["moe"]["router_bias_e"]
    for routing, on_first_two in (("uniform", 0.0), ("skewed", 0.5), ("all_to_one", 30.0)):
        params["blocks"]["moe"]["router_bias_e"] = bias.at[:, :2].set(on_first_two)
        losses = assert_same(one.loss_and_grads(params, jax.device_put(batch, one.batch_sharding)),
                             other.loss_and_grads(jax.device_put(params, other.state_shardings["params"]),
                                                  jax.device_put(batch, other.batch_sharding)))
        first_two = np.asarray(losses["router_load"])[:, :2].sum(-1)  # per layer: their share of the assignments
        assert {"uniform": first_two.max() < 0.5, "skewed": 0.5 < first_two.min() < 1,
                "all_to_one": np.all(first_two == 1)}[routing], (routing, first_two)


def test_ragged_all_to_all_by_blocks_gives_jax_s_two_device_example():
    """XLA:CPU's stand-in for `jax.lax.ragged_all_to_all` (a dense all-to-all of blocks) on the
    example of that function's docstring: device 0 sends [1] to itself and [2, 2] to device 1 at 0,
    device 1 sends [3] to device 0 at 1 and [4] to itself at 2."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])

    def per_device(*args):
        return contract.ragged_all_to_all_by_blocks(lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True), *args)

    example = ([[1, 2, 2], [3, 4, 0]], np.zeros((2, 4)), [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]],
               [[1, 1], [2, 1]])  # operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
    args = [jax.device_put(np.array(a, np.int32).reshape(-1), NamedSharding(mesh, P("x"))) for a in example]
    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(run(*args)).reshape(2, 4), [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_on_tpus_tokens_travel_by_ragged_all_to_all_over_expert():
    """The TPU compiler (v5e:2x4, expert 4 x fsdp 2): each layer's tokens go to their experts and
    back by ragged all-to-alls over `expert`, forward and backward; the dense all-to-alls over it
    move only the row counts and offsets (a few int32s), none a buffer of tokens."""
    cfg = config.load(None, [*SMALL, "model.d_model=128", "model.d_ff=256", "model.vocab_size=256",
                             "data.seq_len=128", "train.global_batch_size=16", "hardware.chip=v5e",
                             "hardware.topology=2x4", "mesh.expert=4", "mesh.fsdp=2"])
    prog = step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, list(topology.devices(chips.CHIPS["v5e"], "2x4"))))
    colls = hlo.collectives(planner.compile_fast(prog.lower(), "tpu").as_text(), dict(prog.mesh.shape))
    ragged = [c for c in colls if c.kind == "ragged-all-to-all"]
    assert ragged and all(c.axes == ("expert",) for c in ragged), colls
    assert sum(c.count for c in ragged) == 4 * cfg.model.n_layers  # there and back, forward and backward
    dense = [c for c in colls if c.kind == "all-to-all" and c.axes == ("expert",)]
    assert dense and all(c.bytes <= 4 * 4 * 2 and c.dtypes == ("s32",) for c in dense), dense


DEEPSEEK = ["model.moe.router=sigmoid", "model.moe.n_groups=2", "model.moe.topk_groups=2",
            "model.moe.n_shared_experts=1", "model.moe.routed_scaling_factor=2.5", "model.moe.first_dense_layers=1",
            "model.n_layers=3", "model.moe.bias_update_rate=0.05", "optimizer.weight_decay=0.1"]


def test_sigmoid_routers_bias_moves_toward_balance_outside_the_gradient():
    """DeepSeek-V3's auxiliary-loss-free balancing on a skewed batch (a bias that sends every token to expert 0):
    the bias gets a gradient of exactly zero and no optimizer update (weight decay included), and each
    train step moves it by bias_update_rate x sign(mean load - load): down for the overloaded expert,
    up for the others, until the load evens out."""
    prog = program(*DEEPSEEK, devices=jax.devices()[:1])
    state = prog.init(0)
    bias = state["params"]["blocks"]["sparse"]["moe"]["router_bias_e"]
    state["params"]["blocks"]["sparse"]["moe"]["router_bias_e"] = bias.at[:, 0].set(1.0)  # every token picks expert 0
    batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32), prog.batch_sharding)
    losses, grads = prog.loss_and_grads(state["params"], batch)
    assert not np.any(np.asarray(grads["blocks"]["sparse"]["moe"]["router_bias_e"]))
    load = np.asarray(losses["router_load"])  # (MoE layers, experts): fractions of each layer's assignments
    assert load.shape == (2, 4) and np.allclose(load.sum(-1), 1) and np.all(load[:, 0] == 0.5)
    bias = np.asarray(state["params"]["blocks"]["sparse"]["moe"]["router_bias_e"])
    state, metrics = prog.step(state, batch)
    assert "router_load" not in metrics
    moved = np.asarray(state["params"]["blocks"]["sparse"]["moe"]["router_bias_e"]) - bias
    np.testing.assert_allclose(moved, 0.05 * np.sign(load.mean(-1, keepdims=True) - load), atol=1e-7)
    for _ in range(20):
        state, _ = prog.step(state, batch)
    after = np.asarray(prog.loss_and_grads(state["params"], batch)[0]["router_load"])
    assert np.all(after.max(-1) < load.max(-1)), (load, after)


class EmbedSplit(contract.NoConstraint):
    """No sharding, but a mesh that splits `embed` 4 ways; records each constraint asked for."""

    def __init__(self):
        self.asked = []

    def __call__(self, x, names):
        self.asked.append((tuple(x.shape), tuple(names)))
        return x

    def size(self, name):
        return 4 if name == "embed" else 1


def test_weights_split_along_the_model_dimension_are_gathered_whole_before_their_matmuls():
    """`layers.gathered`: where FSDP splits `embed`, the router and the shared experts read their weights
    constrained whole along it, the other dimensions as stored (left to the partitioner, a weight split
    along the dimension a matmul contracts becomes the TPU compiler's windowed loop, which reads and
    writes the whole output once per window: bench/README.md, DeepSeek-V2-Lite). Unsplit: no constraint."""
    cfg = config.load(None, [*SMALL, "model.moe.n_shared_experts=1"]).model
    split = EmbedSplit()
    layer = moe_lib.Moe(cfg, rngs=nnx.Rngs(params=0), constrain=split)
    layer(jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model)))
    d, f, e = cfg.d_model, cfg.d_ff, cfg.moe.n_experts
    weights = {shape: names for shape, names in split.asked if len(shape) == 2}
    assert weights[(d, e)] == (None, None)  # router: (embed, None)
    assert weights[(d, f)] == (None, "mlp") and weights[(f, d)] == ("mlp", None)  # shared gate / up, down
    unsplit = EmbedSplit()
    unsplit.size = lambda name: 1
    moe_lib.Moe(cfg, rngs=nnx.Rngs(params=0), constrain=unsplit)(jax.random.normal(jax.random.key(1), (2, 16, d)))
    assert not [shape for shape, _ in unsplit.asked if len(shape) == 2]
