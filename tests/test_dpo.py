"""train.objective=dpo: the DPO, IPO and SimPO losses against a NumPy computation of their formulas
from an unsharded model's log-probs, on one device and on 2x2x2; log 2 at the first step of a frozen
reference; LoRA's reference is the base model."""

import functools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from shardtrain import config, dpo, step
from shardtrain.data import preference
from shardtrain.parallel import mesh as mesh_lib, sharding

TINY = ["data.source=tokens", "data.path=unused", "train.objective=dpo", "model.vocab_size=64", "data.seq_len=15",
        "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.n_layers=2", "model.d_ff=64",
        "train.global_batch_size=8"]
ONE, CUBE = ("mesh.data=1",), ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


def pair_batch(seed: int = 0) -> dict:
    """8 pairs of 16-token rows: a prompt of 3-6 tokens, completions of 2-9, zero padding after."""
    rng, batch = np.random.default_rng(seed), {k: np.zeros((8, 16), np.int32) for k in preference.PAIR_FIELDS}
    for i in range(8):
        prompt = rng.integers(1, 64, rng.integers(3, 7))
        for name in ("chosen", "rejected"):
            ids = np.concatenate([prompt, rng.integers(1, 64, rng.integers(2, 10))])
            batch[name][i, :len(ids)], batch[f"{name}_mask"][i, len(prompt):len(ids)] = ids, 1
    return batch


def numpy_logps(model, batch) -> list:
    """[(summed log-probs, counted tokens) of chosen, the same of rejected], float64, from the model's logits."""
    out = []
    for name in ("chosen", "rejected"):
        tokens, mask = batch[name], batch[f"{name}_mask"][:, 1:]
        logits = np.asarray(model(jax.numpy.asarray(tokens[:, :-1])), np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        out.append(((np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0] * mask).sum(-1), mask.sum(-1)))
    return out


def numpy_values(d, policy: list, reference: list | None) -> dict:
    """The logged values by the formulas of dpo.py's docstring (`d`: the dpo section)."""
    (pc, nc), (pr, nr) = policy
    rc, rr = (reference[0][0], reference[1][0]) if reference else (0 * pc, 0 * pr)
    log_sigmoid = lambda z: -np.log1p(np.exp(-z))  # noqa: E731
    if d.loss == "ipo":
        hc, hr = (pc - rc) / nc, (pr - rr) / nr
        loss, r_c, r_r = (hc - hr - 1 / (2 * d.beta)) ** 2, d.beta * hc, d.beta * hr
    else:
        r_c, r_r = (d.beta * (pc - rc), d.beta * (pr - rr)) if d.loss == "sigmoid" else (d.beta * pc / nc,
                                                                                        d.beta * pr / nr)
        z = r_c - r_r - (d.simpo_gamma if d.loss == "simpo" else 0)
        loss = -(1 - d.label_smoothing) * log_sigmoid(z) - d.label_smoothing * log_sigmoid(-z)
    return {"loss": loss.mean(), "reward_margin": (r_c - r_r).mean(), "reward_accuracy": (r_c > r_r).mean(),
            "chosen_logp": pc.mean(), "rejected_logp": pr.mean()}


def assert_close(got: dict, want: dict) -> None:
    for k, v in want.items():
        assert abs(float(got[k]) - v) <= 1e-6 * max(1.0, abs(v)), (k, float(got[k]), v)


@functools.cache
def models_and_params(mesh: tuple):
    cfg = config.load(None, [*TINY, *mesh])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1] if mesh == ONE else None))
    policy, reference = prog.init(0)["params"], prog.init(1)["params"]
    graphdef = nnx.split(sharding.abstract_model(cfg))[0]
    logps = [numpy_logps(nnx.merge(graphdef, jax.device_get(p)), pair_batch()) for p in (policy, reference)]
    return prog, policy, reference, logps


@pytest.mark.parametrize("mesh", [ONE, CUBE])
def test_dpo_loss_equals_its_formula_on_one_device_and_sharded(mesh):
    """The whole loss (both models' log-probs through the sharded step's model, the formula, the means)."""
    prog, policy, reference, logps = models_and_params(mesh)
    cfg = config.load(None, [*TINY, *mesh, "dpo.beta=0.5", "dpo.label_smoothing=0.2"])
    loss = dpo.loss_fn(cfg, dpo.sequence_logps_fn(cfg, prog.layout.graphdef, step.blocks_runner(cfg, prog.mesh, None)),
                       sharding.Constrain(cfg.rules, prog.mesh))
    batch = pair_batch()
    _, got = jax.jit(loss)(policy, reference, prog.device_batch(batch))
    want = numpy_values(cfg.dpo, *logps)
    assert_close(got, want)
    assert 0 < want["reward_accuracy"] < 1 and want["reward_margin"] != 0  # the batch tells rewards apart


@pytest.mark.parametrize("variant", [["dpo.loss=ipo"], ["dpo.loss=simpo"],
                                     ["dpo.loss=simpo", "dpo.label_smoothing=0.1"], ["dpo.reference=none"]])
def test_ipo_simpo_and_reference_free_losses_equal_their_formulas(variant):
    policy, reference = models_and_params(ONE)[3]
    d = config.load(None, [*TINY, "dpo.beta=0.5", *variant]).dpo
    frozen = d.reference == "frozen" and d.loss != "simpo"
    (pc, nc), (pr, nr) = policy
    rc, rr = (reference[0][0], reference[1][0]) if frozen else (0 * pc, 0 * pr)
    f32 = lambda x: jax.numpy.asarray(x, jax.numpy.float32)  # noqa: E731
    loss, r_c, r_r = dpo.pair_losses(d, *map(f32, (pc, pr, rc, rr, nc, nr)))
    got = {"loss": loss.mean(), "reward_margin": (r_c - r_r).mean(), "reward_accuracy": (r_c > r_r).mean(),
           "chosen_logp": pc.mean(), "rejected_logp": pr.mean()}
    assert_close(got, numpy_values(d, policy, reference if frozen else None))


def test_first_step_with_the_frozen_reference_gives_log_2():
    prog = models_and_params(CUBE)[0]
    state = prog.init(0)
    assert set(state) == {"params", "opt", "step", "reference"}  # the reference has no optimizer state
    batch = prog.device_batch(pair_batch())
    state, first = prog.step(state, batch)
    assert abs(float(first["loss"]) - math.log(2)) < 1e-6 and float(first["reward_margin"]) == 0
    state, _ = prog.step(state, batch)  # step 1's learning rate is 0 (warmup), step 2's is not
    assert any(float(abs(a - b).max()) > 0 for a, b in zip(jax.tree.leaves(state["params"]),
                                                          jax.tree.leaves(state["reference"])))  # only params moved


def test_reference_free_simpo_trains_on_2x2x2_with_each_pair_on_its_shard():
    """A pair's chosen and rejected rows sit side by side on one shard: the compiled step moves no
    row between devices (on XLA:CPU the collective-permutes that once paired them, independent of the
    forward pass, deadlocked the devices' rendezvous), and two steps train."""
    cfg = config.load(None, [*TINY, *CUBE, "dpo.loss=simpo", "dpo.reference=none", "dpo.beta=0.5"])
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    assert "collective-permute" not in prog.lower().compile().as_text()
    state, batch = prog.init(0), prog.device_batch(pair_batch())
    losses = []
    for _ in range(3):
        state, values = prog.step(state, batch)
        losses.append(float(values["loss"]))
    policy, _ = models_and_params(CUBE)[3]  # numpy log-probs of the same seed's params
    assert abs(losses[0] - numpy_values(cfg.dpo, policy, None)["loss"]) < 1e-5
    assert losses[2] < losses[0]


def test_lora_reference_is_the_base_model():
    """With LoRA the state holds no copy; the reference (adapters off) gives the base model's log-probs."""
    cfg = config.load(None, [*TINY, *CUBE, "model.lora.rank=4"])
    base_cfg = config.load(None, [*TINY, *CUBE, "dpo.reference=none"])
    prog, base = (step.build(c, mesh_lib.make_mesh(c.mesh)) for c in (cfg, base_cfg))
    params = prog.init(0)["params"]
    assert "reference" not in prog.abstract_state
    params = jax.tree_util.tree_map_with_path(  # adapters that change the model
        lambda path, p: p + 0.5 if "lora_b" in str(path[-1]) else p, params)
    seq = dpo.sequence_logps_fn(cfg, prog.layout.graphdef, step.blocks_runner(cfg, prog.mesh, None))
    base_seq = dpo.sequence_logps_fn(base_cfg, base.layout.graphdef, step.blocks_runner(base_cfg, base.mesh, None))
    without = {**params, "blocks": {k: v for k, v in params["blocks"].items() if "lora" not in k}}
    batch = pair_batch()
    tokens, mask = batch["chosen"], batch["chosen_mask"]
    ref = jax.jit(seq)(dpo.reference_of(cfg, {"params": params}), tokens, mask)[0]
    want = jax.jit(base_seq)(without, tokens, mask)[0]
    adapted = jax.jit(seq)(params, tokens, mask)[0]
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), rtol=1e-6)
    assert float(abs(adapted - want).max()) > 1e-3
