"""`step.build` as the single producer of what later code needs: one abstract trace of the model and
one optimizer per build; the pipeline schedule made once and read by the loop and the planner;
`fresh_state` gives init's state; the eval step; HF import/export lay parameters out without a
train step, and a layout that does not fit is an error, never a fallback to one device."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import models
from conftest import TINY
from models.gpt import Gpt
from shardtrain import config, loop, optim, step, weights
from shardtrain.parallel import mesh as mesh_lib, pipeline, sharding
from shardtrain.plan import planner

GPT = [*TINY, "model.name=gpt", "model.n_heads=2", "model.n_kv_heads=2"]


def build(*overrides, devices=None):
    cfg = config.load(None, [*GPT, *overrides])
    return step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))


@pytest.fixture
def calls(monkeypatch):
    """Counts of model constructions, optimizers made and micro-batch computations (the real
    functions still run)."""
    counts = {"model": 0, "optimizer": 0, "microbatches": 0}

    class CountingGpt(Gpt):
        def __init__(self, *args, **kwargs):
            counts["model"] += 1
            super().__init__(*args, **kwargs)

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(models, "get", lambda name: CountingGpt)
    monkeypatch.setattr(optim, "make", counted("optimizer", optim.make))
    monkeypatch.setattr(pipeline, "microbatches", counted("microbatches", pipeline.microbatches))
    return counts


def test_build_traces_the_model_once_and_makes_one_optimizer(calls):
    prog = build("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    assert calls == {"model": 1, "optimizer": 1, "microbatches": 0}
    assert prog.schedule is None and prog.param_count() > 0
    prog.lower()  # the step reuses the build's model structure: no constructor runs
    prog.fresh_state.lower(prog.layout.params)
    prog.eval_step.lower(prog.layout.params, prog.abstract_batch())
    assert calls["model"] == 1 and calls["optimizer"] == 1
    assert prog.flops_per_token == Gpt.flops_per_token(prog.cfg.model, prog.param_count(), prog.cfg.data.seq_len)


def test_schedule_is_made_once_and_read_by_loop_and_planner(calls):
    prog = build("mesh.data=1", "mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2")
    assert prog.schedule == (2, 1, 4, "gpipe")  # the largest M <= 4 x 2 stages dividing the 8 / 2 fsdp rows
    assert "pipeline gpipe, 2 stages, 4 micro-batches" in loop.mode_line(prog)
    assert planner.pipeline_schedule(prog) == {"schedule": "gpipe", "stages": 2, "microbatches": 4, "repeats": 1,
                                            "bubble_fraction": pytest.approx(1 / 5), "live_microbatches": 4}
    assert calls["microbatches"] == 1 and calls["model"] == 1


@pytest.mark.parametrize("mode", [["model.name=mlp"], ["model.lora.rank=4"],
                                  ["model.name=mlp", "train.comm.grad_reduce_dtype=int8"],
                                  ["model.name=mlp", "train.comm.sync=local_sgd", "train.comm.sync_every=2"]])
def test_fresh_state_is_inits_state_for_the_same_params(mode):
    """One spelling of the state: fresh_state(params) equals init's state (LoRA's frozen weights
    without optimizer state; comm.py's entries included)."""
    prog = build("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *mode)
    state = prog.init(3)
    fresh = prog.fresh_state(jax.tree.map(jnp.copy, state["params"]))  # the copies are donated
    assert jax.tree.structure(fresh) == jax.tree.structure(state)
    assert jax.tree.structure(state) == jax.tree.structure(prog.abstract_state)
    for a, b, want in zip(jax.tree.leaves(fresh), jax.tree.leaves(state), jax.tree.leaves(prog.abstract_state)):
        assert a.sharding == b.sharding == want.sharding and a.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_eval_step_on_a_mesh_sums_what_one_device_sums():
    tokens = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    one = build(devices=jax.devices()[:1])
    params = jax.device_get(one.init(0)["params"])
    sharded = build("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    total, count = sharded.eval_step(jax.device_put(params, sharded.layout.shardings),
                                     jax.device_put(tokens, sharded.batch_sharding))
    ref_total, ref_count = jax.jit(one.loss_sums)(params, tokens)
    assert total.sharding.is_fully_replicated and float(count) == float(ref_count) == 8 * 16
    assert abs(float(total) - float(ref_total)) <= 1e-5 * abs(float(ref_total))


def test_layout_alone_serves_hf_import_export_and_a_misfit_is_an_error(calls):
    cfg = config.load(None, [*GPT, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    layout = weights.fsdp_layout(cfg)  # every device present, all FSDP, whatever mesh cfg trains on
    assert calls == {"model": 1, "optimizer": 0, "microbatches": 0}
    assert dict(layout.mesh.shape)["fsdp"] == 8 and layout.shardings["embedding_vd"].spec == P(None, "fsdp")
    assert layout.params["embedding_vd"].sharding == layout.shardings["embedding_vd"]
    misfit = config.load(None, [*GPT, "model.d_model=36", "model.n_heads=2", "model.n_kv_heads=2"])
    with pytest.raises(config.ConfigError, match=r"over all 8 devices present \(FSDP\): parameter \S+ \(.*\): "
                                                 r"dimension \d \('embed'\) of size 36 is not divisible"):
        weights.fsdp_layout(misfit)
    assert sharding.param_layout(misfit, mesh_lib.make_mesh(misfit.mesh, jax.devices()[:1])).params


def test_checkpointing_does_not_import_the_step_builder():
    code = "import sys, shardtrain.checkpoint; assert 'shardtrain.step' not in sys.modules, sorted(sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr[-2000:]


def test_lowered_demo_step_is_the_recorded_program():
    """Refactors keep the program: meshes/demo.yaml's lowered step is byte-identical to the one
    recorded in tests/golden/lowered_demo.json (a deliberate change of the program rewrites that
    file: sha256 prefix and length of `prog.lower().as_text()`). Another jax/flax/optax version
    lowers differently, so the record names the versions it holds for."""
    import hashlib
    import json

    import flax
    import optax
    golden = json.loads((Path(__file__).parent / "golden" / "lowered_demo.json").read_text())
    versions = {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}
    if any(golden[k] != v for k, v in versions.items()):
        pytest.skip(f"golden recorded with {[golden[k] for k in versions]}, running {list(versions.values())}")
    cfg = config.load(str(Path(__file__).parents[1] / "meshes" / "demo.yaml"), [])
    text = step.build(cfg, mesh_lib.make_mesh(cfg.mesh)).lower().as_text()
    assert (hashlib.sha256(text.encode()).hexdigest()[:16], len(text)) == (golden["sha256"], golden["chars"])
