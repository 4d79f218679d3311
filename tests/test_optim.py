"""The optimizers and learning-rate schedules (shardtrain/optim.py): each optimizer's update on a
2x2x2 mesh equals one device's, its state sharded like the parameters; the schedules' values and
one-line descriptions; the schedule across a resume (recorded at the run's start, kept when
train.steps grows, re-planned only by an explicit schedule field); a resume by another optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from conftest import TINY
from shardtrain import config, optim, step
from shardtrain.parallel import mesh as mesh_lib, sharding

OPTIMIZERS = ("adamw", "adafactor", "muon", "lion")
WIDE = [*TINY, "model.d_model=128", "model.d_ff=256", "model.n_heads=4", "model.n_kv_heads=4",
        "optimizer.warmup_steps=0"]
"""Wide enough for Adafactor to factor (optax factors axes of >= 128): the MLP's (2, 128, 256), the
(256, 128) embedding; the attention weights' (2, 128, 4, 32) keep a full second moment."""


def resumed_from(*overrides, step: int) -> dict:
    """The meta of checkpoint `step` of a run started with `overrides` (its config as resolved then)."""
    cfg, _ = optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=2", *overrides]), None)
    return {"step": step, "config": config.to_dict(cfg)}


def test_more_steps_keep_the_recorded_decay_and_the_lr_stays_at_its_end():
    cfg, line = optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=2", "train.steps=30"]),
                                       resumed_from("train.steps=20", step=20))
    lr = optim.schedule(cfg)
    assert cfg.optimizer.decay_steps == 20
    assert [float(lr(s)) for s in range(20, 30)] == pytest.approx([3e-4] * 10) and float(lr(19)) > 3e-4
    assert line == ("lr from step 20 (0.0003): 0.0003 from step 20 to 30 (the schedule recorded at the run's "
                    "start; optimizer.decay_steps=N re-plans the decay)")


def test_an_explicit_decay_re_plans_and_says_what_changed():
    cfg, line = optim.resolve_schedule(
        config.load(None, ["optimizer.warmup_steps=2", "train.steps=40", "optimizer.decay_steps=40"]),
        resumed_from("train.steps=20", step=10))
    assert cfg.optimizer.decay_steps == 40
    assert line.startswith("lr from step 10 (0.00") and line.endswith(
        "cosine decay to 0.0003 at step 40 (re-planned: decay_steps 20 -> 40)")


def test_a_checkpoint_from_before_the_schedule_was_recorded_keeps_its_train_steps():
    meta = resumed_from("train.steps=20", step=20)
    meta["config"]["optimizer"]["decay_steps"] = None  # as checkpoints written before this was resolved
    cfg, _ = optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=2", "train.steps=50"]), meta)
    assert cfg.optimizer.decay_steps == 20


def test_a_fresh_run_resolves_decay_to_its_steps():
    cfg, line = optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=2", "train.steps=20"]), None)
    assert cfg.optimizer.decay_steps == 20
    assert line == "lr: linear warmup to 0.003 at step 2, then cosine decay to 0.0003 at step 20"


def updates(name: str, mesh_overrides: list[str], gradients: list[dict], devices=None) -> list[dict]:
    """The updates `name` makes from `gradients`, one after another, its state in the program's shardings."""
    cfg = config.load(None, [*WIDE, f"optimizer.name={name}", *mesh_overrides])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
    shardings = prog.state_shardings
    update = jax.jit(prog.tx.update, in_shardings=(shardings["params"], shardings["opt"], shardings["params"]),
                     out_shardings=(shardings["params"], shardings["opt"]))
    state, out = prog.init(0), []
    opt = state["opt"]
    for g in gradients:
        u, opt = update(jax.device_put(g, shardings["params"]), opt, state["params"])
        out.append(jax.tree.map(np.asarray, u))
    return out


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_update_equals_one_devices(name):
    """Three updates from the same gradients: on a 2x2x2 (data, fsdp, tensor) mesh, with the state
    sharded like the parameters, within 1e-6 of one device's (measured: AdamW and Lion equal,
    Adafactor 3e-9, Muon 6e-9: its Newton-Schulz matmuls sum in another order), for updates of
    about 1e-3 (so 1e-6 is 0.1% of them: a per-shard Muon or a per-shard Adafactor mean would differ by
    far more)."""
    cfg = config.load(None, WIDE)
    shapes = sharding.param_layout(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1])).params
    rng = np.random.default_rng(0)
    gradients = [jax.tree.map(lambda x: (1e-2 * rng.standard_normal(x.shape)).astype(np.float32), shapes)
                 for _ in range(3)]
    one = updates(name, [], gradients, jax.devices()[:1])
    sharded = updates(name, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], gradients)
    for a, b in zip(one, sharded):
        assert max(np.abs(x).max() for x in jax.tree.leaves(a)) > 1e-3
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(y, x, rtol=0, atol=1e-6)


def opt_specs(name: str, *overrides: str) -> tuple[dict, dict]:
    """(path of each optimizer-state leaf -> its PartitionSpec, parameter path -> its PartitionSpec)."""
    cfg = config.load(None, [*WIDE, f"optimizer.name={name}", "mesh.fsdp=4", "mesh.tensor=2", *overrides])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    flat = lambda tree: {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(tree)}  # noqa: E731
    return flat(prog.state_shardings["opt"]), flat(prog.state_shardings["params"])


@pytest.mark.parametrize("name, moments", [
    ("adamw", ["[1][0].mu", "[1][0].nu"]),
    ("lion", ["[1][0].mu"]),
    ("muon", ["[1].inner_states['muon'].inner_state[0].mu", "[1].inner_states['adam'].inner_state[0].mu",
              "[1].inner_states['adam'].inner_state[0].nu"]),
])
def test_moments_are_sharded_like_their_parameters(name, moments):
    opt, params = opt_specs(name)
    for path, spec in opt.items():
        moment = next((m for m in moments if path.startswith(m)), None)
        assert spec == (params[path[len(moment):]] if moment else P()), path  # counters: replicated
    held = {path[len(m):] for path in opt for m in moments if path.startswith(m)}
    assert held == set(params)  # every parameter has its moments (muon: on one side or the other)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    opt, _ = opt_specs("muon")
    side = lambda which: {p.split(".mu")[1] for p in opt if f"['{which}'].inner_state[0].mu" in p}  # noqa: E731
    assert side("adam") == {"['blocks']['attn_norm']", "['blocks']['mlp_norm']", "['embedding_vd']",
                            "['final_norm']", "['unembed_dv']"}
    assert side("muon") == {f"['blocks']['{w}']" for w in
                            ("w_down_fd", "w_gate_df", "w_up_df", "wk_dke", "wo_hed", "wq_dhe", "wv_dke")}
    matrices = optim.muon_matrices({"blocks": {"wq_dhe": ("layers", "embed", "heads", None),
                                               "wo_hed": ("layers", "heads", None, "embed")},
                                    "embedding_vd": ("vocab", "embed")})
    assert matrices == {"['blocks']['wq_dhe']": optax.contrib.MuonDimensionNumbers((1,), (2, 3)),
                        "['blocks']['wo_hed']": optax.contrib.MuonDimensionNumbers((1, 2), (3,)),
                        "['embedding_vd']": None}


def test_adafactor_factored_statistics_take_the_matching_axis_of_their_parameter():
    opt, params = opt_specs("adafactor")
    assert params["['blocks']['w_up_df']"] == P(None, "fsdp", "tensor")  # (2, 128, 256)
    assert opt["[1][0].v_row['blocks']['w_up_df']"] == P(None, "fsdp")  # its largest axis (256) averaged out
    assert opt["[1][0].v_col['blocks']['w_up_df']"] == P(None, "tensor")  # its second largest (128)
    assert opt["[1][0].v['blocks']['w_up_df']"] == P()  # a (1,) placeholder
    assert params["['embedding_vd']"] == P("tensor", "fsdp")  # (256, 128)
    assert opt["[1][0].v_row['embedding_vd']"] == P("fsdp") and opt["[1][0].v_col['embedding_vd']"] == P("tensor")
    # (2, 128, 4, 32): second largest axis 32 < 128, so a full second moment sharded like it
    assert opt["[1][0].v['blocks']['wq_dhe']"] == params["['blocks']['wq_dhe']"]
    assert opt["[1][0].v_row['blocks']['wq_dhe']"] == opt["[1][0].v_col['blocks']['wq_dhe']"] == P()


def test_a_state_leaf_of_an_unknown_shape_is_an_error_not_a_guess():
    transposed = optax.GradientTransformation(lambda params: jax.tree.map(lambda x: jnp.zeros(x.shape[::-1]), params),
                                              lambda u, s, p=None: (u, s))
    mesh = mesh_lib.make_mesh(config.load(None, ["mesh.fsdp=8"]).mesh)
    params = {"w_df": jax.ShapeDtypeStruct((8, 16), jnp.float32,
                                           sharding=jax.sharding.NamedSharding(mesh, P("fsdp", None)))}
    with pytest.raises(ValueError, match=r"optimizer state \['w_df'\] \(16, 8\) of a parameter \(8, 16\)"):
        optim.state_specs(transposed, params)


def test_optimizer_state_bytes_per_device():
    """The compiled step's argument bytes are the abstract state's shards (so plan's optimizer bytes
    are each optimizer's own), and the state sizes order as their moments do."""
    sizes = {}
    for name in OPTIMIZERS:
        cfg = config.load(None, [*WIDE, f"optimizer.name={name}", "mesh.fsdp=4", "mesh.tensor=2"])
        prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
        sizes[name] = sharding.shard_bytes(prog.abstract_state["opt"])
    params = sharding.shard_bytes(prog.abstract_state["params"])
    assert sizes["adamw"] == pytest.approx(2 * params, abs=64)  # two moments (+ counters)
    assert sizes["lion"] == pytest.approx(params, abs=64)
    assert params * 0.9 < sizes["muon"] < 2 * params  # momentum, plus a second moment on AdamW's side
    assert sizes["adafactor"] < 0.5 * params


@pytest.mark.parametrize("schedule, lrs, line", [
    ("wsd", {0: 0.0, 5: 1.5e-3, 10: 3e-3, 30: 3e-3, 48: 3e-3, 54: 1.65e-3, 60: 3e-4, 70: 3e-4},
     "lr: linear warmup to 0.003 at step 10, then 0.003 to step 48, then linear decay to 0.0003 at step 60"),
    ("constant", {0: 0.0, 5: 1.5e-3, 10: 3e-3, 59: 3e-3, 70: 3e-3},
     "lr: linear warmup to 0.003 at step 10, then 0.003 from step 10 to 60"),
    ("cosine", {0: 0.0, 5: 1.5e-3, 10: 3e-3, 35: 1.65e-3, 60: 3e-4},
     "lr: linear warmup to 0.003 at step 10, then cosine decay to 0.0003 at step 60"),
])
def test_schedule_values_and_their_line(schedule, lrs, line):
    """warmup 10 of 60 steps; wsd decays over the last 0.2 x 60 = 12 steps (48..60), linearly."""
    cfg, said = optim.resolve_schedule(config.load(None, [f"optimizer.schedule={schedule}", "optimizer.warmup_steps=10",
                                                          "train.steps=60"]), None)
    lr = optim.schedule(cfg)
    assert {s: float(lr(s)) for s in lrs} == pytest.approx(lrs, rel=1e-6, abs=1e-12)
    assert said == line


@pytest.mark.parametrize("overrides, line", [
    (["train.steps=4"], "lr: linear warmup to 0.003 at step 10, then cosine decay to 0.0003 at step 11; "
                        "optimizer.warmup_steps=10 is past train.steps=4: the LR ends at 0.0012, never reaching 0.003"),
    (["train.steps=40", "optimizer.decay_steps=8"],
     "lr: linear warmup to 0.003 at step 10, then cosine decay to 0.0003 at step 11, then 0.0003 from step 11 to 40; "
     "optimizer.warmup_steps=10 >= optimizer.decay_steps=8: the decay takes one step"),
    (["train.steps=4", "optimizer.schedule=constant"],
     "lr: linear warmup to 0.003 at step 10; optimizer.warmup_steps=10 is past train.steps=4: the LR ends at 0.0012, "
     "never reaching 0.003"),
])
def test_a_warmup_longer_than_the_schedule_is_said(overrides, line):
    assert optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=10", *overrides]), None)[1] == line


def test_wsd_decay_fraction_and_a_resume_inside_the_decay():
    cfg, line = optim.resolve_schedule(
        config.load(None, ["optimizer.schedule=wsd", "optimizer.decay_fraction=0.5", "optimizer.warmup_steps=2",
                           "train.steps=20"]),
        resumed_from("optimizer.schedule=wsd", "optimizer.decay_fraction=0.5", "train.steps=20", step=15))
    assert optim.stable_end(cfg) == 10 and float(optim.schedule(cfg)(15)) == pytest.approx(1.65e-3)
    assert line == ("lr from step 15 (0.00165): linear decay to 0.0003 at step 20 (the schedule recorded at the "
                    "run's start; optimizer.decay_steps=N re-plans the decay)")


def test_a_checkpoint_from_before_optimizer_name_and_schedule_is_adamw_with_cosine():
    meta = resumed_from("train.steps=20", step=20)
    for field in ("name", "schedule", "decay_fraction"):
        del meta["config"]["optimizer"][field]
    optim.check_resume(config.load(None, ["train.steps=30"]), meta, "/ckpt")
    _, line = optim.resolve_schedule(config.load(None, ["optimizer.warmup_steps=2", "train.steps=30"]), meta)
    assert "re-planned" not in line
    with pytest.raises(config.ConfigError) as e:
        optim.check_resume(config.load(None, ["optimizer.name=lion"]), meta, "/ckpt")
    assert str(e.value) == ("optimizer.name=lion: checkpoint step 20 in /ckpt holds adamw's optimizer state; resume "
                            "with optimizer.name=adamw, or start lion from its weights with a fresh optimizer state: "
                            "checkpoint.init_from=/ckpt/20 and another run_dir")


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.name=sgd"], "optimizer.name: 'sgd' is not one of: adamw, adafactor, muon, lion"),
    (["optimizer.schedule=linear"], "optimizer.schedule: 'linear' is not one of: cosine, wsd, constant"),
    (["optimizer.decay_fraction=0"], "optimizer.decay_fraction: must be in (0, 1]"),
    (["optimizer.decay_fraction=1.5"], "optimizer.decay_fraction: must be in (0, 1]"),
    (["optimizer.name=muon", "model.lora.rank=4"], "optimizer.name=muon does not combine with LoRA"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(config.ConfigError) as e:
        config.load("meshes/demo.yaml", overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_switching_the_schedule_on_a_resume_re_plans_and_says_so():
    cfg, line = optim.resolve_schedule(
        config.load(None, ["optimizer.warmup_steps=2", "optimizer.schedule=wsd", "train.steps=20"]),
        resumed_from("train.steps=20", step=10))
    assert float(optim.schedule(cfg)(10)) == pytest.approx(3e-3)  # stable until 16, where the cosine had decayed
    assert line == ("lr from step 10 (0.003): 0.003 to step 16, then linear decay to 0.0003 at step 20 "
                    "(re-planned: schedule cosine -> wsd)")


@pytest.mark.parametrize("name, overrides", [
    ("adafactor", ["train.comm.grad_reduce_dtype=int8", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    ("lion", ["train.comm.sync=local_sgd", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    ("muon", ["mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", "model.n_layers=4"]),
    ("muon", ["model.moe.n_experts=4", "model.moe.experts_per_token=2", "mesh.expert=2", "mesh.fsdp=2",
              "mesh.tensor=2"]),
    ("adafactor", ["model.name=llama", "model.lora.rank=2", "mesh.fsdp=4", "mesh.tensor=2"]),
])
def test_each_optimizer_combines_with_the_other_step_modes(name, overrides):
    """Compressed reduction, local SGD, pipelines, MoE and LoRA wrap or shard the optimizer's state:
    two steps run, the second's loss below the first's (same batch, no warmup)."""
    cfg = config.load(None, [*TINY, f"optimizer.name={name}", "optimizer.warmup_steps=0", *overrides])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, prog.abstract_batch().shape, dtype=np.int32)
    state, batch, losses = prog.init(0), jax.device_put(tokens, prog.batch_sharding), []
    for _ in range(2):
        state, metrics = prog.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[1] < losses[0]


def test_the_start_of_a_run_names_the_optimizer_and_its_state_per_device():
    from shardtrain import loop
    cfg = config.load(None, [*WIDE, "optimizer.name=lion", "mesh.fsdp=4", "mesh.tensor=2"])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    mib = sharding.shard_bytes(prog.abstract_state["params"]) / 2**20  # lion: one momentum (+ a counter)
    assert loop.optimizer_line(prog) == (f"optimizer: lion after clipping at global norm 1; {mib:.2f} MiB of state "
                                         "per device")
