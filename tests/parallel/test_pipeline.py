"""Pipeline parallelism: pipelined loss and gradients equal the plain model's, errors, HLO, training."""

import re

import jax
import numpy as np
import pytest

from conftest import TINY, run_steps
from shardtrain import config, step as step_lib
from shardtrain.config import ConfigError
from shardtrain.parallel import blocks, mesh as mesh_lib, pipeline, sharding

SMALL = [*TINY, "model.n_layers=8", "model.n_heads=2", "model.n_kv_heads=2", "train.global_batch_size=32"]


def setup(model, *overrides, n_devices=8):
    cfg = config.load(None, [f"model.name={model}", *SMALL, *overrides])
    mesh = mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:n_devices])
    return cfg, mesh, step_lib.build(cfg, mesh)


def loss_and_grads(prog, params, tokens_bt, runners):
    """[(loss, grads)] of the train step's loss (`step.loss_fn`) with each blocks runner, all in one
    jitted function on prog's mesh (one compile for several schedules)."""
    losses = [step_lib.loss_fn(prog.cfg, step_lib.loss_sums_fn(prog.cfg, prog.layout.graphdef, run_blocks))
              for run_blocks in runners]
    params = jax.device_put(params, prog.state_shardings["params"])
    tokens_bt = jax.device_put(tokens_bt, prog.batch_sharding)
    with jax.set_mesh(prog.mesh):
        objectives = [lambda p, t, loss=loss: loss(p, t)[0] for loss in losses]  # (objective, losses) -> objective
        return jax.jit(lambda p, t: [jax.value_and_grad(f)(p, t) for f in objectives])(params, tokens_bt)


def make_reference(model, *overrides):
    """(host params, tokens, loss, grads) of the plain model on one device."""
    cfg, _, prog = setup(model, *overrides, n_devices=1)
    params = jax.device_get(prog.init(0)["params"])
    tokens_bt = np.asarray(jax.random.randint(jax.random.key(1), (32, 17), 0, cfg.model.vocab_size))
    [(loss, grads)] = loss_and_grads(prog, params, tokens_bt, [blocks.scan_runner(cfg)])
    return params, tokens_bt, float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def mlp_reference():
    return make_reference("mlp")


def assert_pipelines_match(reference, model, overrides, microbatches, n_devices=8, tol=1e-5):
    """Pipelined loss and gradients equal the reference's for each micro-batch count."""
    params, tokens_bt, loss_ref, grads_ref = reference
    cfgs_meshes = [setup(model, *overrides, f"train.pipeline.microbatches={m}", n_devices=n_devices)[:2]
                   for m in microbatches]
    prog = setup(model, *overrides, f"train.pipeline.microbatches={microbatches[0]}", n_devices=n_devices)[2]
    results = loss_and_grads(prog, params, tokens_bt, [pipeline.runner(c, mesh) for c, mesh in cfgs_meshes])
    for m, (loss, grads) in zip(microbatches, results):
        assert abs(float(loss) - loss_ref) <= tol * abs(loss_ref), f"M={m}: loss {float(loss)} vs {loss_ref}"
        for (path, g), g_ref in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads_ref)):
            err = np.max(np.abs(np.asarray(g) - g_ref)) / np.max(np.abs(g_ref))
            assert err <= tol, f"M={m}: gradient {jax.tree_util.keystr(path)} differs by {err:.1e} relative"


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
def test_pipeline_alone_matches_plain(mlp_reference, stages, schedule):
    overrides = [f"mesh.pipeline={stages}", f"train.pipeline.schedule={schedule}", "train.pipeline.repeats=2"]
    assert_pipelines_match(mlp_reference, "mlp", overrides, [stages, 2 * stages, 4 * stages], n_devices=stages)


@pytest.mark.parametrize("mesh_overrides,schedule,microbatches", [
    (("mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2"), "gpipe", [4]),
    (("mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2"), "circular", [2]),
    (("mesh.pipeline=4", "mesh.data=2"), "circular", [16]),
    (("mesh.pipeline=4", "mesh.tensor=2"), "gpipe", [8]),
])
def test_pipeline_with_other_axes_matches_plain(mlp_reference, mesh_overrides, schedule, microbatches):
    overrides = [*mesh_overrides, f"train.pipeline.schedule={schedule}", "train.pipeline.repeats=2"]
    assert_pipelines_match(mlp_reference, "mlp", overrides, microbatches)


def test_uneven_layers_name_layers_stages_and_repeats():
    with pytest.raises(ConfigError, match=r"n_layers=6 .*mesh.pipeline=4 stages x train.pipeline.repeats=1"):
        setup("mlp", "model.n_layers=6", "mesh.pipeline=4", "mesh.data=2")
    with pytest.raises(ConfigError, match=r"n_layers=6 .*mesh.pipeline=2 stages x train.pipeline.repeats=2"):
        setup("mlp", "model.n_layers=6", "mesh.pipeline=2", "mesh.data=4", "train.pipeline.schedule=circular",
              "train.pipeline.repeats=2")


GEMMA = ["model.layer_pattern=[local,global]", "model.sliding_window=4", "model.norm_position=pre_post",
         "model.norm_scale=one_plus_weight", "model.attn_softcap=5.0", "model.activation=gelu_tanh"]


def test_local_and_global_layers_pipeline_like_plain_and_stages_start_at_the_pattern():
    """Gemma-like layers (local, global) x 4: each stage's layers start at the pattern's start, so
    GPipe (4 layers a stage) and circular (2 a group) match the plain model; 4 layers a stage of a
    3-kind pattern would not, and are refused."""
    reference = make_reference("gpt", *GEMMA)
    assert_pipelines_match(reference, "gpt", [*GEMMA, "mesh.pipeline=2", "mesh.data=4"], [4])
    assert_pipelines_match(reference, "gpt", [*GEMMA, "mesh.pipeline=2", "mesh.data=4", "train.pipeline.repeats=2",
                                              "train.pipeline.schedule=circular"], [2])
    with pytest.raises(ConfigError, match="each pipeline stage runs 4 consecutive layers, not a multiple of "
                                          "model.layer_pattern's 3 kinds"):
        setup("gpt", *GEMMA, "model.layer_pattern=[local,local,global]", "mesh.pipeline=2", "mesh.data=4")


def test_microbatches_must_divide_the_batch_and_cover_the_stages():
    with pytest.raises(ConfigError, match=r"train.pipeline.microbatches=3 must divide the 8 rows per data replica"):
        setup("mlp", "mesh.pipeline=2", "mesh.data=4", "train.pipeline.microbatches=3")
    with pytest.raises(ConfigError, match=r"train.pipeline.microbatches=2 must be >= mesh.pipeline=4 for the circular"):
        setup("mlp", "mesh.pipeline=4", "mesh.data=2", "train.pipeline.microbatches=2",
              "train.pipeline.schedule=circular", "train.pipeline.repeats=2")


def test_default_microbatches_and_bubble_fraction():
    demo = config.load("meshes/demo.yaml", ["mesh.data=1", "mesh.pipeline=2"])  # batch 32, fsdp 2: 16 rows
    demo_mesh = mesh_lib.make_mesh(demo.mesh)
    assert pipeline.microbatches(demo, demo_mesh) == 8
    assert pipeline.bubble_fraction(demo, demo_mesh) == pytest.approx(1 / 9)
    cfg, mesh, _ = setup("mlp", "mesh.pipeline=4", "mesh.data=2", "train.pipeline.microbatches=8")
    assert pipeline.bubble_fraction(cfg, mesh) == pytest.approx(3 / 11)
    cfg, mesh, _ = setup("mlp", "mesh.pipeline=4", "mesh.data=2", "train.pipeline.microbatches=8",
                         "train.pipeline.schedule=circular", "train.pipeline.repeats=2")
    assert pipeline.bubble_fraction(cfg, mesh) == pytest.approx(3 / 19)


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result shape) of every collective in an optimized HLO module."""
    pattern = r"= (\S+|\([^)]*\)) (all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(?:-start)?\("
    return [(m.group(2), m.group(1)) for m in re.finditer(pattern, hlo)]


def test_hlo_permutes_activations_and_keeps_each_stage_share():
    cfg, mesh, prog = setup("mlp", "mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", "train.pipeline.microbatches=4",
                            "train.pipeline.schedule=circular", "train.pipeline.repeats=2")
    compiled = prog.lower().compile()
    found = collectives(compiled.as_text())
    # activations: (B/M rows / fsdp, T, D) passed around the ring, forwards and backwards
    assert ("collective-permute", "f32[4,16,32]{2,1,0}") in found, found
    assert any(op == "all-to-all" for op, _ in found), "circular regrouping of the layers"
    # no collective carries a whole stacked parameter (8 layers, any sharding of the other dims)
    full_stack = re.compile(r"f32\[8,\d+,\d+\]")
    assert not [c for c in found if full_stack.search(c[1])], found
    # per-device argument bytes = each array's shard (the stage's share of the blocks)
    blocks = prog.abstract_state["params"]["blocks"]
    w_in = blocks["w_in_df"]
    assert w_in.sharding.shard_shape(w_in.shape) == (4, 16, 32)  # 8 layers / 2 stages, fsdp, tensor
    shard_bytes = sharding.shard_bytes([prog.abstract_state, prog.abstract_batch()])
    assert compiled.memory_analysis().argument_size_in_bytes == shard_bytes


@pytest.mark.slow
def test_gpt_trains_with_pipeline_tensor_data_like_plain_run():
    base = ["model.n_layers=4", "train.steps=5", "optimizer.warmup_steps=1", "optimizer.learning_rate=0.01"]
    *_, plain = setup("gpt", *base, "mesh.data=8")
    # pipelined run also accumulates 2 micro-steps and rematerialises every layer
    *_, piped = setup("gpt", *base, "mesh.pipeline=2", "mesh.tensor=2", "mesh.data=2",
                      "train.grad_accum_steps=2", "train.remat=full")
    plain_losses, piped_losses = run_steps(plain, 5)[1], run_steps(piped, 5)[1]
    assert piped_losses[-1] < piped_losses[0] - 0.1
    np.testing.assert_allclose(piped_losses, plain_losses, rtol=1e-4)


@pytest.mark.slow
def test_bfloat16_compute_pipeline_matches_plain():
    base = ["train.compute_dtype=bfloat16", "train.steps=2"]
    *_, plain = setup("mlp", *base, "mesh.data=8")
    *_, piped = setup("mlp", *base, "mesh.pipeline=2", "mesh.fsdp=4", "train.pipeline.schedule=circular",
                      "train.pipeline.repeats=2", "train.pipeline.microbatches=2")
    np.testing.assert_allclose(run_steps(piped, 2)[1], run_steps(plain, 2)[1], rtol=2e-2)
