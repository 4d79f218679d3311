"""A sharded train step equals the single-device step; the compiled program holds what each
strategy promises (per-device bytes, collectives)."""

import math
import re

import jax
import numpy as np
import pytest

from conftest import TINY
from shardtrain import config, offload, step
from shardtrain.parallel import mesh as mesh_lib, sharding
from shardtrain.parallel.sharding import shard_bytes
from shardtrain.plan import hlo

SMALL = [*TINY, "model.d_model=64", "model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=128",
         "train.global_batch_size=16"]


def one_step(cfg, devices=None):
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, prog.abstract_batch().shape, dtype=np.int32)
    state, metrics = prog.step(prog.init(cfg.train.seed), jax.device_put(tokens, prog.batch_sharding))
    return float(metrics["loss"]), jax.tree.map(np.asarray, state["params"])


def rel_diff(a, b):
    return max(np.linalg.norm(x - y) / np.linalg.norm(y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def reference():
    """model name -> (loss, params) of one step on a single device."""
    return {name: one_step(config.load(None, [*SMALL, f"model.name={name}"]), jax.devices()[:1])
            for name in ("gpt", "mlp")}


@pytest.mark.parametrize("model, data, fsdp, tensor", [
    ("gpt", 8, 1, 1), ("gpt", 1, 8, 1), ("gpt", 1, 1, 8), ("gpt", 2, 2, 2), ("gpt", 4, 1, 2), ("mlp", 2, 2, 2)])
def test_sharded_step_equals_single_device(reference, model, data, fsdp, tensor):
    cfg = config.load(None, [*SMALL, f"model.name={model}", f"mesh.data={data}", f"mesh.fsdp={fsdp}",
                             f"mesh.tensor={tensor}"])
    loss, params = one_step(cfg)
    ref_loss, ref_params = reference[model]
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert rel_diff(params, ref_params) <= 1e-5


def test_grad_accumulation_equals_full_batch(reference):
    loss, params = one_step(config.load(None, [*SMALL, "train.grad_accum_steps=4", "mesh.data=2", "mesh.fsdp=2",
                                               "mesh.tensor=2"]))
    ref_loss, ref_params = reference["gpt"]
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert rel_diff(params, ref_params) <= 1e-5


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_policies_keep_the_numbers(reference, policy):
    loss, params = one_step(config.load(None, [*SMALL, f"train.remat={policy}", "mesh.fsdp=8"]))
    assert abs(loss - reference["gpt"][0]) <= 1e-5 * reference["gpt"][0]
    assert rel_diff(params, reference["gpt"][1]) <= 1e-5


def steps_of(cfg, n: int = 3):
    """(losses, params, state) after `n` steps of one random batch."""
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, prog.abstract_batch().shape, dtype=np.int32)
    state, losses = prog.init(cfg.train.seed), []
    for _ in range(n):
        state, metrics = prog.step(state, jax.device_put(tokens, prog.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, jax.tree.map(np.asarray, state["params"]), state


OFFLOAD_MESH = [*TINY, "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]


@pytest.fixture(scope="module")
def plain_steps():
    return steps_of(config.load(None, OFFLOAD_MESH))[:2]


@pytest.mark.parametrize("offload", [["train.offload.optimizer=true"],
                                     ["train.offload.optimizer=true", "train.offload.params=true",
                                      "train.on_nonfinite=skip"]])
def test_offloaded_state_lives_on_the_host_and_keeps_the_numbers_bit_for_bit(plain_steps, offload):
    losses, params = plain_steps
    off_losses, off_params, state = steps_of(config.load(None, [*OFFLOAD_MESH, *offload]))
    assert off_losses == losses and len(set(losses)) > 1
    assert all((a == b).all() for a, b in zip(jax.tree.leaves(off_params), jax.tree.leaves(params)))
    kinds = {k: {x.sharding.memory_kind for x in jax.tree.leaves(state[k])} for k in ("params", "opt", "step")}
    assert kinds == {"params": {"pinned_host" if "train.offload.params=true" in offload else "device"},
                     "opt": {"pinned_host"}, "step": {"device"}}


def test_streamed_offloaded_update_keeps_the_numbers_and_the_state_on_the_host(plain_steps, monkeypatch):
    """The TPU's update (offload.py), forced on CPU: the optimizer state streamed through the device
    a slice at a time, with nonfinite steps skipped, gives the plain run's losses and parameters up
    to the last bit of a fused multiply-add."""
    losses, params = plain_steps
    monkeypatch.setattr(offload, "streams", lambda cfg, platform: True)
    traced, streamed_update = [], offload.streamed_update

    def spied(*args):
        update = streamed_update(*args)
        return lambda *a: traced.append(a) or update(*a)
    monkeypatch.setattr(offload, "streamed_update", spied)
    off_losses, off_params, state = steps_of(config.load(
        None, [*OFFLOAD_MESH, "train.offload.optimizer=true", "train.on_nonfinite=skip"]))
    np.testing.assert_allclose(off_losses, losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(off_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state["opt"])} == {"pinned_host"}
    assert int(state["opt"][1][0].count) == 3 and traced  # the streamed update made the step


@pytest.mark.slow  # 8 compiles of the step's gradients, about 30 s on 2 loaded cores
def test_named_remat_policies_keep_the_numbers_and_recompute_less_the_more_they_save():
    """Each policy's losses and gradients equal remat none's; the compiled FLOPs order none < minimal
    (saves every projection) < save_dot_except_mlp (the MLP's recomputed) < save_qkv_proj (the
    attention's output projection too) < full, and the single-name policies lie between."""
    overrides = [*TINY, "mesh.data=1", "mesh.fsdp=8"]
    params, batch = None, None

    def run(policy):
        nonlocal params, batch
        cfg = config.load(None, [*overrides, f"train.remat={policy}"])
        prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
        if params is None:
            params = prog.init(0)["params"]
            batch = jax.device_put(np.random.default_rng(0).integers(
                0, cfg.model.vocab_size, prog.abstract_batch().shape, dtype=np.int32), prog.batch_sharding)
        compiled = prog.loss_and_grads.lower(params, batch).compile()
        losses, grads = compiled(params, batch)
        return float(losses["loss"]), jax.tree.map(np.asarray, grads), compiled.cost_analysis()["flops"]

    runs = {p: run(p) for p in ("none", "minimal", "save_dot_except_mlp", "save_qkv_proj", "full",
                                "save_out_proj", "save_attn_out", "save_mlp_gate_up")}
    loss, grads, _ = runs["none"]
    for policy, (policy_loss, policy_grads, _) in runs.items():
        assert abs(policy_loss - loss) <= 1e-6 * loss and rel_diff(policy_grads, grads) <= 1e-6, policy
    flops = {p: f for p, (_, _, f) in runs.items()}
    ordered = [flops[p] for p in ("none", "minimal", "save_dot_except_mlp", "save_qkv_proj", "full")]
    assert ordered == sorted(set(ordered)), flops
    assert all(flops["minimal"] < flops[p] < flops["full"] for p in ("save_out_proj", "save_attn_out",
                                                                      "save_mlp_gate_up")), flops


def test_activation_sharding_is_a_rules_change(reference):
    """The residual stream's model dimension is a logical name: sharding it is one rules row."""
    overrides = [*SMALL, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    clash = config.load(None, [*overrides, "rules.activation_embed=data"])  # data already shards the batch
    prog = step.build(clash, mesh_lib.make_mesh(clash.mesh))
    with pytest.raises(config.ConfigError, match="activation .*'activation_embed'"):
        prog.step.trace(prog.abstract_state, prog.abstract_batch())
    loss, params = one_step(config.load(None, [*overrides, "rules.activation_embed=tensor"]))
    assert abs(loss - reference["gpt"][0]) <= 1e-5 * reference["gpt"][0]
    assert rel_diff(params, reference["gpt"][1]) <= 1e-5


def test_bf16_compute_stays_close(reference):
    loss, _ = one_step(config.load(None, [*SMALL, "train.compute_dtype=bfloat16", "mesh.data=8"]))
    assert abs(loss - reference["gpt"][0]) <= 2e-2 * reference["gpt"][0]


def test_optimizer_state_is_sharded_like_params():
    cfg = config.load(None, [*SMALL, "mesh.fsdp=4", "mesh.tensor=2"])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    adam = prog.state_shardings["opt"][1][0]
    params = prog.state_shardings["params"]
    assert jax.tree.map(lambda s: s.spec, adam.mu) == jax.tree.map(lambda s: s.spec, params)
    assert jax.tree.map(lambda s: s.spec, adam.nu) == jax.tree.map(lambda s: s.spec, params)
    state = prog.init(0)
    assert state["opt"][1][0].mu["blocks"]["w_up_df"].sharding.spec == params["blocks"]["w_up_df"].spec


def analytic_bytes(prog) -> int:
    """Parameters + optimizer state per device: each array's bytes / the product of its spec's axes."""
    total = 0
    for x in jax.tree.leaves(prog.abstract_state):
        ways = math.prod(sharding.axes_size(prog.mesh, entry) for entry in x.sharding.spec)
        assert math.prod(x.shape) % ways == 0
        total += math.prod(x.shape) * x.dtype.itemsize // ways
    return total


@pytest.mark.parametrize("data, fsdp, tensor", [(8, 1, 1), (1, 8, 1), (2, 2, 2)])
def test_compiled_argument_bytes_are_the_shards(data, fsdp, tensor):
    cfg = config.load(None, [*SMALL, f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    compiled = prog.lower().compile()
    batch_bytes = shard_bytes(prog.abstract_batch())
    state_bytes = compiled.memory_analysis().argument_size_in_bytes - batch_bytes
    assert state_bytes == analytic_bytes(prog) == shard_bytes(prog.abstract_state)
    params = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(prog.abstract_state["params"]))
    if fsdp == 8:  # every weight matrix split 8 ways; only the norm scales stay whole
        norms = sum(math.prod(x.shape) * 4 for p, x in jax.tree_util.tree_leaves_with_path(
            prog.abstract_state["params"]) if "norm" in jax.tree_util.keystr(p))
        assert shard_bytes(prog.abstract_state["params"]) == (params - norms) // 8 + norms


def compiled_text(*overrides):
    cfg = config.load(None, [*SMALL, *overrides])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    return prog, prog.lower().compile().as_text()


def test_data_parallel_all_reduces_every_gradient_once_and_gathers_nothing():
    prog, text = compiled_text("mesh.data=8")
    found = hlo.collectives(text, dict(prog.mesh.shape))
    assert {(c.kind, c.axes) for c in found} == {("all-reduce", ("data",))}
    params = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(prog.abstract_state["params"]))
    assert params <= sum(c.bytes * c.count for c in found) <= params + 16  # + the loss and metric scalars


def test_fsdp_gathers_weights_not_activations():
    # layers unrolled: the text then holds every layer's gathers (a rolled scan's body holds one layer's)
    prog, text = compiled_text("mesh.fsdp=8", "train.scan_unroll=2")
    params = prog.abstract_state["params"]
    # one layer's share of each weight (its full size for the embedding tables)
    weights = {math.prod(x.shape[1:]) if "blocks" in jax.tree_util.keystr(p) else math.prod(x.shape)
               for p, x in jax.tree_util.tree_leaves_with_path(params) if "norm" not in jax.tree_util.keystr(p)}
    gathered = [[int(d) for d in dims.split(",")]
                for dims in re.findall(r"= (?:f32|bf16)\[([\d,]+)\]\S* all-gather(?:-start)?\(", text)]
    # arrays of a weight's size, in its own layout (`layers.gathered`), never a (B, T, D) activation's
    assert gathered and all(math.prod(g) in weights for g in gathered), gathered
    sizes = {jax.tree_util.keystr(p): math.prod(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params)
             if "norm" not in jax.tree_util.keystr(p)}
    blocks = sum(n for p, n in sizes.items() if "blocks" in p)
    # every block weight, forward (and backward); an embedding table may be looked up where it lies
    assert blocks <= sum(map(math.prod, gathered)) <= 2 * sum(sizes.values())
