"""blocks.py: the layer scan the trainer runs a model's stacked blocks with: one rolled scan over
the layers (`train.scan_unroll` per iteration), each layer rematerialised by `train.remat`'s policy
(that the policies keep the numbers: tests/test_step.py::test_remat_policies_keep_the_numbers)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from conftest import TINY
from shardtrain import config
from shardtrain.parallel import blocks, sharding


def scan_equations(*overrides, count=1):
    """The layer scan's equation and the primitives inside it (`count` None: also the whole jaxpr)."""
    cfg = config.load(None, [*TINY, "model.name=gpt", "model.n_heads=2", "model.n_kv_heads=2", "model.n_layers=4",
                             *overrides])
    graphdef, params = nnx.split(sharding.model_class(cfg)(cfg.model, rngs=nnx.Rngs(params=0)))
    run = blocks.scan_runner(cfg)
    x_btd = jnp.zeros((2, 16, cfg.model.d_model))
    jaxpr = jax.make_jaxpr(lambda p: run(nnx.merge(graphdef, p).blocks, x_btd))(params)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    if count is None:
        return scans[0], {e.primitive.name for e in scans[0].params["jaxpr"].jaxpr.eqns}, jaxpr
    assert len(scans) == count
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


def test_mixed_layer_kinds_scan_over_groups_and_the_program_does_not_grow_with_depth():
    """Gemma 3's pattern (five local layers, one global): one rolled scan over groups of six layers,
    each a remat of its own kind, then the partial group's layers; 12 or 24 layers (and the same
    partial group after them) give programs of one size."""
    pattern = "model.layer_pattern=[local,local,local,local,local,global]"

    def program(n_layers):
        scan, inside, _ = scan_equations(pattern, "model.sliding_window=4", f"model.n_layers={n_layers}",
                                         "train.remat=full", count=None)
        return scan, inside
    scan, _ = program(12)
    remats = [e for e in scan.params["jaxpr"].jaxpr.eqns if e.primitive.name.startswith(("checkpoint", "remat"))]
    assert scan.params["length"] == 2 and len(remats) == 6
    assert program(12)[1] == program(24)[1]
    sizes = {n: len(str(scan_equations(pattern, "model.sliding_window=4", f"model.n_layers={n}", count=None)[2]))
             for n in (14, 26)}  # two groups + 2 layers, four groups + 2 layers
    assert sizes[14] == sizes[26]


def test_dense_then_moe_layers_are_two_rolled_scans_whatever_the_depth():
    """DeepSeek's first dense layers then MoE layers (model.moe.first_dense_layers): a scan over each
    stack, in that order; 2 + 2 or 3 + 6 layers give programs of one size."""
    deepseek = ["model.moe.n_experts=4", "model.moe.router=sigmoid", "model.moe.n_groups=2",
                "model.mla={kv_lora_rank: 16, q_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, "
                "v_head_dim: 12}"]

    def program(dense, n_layers):
        _, _, jaxpr = scan_equations(*deepseek, f"model.moe.first_dense_layers={dense}", f"model.n_layers={n_layers}",
                                     count=None)
        scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert [s.params["length"] for s in scans] == [dense, n_layers - dense]
        assert "ragged_dot_general" in str(scans[1]) and "ragged_dot_general" not in str(scans[0])
        return len(str(jaxpr))
    assert program(2, 4) == program(3, 9)  # the same digits in the shapes: the same text
