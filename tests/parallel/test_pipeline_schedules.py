"""Explicit pipeline schedules (1F1B, interleaved 1F1B, zero-bubble): the train step's loss and
gradients equal the unpipelined step's; their timetables; the compiled program's memory bound."""

import jax
import numpy as np
import pytest

from conftest import TINY
from shardtrain import config, step as step_lib
from shardtrain.parallel import mesh as mesh_lib

SMALL = [*TINY, "model.n_layers=8", "model.n_heads=2", "model.n_kv_heads=2", "train.global_batch_size=32"]


def build(model, *overrides, n_devices=8):
    cfg = config.load(None, [f"model.name={model}", *SMALL, *overrides])
    return step_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:n_devices]))


@pytest.fixture(scope="module")
def gpt_reference():
    """(host params, tokens, loss, grads) of the plain GPT on one device, by the train step's own
    `loss_and_grads`."""
    prog = build("gpt", n_devices=1)
    params = jax.device_get(prog.init(0)["params"])
    tokens_bt = np.asarray(jax.random.randint(jax.random.key(1), (32, 17), 0, prog.cfg.model.vocab_size))
    losses, grads = prog.loss_and_grads(params, tokens_bt)
    return params, tokens_bt, float(losses["loss"]), jax.device_get(grads)


def assert_step_matches(reference, prog, tol=1e-5):
    params, tokens_bt, loss_ref, grads_ref = reference
    losses, grads = prog.loss_and_grads(jax.device_put(params, prog.state_shardings["params"]),
                                        jax.device_put(tokens_bt, prog.batch_sharding))
    assert abs(float(losses["loss"]) - loss_ref) <= tol * abs(loss_ref), (float(losses["loss"]), loss_ref)
    for (path, g), g_ref in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads_ref)):
        err = np.max(np.abs(np.asarray(g) - g_ref)) / np.max(np.abs(g_ref))
        assert err <= tol, f"gradient {jax.tree_util.keystr(path)} differs by {err:.1e} relative"


@pytest.mark.parametrize("schedule,mesh_overrides,extra", [
    ("1f1b", ("mesh.pipeline=4", "mesh.data=2"), ("train.pipeline.microbatches=4",)),
    ("1f1b", ("mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2"), ("train.pipeline.microbatches=4",
                                                                    "train.grad_accum_steps=2")),
    ("zero_bubble", ("mesh.pipeline=4", "mesh.data=2"), ("train.pipeline.microbatches=2",
                                                         "train.grad_accum_steps=2")),
    ("zero_bubble", ("mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2"), ("train.pipeline.microbatches=8",)),
    ("interleaved_1f1b", ("mesh.pipeline=4", "mesh.data=2"), ("train.pipeline.microbatches=4",
                                                              "train.pipeline.repeats=2")),
    ("interleaved_1f1b", ("mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2"), (
        "train.pipeline.microbatches=4", "train.pipeline.repeats=2", "train.grad_accum_steps=2")),
])
def test_schedule_matches_plain(gpt_reference, schedule, mesh_overrides, extra):
    prog = build("gpt", *mesh_overrides, f"train.pipeline.schedule={schedule}", *extra)
    assert_step_matches(gpt_reference, prog)
