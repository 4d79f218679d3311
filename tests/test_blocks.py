"""blocks.py: the layer scan the trainer runs a model's stacked blocks with: one rolled scan over
the layers (`train.scan_unroll` per iteration), each layer rematerialised by `train.remat`'s policy
(that the policies keep the numbers: tests/test_step.py::test_remat_policies_keep_the_numbers)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from conftest import TINY
from shardtrain import blocks, config, sharding


def scan_equations(*overrides):
    cfg = config.load(None, [*TINY, "model.name=gpt", "model.n_heads=2", "model.n_kv_heads=2", "model.n_layers=4",
                             *overrides])
    graphdef, params = nnx.split(sharding.model_class(cfg)(cfg.model, rngs=nnx.Rngs(params=0)))
    run = blocks.scan_runner(cfg)
    x_btd = jnp.zeros((2, 16, cfg.model.d_model))
    jaxpr = jax.make_jaxpr(lambda p: run(nnx.merge(graphdef, p).blocks, x_btd))(params)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1
    return scans[0], {e.primitive.name for e in scans[0].params["jaxpr"].jaxpr.eqns}


@pytest.mark.parametrize("remat, policy", [("full", blocks.REMAT_POLICIES["full"]),
                                           ("dots", blocks.REMAT_POLICIES["dots"])])
def test_each_layer_is_rematerialised_by_the_configured_policy(remat, policy):
    scan, inside = scan_equations(f"train.remat={remat}")
    remats = [e for e in scan.params["jaxpr"].jaxpr.eqns if e.primitive.name.startswith(("checkpoint", "remat"))]
    assert len(remats) == 1 and remats[0].params["policy"] is policy
    _, plain = scan_equations("train.remat=none")
    assert not any(name.startswith(("checkpoint", "remat")) for name in plain)


def test_one_rolled_scan_over_the_layers_unrolled_as_configured():
    scan, _ = scan_equations("train.scan_unroll=2")
    assert scan.params["length"] == 4 and scan.params["unroll"] == 2
